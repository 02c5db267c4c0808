"""Asks about a repository that need a coding tool (files, directories, search, tests, commands).

Each generator returns an `Ask` whose arguments come from what was asked (the path, the pattern,
the lines, the command), with a plausible tool result and the answer given after it.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from tools import tiny_entities as E
from tools.tiny_phrasing import Ask, either, pick, question, request

_PATTERNS = (
    "TODO", "FIXME", "import os", "def main", "logger", "parse_args", "timeout", "retry", "DEBUG",
    "os.environ", "subprocess", "print(", "class Config", "raise ValueError", "async def", "open(",
    "api_key", "__version__", "sleep", "json.loads", "self.cache", "max_retries", "deprecated",
)
_EDITS = (
    ("DEBUG = True", "DEBUG = False"), ("localhost", "0.0.0.0"), ("print(", "logger.info("),
    ("timeout=10", "timeout=30"), ("http://", "https://"), ("== None", "is None"), ("assertEquals", "assertEqual"),
    ("version = \"1.0\"", "version = \"1.1\""), ("max_workers=4", "max_workers=8"), ("utf8", "utf-8"),
)
_NATURAL_COMMANDS = (
    ("Check the git status", "git status"), ("What Python version is installed?", "python --version"),
    ("Show me the last 5 commits", "git log --oneline -5"), ("How much disk space is left?", "df -h"),
    ("Which branch am I on?", "git branch"), ("What's the current working directory?", "pwd"),
    ("Which packages are installed?", "pip list"), ("Show the uncommitted changes", "git diff"),
    ("Is docker running any containers?", "docker ps"), ("Lint the code with ruff", "ruff check ."),
)


def _file_body(rng: random.Random, path: str) -> str:
    ext = path.rsplit(".", 1)[-1] if "." in path else ""
    name = rng.choice(E.STEMS).lower()
    if ext in ("yaml", "cfg", "ini", "toml"):
        sep = ": " if ext == "yaml" else " = "
        return "\n".join(f"{k}{sep}{v}" for k, v in [("name", name), ("debug", "false"),
                                                    ("port", rng.randint(1000, 9999)), ("workers", rng.randint(1, 8))])
    if ext == "json":
        return f'{{"name": "{name}", "version": "1.{rng.randint(0, 9)}.0", "private": true}}'
    if ext in ("md", "txt", ""):
        return f"# {name.title()}\n\nNotes about {name}. Run `make {rng.choice(('test', 'build'))}` first."
    return f"import os\n\n\ndef {name}(path):\n    return os.path.exists(path)\n"


def _numbered(text: str, first: int = 1) -> str:
    return "\n".join(f"{n:>5}\t{line}" for n, line in enumerate(text.splitlines(), first))


def read_file(rng: random.Random) -> Ask:
    path = E.file_path(rng)
    if rng.random() < 0.25:
        a = rng.randint(1, 150)
        b = a + rng.randint(5, 60)
        text = either(rng, ("Show me lines {a} to {b} of {path}", "Read {path} from line {a} to {b}",
                            "Print lines {a}-{b} of {path}", "Open {path} at lines {a} through {b}"),
                      ("What's on lines {a} to {b} of {path}?", "Can I see lines {a}-{b} in {path}?"),
                      a=a, b=b, path=path)
        args = {"path": path, "start_line": a, "end_line": b}
        body = _numbered("\n".join(f"# line {n}" for n in range(a, min(b, a + 6) + 1)), a)
        return Ask(text, f"Lines {a}-{b} of {path} are comments.", "read_file", args, body)
    text = either(rng, ("Read {path}", "Show me {path}", "Open {path}", "Display the contents of {path}",
                        "Print {path}", "cat {path}", "Check {path} for me", "Summarize {path}",
                        "Look at {path} and tell me what it does", "Open up {path} so I can see it",
                        "Read through {path}", "Go through {path}"),
                  ("What's in {path}?", "What does {path} contain?", "What is inside the file {path}?",
                   "Can you show me the file {path}?", "How does {path} look?", "Could you open {path}?"),
                  path=path)
    body = _file_body(rng, path)
    answer = pick(rng, f"{path} has {len(body.splitlines())} lines.", f"Here is what {path} contains:\n{body}")
    return Ask(text, answer, "read_file", {"path": path}, _numbered(body))


def list_dir(rng: random.Random) -> Ask:
    d = E.directory(rng)
    where = pick(rng, "the current directory", "the repository root", "here") if d == "." else d
    text = either(rng, ("List the files in {where}", "Show me the contents of {where}", "ls {where}",
                        "List everything under {where}", "Show what is in {where}"),
                  ("What's in {where}?", "What files are in {where}?", "What does {where} contain?",
                   "Which files live in {where}?"),
                  where=where)
    names = sorted({E.file_path(random.Random(rng.random())).rsplit("/", 1)[-1] for _ in range(5)})
    return Ask(text, f"{where} has {len(names)} entries: {', '.join(names)}.", "list_dir", {"path": d},
               "\n".join(names))


def grep(rng: random.Random) -> Ask:
    pattern, d = rng.choice(_PATTERNS), E.directory(rng)
    if rng.random() < 0.5:
        text = either(rng, ("Find where {p} is used in {d}", "Search for {p} in {d}", "grep {p} in {d}",
                            "Look for {p} under {d}", "Find all occurrences of {p} in {d}"),
                      ("Which files in {d} mention {p}?", "Where does {p} appear in {d}?"), p=pattern, d=d)
        args = {"pattern": pattern, "path": d}
    else:
        text = either(rng, ("Search the code for {p}", "grep for {p}", "Find every use of {p}"),
                      ("Where is {p} used?", "Which files mention {p}?", "Where do we use {p}?"), p=pattern)
        args = {"pattern": pattern}
    hits = [f"{E.file_path(rng)}:{rng.randint(1, 300)}: {pattern}" for _ in range(rng.randint(1, 3))]
    return Ask(text, f"{pattern} appears {len(hits)} time{'s' * (len(hits) > 1)}: " + "; ".join(hits),
               "grep", args, "\n".join(hits))


def run_tests(rng: random.Random) -> Ask:
    path = rng.choice(("tests", f"tests/test_{rng.choice(E.STEMS).lower()}.py"))
    verbose = rng.random() < 0.2
    text = either(rng, ("Run the tests in {path}", "Run pytest on {path}", "Execute the tests in {path}",
                        "Test {path}") + (("Run the test suite", "Run the tests") if path == "tests" else ()),
                  ("Do the tests in {path} pass?", "Are the tests in {path} green?"), path=path)
    args = {"path": path}
    if verbose:
        text, args["verbose"] = text.rstrip(".?!") + pick(rng, " with -v", " verbosely", " in verbose mode"), True
    n = rng.randint(2, 40)
    return Ask(text, f"All {n} tests in {path} pass.", "run_tests", args, f"=== {n} passed in 0.{n}s ===")


def edit_file(rng: random.Random) -> Ask:
    path = E.file_path(rng)
    old, new = rng.choice(_EDITS)
    text = request(rng, ("In {path}, replace `{old}` with `{new}`", "Change `{old}` to `{new}` in {path}",
                         "Edit {path}: replace {old} with {new}", "Replace {old} by {new} in {path}",
                         "Swap `{old}` for `{new}` in {path}"), path=path, old=old, new=new)
    return Ask(text, f"Done: {path} now has `{new}` instead of `{old}`.", "edit_file",
               {"path": path, "old": old, "new": new}, f"Edited {path}: 1 replacement.")


def run_command(rng: random.Random) -> Ask:
    if rng.random() < 0.35:
        ask, cmd = rng.choice(_NATURAL_COMMANDS)
        text = question(rng, (ask,)) if ask.endswith("?") else request(rng, (ask,))
    else:
        cmd = rng.choice(E.COMMANDS)
        text = either(rng, ("Run `{cmd}`", "Execute {cmd}", "Run {cmd} in the terminal", "Run the command {cmd}",
                            "Type {cmd} in the shell"), ("What does `{cmd}` print?", "What's the output of {cmd}?"),
                      cmd=cmd)
    return Ask(text, f"`{cmd}` finished without errors.", "run_command", {"command": cmd}, "ok")


def write_file(rng: random.Random) -> Ask:
    path, content = E.file_path(rng), pick(rng, "hello world", "TODO: write docs", "print('hi')", "x = 1",
                                           "# Notes", "DEBUG = False", "name: demo")
    text = request(rng, ("Create a file {path} containing {content}", "Write \"{content}\" to {path}",
                         "Make a new file called {path} with the text {content}", "Save {content} into {path}"),
                   path=path, content=content)
    return Ask(text, f"Created {path}.", "write_file", {"path": path, "content": content}, f"Wrote {path}.")


GENERATORS: dict[str, Callable[[random.Random], Ask]] = {
    "read_file": read_file, "list_dir": list_dir, "grep": grep, "run_tests": run_tests,
    "edit_file": edit_file, "run_command": run_command, "write_file": write_file,
}
