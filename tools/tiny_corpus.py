"""Training corpus of the toy model glm52-tiny: CPython stdlib source plus agent chat transcripts.

Deterministic: the stdlib split is a stable hash of each file's relative path, and transcript `i`
of seed `s` comes from its own `random.Random(f"{s}:{i}")`, so `chat_transcripts(n)` is a prefix of
`chat_transcripts(n + k)`. Transcripts only quote train-split files. Run `python -m tools.tiny_corpus`
for statistics and a sample.
"""

from __future__ import annotations

import ast
import hashlib
import os
import random
import re
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from glmserve.text.chat import render_chat
from glmserve.text.special_tokens import ASSISTANT, ENDOFTEXT, OBSERVATION, SYSTEM, USER

Split = Literal["train", "heldout"]
EXCLUDED_DIRS = frozenset({"site-packages", "test", "tests", "idlelib", "lib2to3", "tkinter", "__pycache__"})
MAX_FILE_BYTES = 200_000
HELDOUT_PERCENT = 2
Message = dict[str, Any]


# ---------------------------------------------------------------- stdlib source


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(relpath: str) -> bool:
    """Stable across runs and machines (unlike `hash()`): sha256 of the posix relative path."""
    return int(hashlib.sha256(relpath.encode()).hexdigest()[:8], 16) % 100 < HELDOUT_PERCENT


def stdlib_files(split: Split = "train") -> list[Path]:
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', not {split!r}")
    root, out = stdlib_root(), []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS]  # prune: test/ alone is huge
        for name in filenames:
            p = Path(dirpath, name)
            if (
                name.endswith(".py")
                and p.stat().st_size <= MAX_FILE_BYTES
                and is_heldout(p.relative_to(root).as_posix()) == (split == "heldout")
            ):
                out.append(p)
    return sorted(out)


def stdlib_texts(split: Split = "train") -> list[str]:
    """File contents; the few files that are not UTF-8 are skipped."""
    out = []
    for p in stdlib_files(split):
        try:
            out.append(p.read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            continue
    return out


# ---------------------------------------------------------------- facts about source files


@dataclass(frozen=True)
class Func:
    name: str  # qualified for methods: Class.method
    lineno: int
    body: int  # first line after the docstring
    end: int
    args: tuple[str, ...]
    doc: str  # first line of the docstring, or ""
    calls: tuple[str, ...]


@dataclass(frozen=True)
class SourceFile:
    rel: str  # e.g. "json/decoder.py"
    lines: tuple[str, ...]
    funcs: tuple[Func, ...]
    doc: str


def _calls(node: ast.AST) -> tuple[str, ...]:
    names: list[str] = []
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            f = n.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            if name and name not in names:
                names.append(name)
    return tuple(names[:4])


def _first_line(doc: str | None) -> str:
    return (doc or "").strip().split("\n")[0].strip()


def parse_source(root: Path, path: Path) -> SourceFile | None:
    try:
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return None
    funcs: list[Func] = []
    for node in tree.body:
        members = (
            [(f"{node.name}.", m) for m in node.body] if isinstance(node, ast.ClassDef) else [("", node)]
        )
        for prefix, f in members:
            if isinstance(f, ast.FunctionDef) and f.end_lineno and f.end_lineno - f.lineno < 80:
                args = tuple(a.arg for a in f.args.args if a.arg not in ("self", "cls"))
                doc = ast.get_docstring(f)
                body = f.body[1].lineno if doc and len(f.body) > 1 else f.body[0].lineno
                funcs.append(
                    Func(prefix + f.name, f.lineno, body, f.end_lineno, args, _first_line(doc), _calls(f))
                )
    if not funcs:
        return None
    return SourceFile(
        path.relative_to(root).as_posix(),
        tuple(text.splitlines()),
        tuple(funcs),
        _first_line(ast.get_docstring(tree)),
    )


# ---------------------------------------------------------------- tools offered to the agent


def _tool(name: str, description: str, params: dict[str, tuple[str, str]], required: list[str]) -> Message:
    props = {k: {"type": t, "description": d} for k, (t, d) in params.items()}
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": props, "required": required},
        },
    }


TOOLS: dict[str, Message] = {
    t["function"]["name"]: t
    for t in [
        _tool(
            "read_file",
            "Read a text file, optionally only a range of lines (1-based, inclusive).",
            {
                "path": ("string", "Path of the file."),
                "start_line": ("integer", "First line."),
                "end_line": ("integer", "Last line."),
            },
            ["path"],
        ),
        _tool(
            "list_dir", "List the entries of a directory.", {"path": ("string", "Directory path.")}, ["path"]
        ),
        _tool(
            "grep",
            "Search files under a path for a regular expression.",
            {"pattern": ("string", "Regular expression."), "path": ("string", "File or directory.")},
            ["pattern", "path"],
        ),
        _tool(
            "run_tests",
            "Run pytest on a file or directory and return its output.",
            {"path": ("string", "Test file or directory."), "verbose": ("boolean", "Pass -v.")},
            ["path"],
        ),
        _tool(
            "edit_file",
            "Replace the exact text `old` with `new` in a file.",
            {
                "path": ("string", "File to edit."),
                "old": ("string", "Text to replace."),
                "new": ("string", "Replacement text."),
            },
            ["path", "old", "new"],
        ),
        _tool(
            "run_command",
            "Run a shell command in the repository root.",
            {"command": ("string", "The command line.")},
            ["command"],
        ),
    ]
}

SYSTEM_PROMPTS = [
    "You are a coding agent working in a Python repository. Use the tools to inspect and change code.",
    "You are a helpful assistant for software engineering tasks.",
    "You are GLM, a careful programming assistant. Read the code before answering.",
    "You help developers understand and fix Python code. Be concise.",
    "You are an autonomous software engineer. Prefer small, verified changes.",
    "",
]

_MUTATIONS = [
    (" + ", " - "),
    (" < ", " <= "),
    (" > ", " >= "),
    (" == ", " != "),
    (" and ", " or "),
    ("True", "False"),
    ("[0]", "[1]"),
    (" is None", " is not None"),
    ("+= 1", "+= 2"),
]


def _pick(rng: random.Random, *options: str) -> str:
    return rng.choice(options)


def _user(rng: random.Random, *options: str) -> Message:
    return {"role": "user", "content": rng.choice(options)}


def _call(rng: random.Random, name: str, **args: Any) -> Message:
    return {
        "id": f"call_{rng.getrandbits(48):012x}",
        "type": "function",
        "function": {"name": name, "arguments": args},
    }


def _assistant(content: str | None, *calls: Message) -> Message:
    m: Message = {"role": "assistant", "content": content}
    if calls:
        m["tool_calls"] = list(calls)
    return m


def _tool_msg(call: Message, content: str) -> Message:
    return {"role": "tool", "tool_call_id": call["id"], "content": content}


def _numbered(src: SourceFile, start: int, end: int) -> str:
    return "\n".join(f"{n:>5}\t{src.lines[n - 1]}" for n in range(start, min(end, len(src.lines)) + 1))


def _code_list(names: tuple[str, ...] | list[str]) -> str:
    quoted = [f"`{n}`" for n in names]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " and " + quoted[-1]


# ---------------------------------------------------------------- scenarios


@dataclass
class _Ctx:
    rng: random.Random
    src: SourceFile
    path: str  # the file's path as the repository shows it
    func: Func


def _explain(c: _Ctx) -> tuple[list[Message], set[str]] | None:
    rng, f = c.rng, c.func
    msgs: list[Message] = [
        _user(
            rng,
            f"What does `{f.name}` in {c.path} do?",
            f"Can you explain the function {f.name} from {c.path}?",
            f"Explain {f.name}() in {c.path}.",
            f"I'm reading {c.path}. How does `{f.name}` work?",
            f"what is {f.name} for? it's in {c.path}",
        )
    ]
    if rng.random() < 0.15:  # a wrong path first, to teach recovering from tool errors
        bad = _call(rng, "read_file", path=c.path.split("/")[-1])
        msgs += [_assistant(None, bad), _tool_msg(bad, f"Error: no such file: {c.path.split('/')[-1]}")]
    end = min(f.end, f.lineno + 39)
    call = (
        _call(rng, "read_file", path=c.path, start_line=f.lineno, end_line=end)
        if rng.random() < 0.7
        else _call(rng, "read_file", path=c.path)
    )
    shown = (
        (f.lineno, end) if "start_line" in call["function"]["arguments"] else (1, min(len(c.src.lines), 60))
    )
    msgs += [
        _assistant(
            rng.choice([None, f"Let me read {c.path} first.", f"I'll open the file and look at `{f.name}`."]),
            call,
        ),
        _tool_msg(call, _numbered(c.src, *shown)),
    ]
    args = "no arguments" if not f.args else f"the argument{'s' * (len(f.args) > 1)} {_code_list(f.args)}"
    doc = f" Its docstring says: {f.doc}" if f.doc else " It has no docstring."
    calls = f" Internally it calls {_code_list(f.calls)}." if f.calls else ""
    msgs.append(
        _assistant(
            _pick(
                rng,
                f"`{f.name}` is defined on line {f.lineno} of {c.path} and takes {args}.",
                f"In {c.path}, `{f.name}` (lines {f.lineno}-{f.end}) takes {args}.",
            )
            + doc
            + calls
        )
    )
    return msgs, {"read_file"}


def _grep(c: _Ctx) -> tuple[list[Message], set[str]] | None:
    rng, short = c.rng, c.func.name.split(".")[-1]
    directory = c.path.rsplit("/", 1)[0] if "/" in c.path else "."
    pattern = rng.choice([short, f"{short}\\(", f"def {short}\\b"])
    hits = [(i + 1, line) for i, line in enumerate(c.src.lines) if re.search(pattern, line)][:12]
    if not hits:
        return None
    call = _call(rng, "grep", pattern=pattern, path=directory)
    out = "\n".join(f"{c.path}:{n}:{line.strip()}" for n, line in hits)
    lines = [n for n, _ in hits]
    where = "the repository" if directory == "." else directory
    return [
        _user(rng, f"Where is `{short}` used in {where}?", f"Find the uses of {short} under {where}."),
        _assistant(rng.choice([None, f"I'll search for `{short}`."]), call),
        _tool_msg(call, out),
        _assistant(
            f"`{short}` appears on {len(lines)} line{'s' * (len(lines) > 1)} of {c.path}: "
            f"{', '.join(map(str, lines))}. It is defined on line {c.func.lineno}."
        ),
    ], {"grep"}


def _fix_test(c: _Ctx) -> tuple[list[Message], set[str]] | None:
    rng, f = c.rng, c.func
    body = [(n, c.src.lines[n - 1]) for n in range(f.body, f.end + 1)]  # code only, not the docstring
    options = [
        (n, line, a, b)
        for n, line in body
        for a, b in _MUTATIONS
        if a in line and not line.lstrip().startswith("#")
    ]
    if not options:
        return None
    n, good, a, b = rng.choice(options)
    bad = good.replace(a, b, 1)
    stem = c.path.rsplit("/", 1)[-1].removesuffix(".py").strip("_") or "module"
    test, test_name = f"tests/test_{stem}.py", f"test_{f.name.split('.')[-1].strip('_')}"
    total, verbose = rng.randint(3, 40), rng.random() < 0.3
    run = _call(rng, "run_tests", path=test, verbose=True) if verbose else _call(rng, "run_tests", path=test)
    fail = (
        f"collected {total} items\n\n{test} {'.' * (total - 1)}F\n\n=== FAILURES ===\n___ {test_name} ___\n"
        f"E   AssertionError: unexpected result from {f.name}\n{c.path}:{n}: in {f.name.split('.')[-1]}\n"
        f"    {bad.strip()}\n=== short test summary info ===\nFAILED {test}::{test_name}\n"
        f"=== 1 failed, {total - 1} passed in 0.{rng.randint(10, 99)}s ==="
    )
    lines = list(c.src.lines)
    lines[n - 1] = bad
    buggy = SourceFile(c.src.rel, tuple(lines), c.src.funcs, c.src.doc)
    read = _call(rng, "read_file", path=c.path, start_line=f.lineno, end_line=min(f.end, f.lineno + 39))
    edit = _call(rng, "edit_file", path=c.path, old=bad.strip(), new=good.strip())
    rerun = _call(rng, "run_tests", path=test)
    return [
        _user(
            rng,
            f"The tests in {test} fail. Can you fix it?",
            f"{test} is failing, please fix the bug.",
            f"fix the failing test in {test}",
        ),
        _assistant(rng.choice([None, "Let me run the tests first."]), run),
        _tool_msg(run, fail),
        _assistant(f"The failure points at `{f.name}` in {c.path}, line {n}. Let me read it.", read),
        _tool_msg(read, _numbered(buggy, f.lineno, min(f.end, f.lineno + 39))),
        _assistant(f"Line {n} uses `{b.strip()}` where `{a.strip()}` is meant.", edit),
        _tool_msg(edit, f"Edited {c.path}: 1 replacement."),
        _assistant(None, rerun),
        _tool_msg(rerun, f"collected {total} items\n\n=== {total} passed in 0.{rng.randint(10, 99)}s ==="),
        _assistant(
            f"Fixed. In `{f.name}` ({c.path}, line {n}) `{bad.strip()}` should be `{good.strip()}`. "
            f"All {total} tests in {test} pass now."
        ),
    ], {"run_tests", "read_file", "edit_file"}


def _list_dir(c: _Ctx) -> tuple[list[Message], set[str]] | None:
    rng, root = c.rng, stdlib_root()
    rel_dir = c.src.rel.rsplit("/", 1)[0] if "/" in c.src.rel else ""
    shown = c.path.rsplit("/", 1)[0] if "/" in c.path else "."
    all_entries = sorted(
        p.name + ("/" if p.is_dir() else "")
        for p in (root / rel_dir).iterdir()
        if p.name not in EXCLUDED_DIRS and (p.is_dir() or p.suffix == ".py")
    )
    entries = all_entries[:30]
    more = f"\n... and {len(all_entries) - 30} more entries" if len(all_entries) > 30 else ""
    call = _call(rng, "list_dir", path=shown)
    mods = [e.removesuffix(".py") for e in entries if e.endswith(".py")]
    dirs = [e for e in entries if e.endswith("/")]
    summary = f"{shown} has {len(mods)}{' listed' * bool(more)} Python modules" + (
        f", for example {_code_list(mods[:5])}" if mods else ""
    )
    summary += f", and {len(dirs)} subdirectories ({', '.join(dirs[:5])})." if dirs else "."
    return [
        _user(rng, f"What's in {shown}?", f"List the files in {shown}.", f"show me the contents of {shown}"),
        _assistant(None, call),
        _tool_msg(call, "\n".join(entries) + more),
        _assistant(summary),
    ], {"list_dir"}


def _parallel_read(c: _Ctx) -> tuple[list[Message], set[str]] | None:
    rng, funcs = c.rng, list(c.src.funcs)
    if len(funcs) < 2:
        return None
    f1, f2 = rng.sample(funcs, 2)
    calls = [
        _call(rng, "read_file", path=c.path, start_line=f.lineno, end_line=min(f.end, f.lineno + 19))
        for f in (f1, f2)
    ]
    return [
        {"role": "user", "content": f"Compare `{f1.name}` and `{f2.name}` in {c.path}."},
        _assistant("I'll read both functions.", *calls),
        *[
            _tool_msg(call, _numbered(c.src, f.lineno, min(f.end, f.lineno + 19)))
            for call, f in zip(calls, (f1, f2), strict=True)
        ],
        _assistant(
            f"`{f1.name}` (line {f1.lineno}, {f1.end - f1.lineno + 1} lines) takes "
            f"{_code_list(f1.args) if f1.args else 'no arguments'}; `{f2.name}` (line {f2.lineno}, "
            f"{f2.end - f2.lineno + 1} lines) takes {_code_list(f2.args) if f2.args else 'no arguments'}."
            + (f" {f1.name}: {f1.doc}" if f1.doc else "")
            + (f" {f2.name}: {f2.doc}" if f2.doc else "")
        ),
    ], {"read_file"}


def _no_tool(c: _Ctx) -> tuple[list[Message], set[str]] | None:
    rng, f = c.rng, c.func
    code = "\n".join(c.src.lines[f.lineno - 1 : min(f.end, f.lineno + 24)])
    answer = f"This is `{f.name}`. It takes {_code_list(f.args) if f.args else 'no arguments'}."
    answer += (f" Its docstring says: {f.doc}" if f.doc else "") + (
        f" It calls {_code_list(f.calls)}." if f.calls else ""
    )
    return [
        {"role": "user", "content": f"What does this code do?\n```python\n{code}\n```"},
        _assistant(answer),
        _user(rng, "Thanks!", "thanks, that helps", "Great."),
        _assistant(_pick(rng, "You're welcome.", "Glad it helped.", "Happy to help.")),
    ], set()


SCENARIOS: list[Callable[[_Ctx], tuple[list[Message], set[str]] | None]] = [
    _explain,
    _explain,
    _grep,
    _fix_test,
    _fix_test,
    _list_dir,
    _parallel_read,
    _no_tool,
]


class _SourcePool:
    """Lazily parsed train-split files; a subset sized to `n` keeps small corpora cheap to build."""

    def __init__(self, n: int, seed: int):
        files = stdlib_files("train")
        random.Random(seed).shuffle(files)
        self._files, self._root, self._cache = files[: min(len(files), 40 + n // 10)], stdlib_root(), {}

    def pick(self, rng: random.Random) -> SourceFile:
        while True:
            path = rng.choice(self._files)
            if path not in self._cache:
                self._cache[path] = parse_source(self._root, path)
            if self._cache[path] is not None:
                return self._cache[path]


def _transcript(pool: _SourcePool, rng: random.Random) -> tuple[list[Message], list[Message]]:
    prefix = rng.choice(["", "", "src/", "lib/", "app/"])
    messages: list[Message] = []
    needed: set[str] = set()
    for _ in range(1 if rng.random() < 0.75 else 2):  # sometimes a follow-up task in the same chat
        while True:
            src = pool.pick(rng)
            turn = rng.choice(SCENARIOS)(_Ctx(rng, src, prefix + src.rel, rng.choice(src.funcs)))
            if turn is not None:
                break
        messages += turn[0]
        needed |= turn[1]
    extra = [t for t in TOOLS if t not in needed and rng.random() < 0.5]
    names = sorted(needed | set(extra))
    rng.shuffle(names)
    system = rng.choice(SYSTEM_PROMPTS)
    return ([{"role": "system", "content": system}] if system else []) + messages, [TOOLS[n] for n in names]


def chat_transcripts(n: int, seed: int = 0) -> list[str]:
    """`n` rendered transcripts, each ending in `<|endoftext|>` (the end-of-document stop token)."""
    return [text for text, _ in chat_examples(n, seed)]


def assistant_spans(text: str) -> list[tuple[int, int]]:
    """Char spans [start, end) of what the model generates: after `<|assistant|>\\n`, up to and
    including the token that ends the turn (next role token or `<|endoftext|>`)."""
    spans, pos, head = [], 0, ASSISTANT + "\n"
    while (i := text.find(head, pos)) >= 0:
        start = i + len(head)
        ends = [
            (j, t)
            for t in (USER, OBSERVATION, SYSTEM, ENDOFTEXT, ASSISTANT)
            if (j := text.find(t, start)) >= 0
        ]
        j, tok = min(ends) if ends else (len(text), "")
        spans.append((start, j + len(tok)))
        pos = j
    return spans


def chat_examples(n: int, seed: int = 0) -> list[tuple[str, list[tuple[int, int]]]]:
    """Transcripts with the char spans of the assistant's output, for a loss mask (see
    `tools.tiny_tokenizer.loss_mask`)."""
    pool, out = _SourcePool(n, seed), []
    for i in range(n):
        messages, tools = _transcript(pool, random.Random(f"{seed}:{i}"))
        text = render_chat(messages, tools, add_generation_prompt=False) + ENDOFTEXT
        out.append((text, assistant_spans(text)))
    return out


def main() -> None:
    for split in ("train", "heldout"):
        texts = stdlib_texts(split)  # type: ignore[arg-type]
        print(f"stdlib {split}: {len(texts)} files, {sum(map(len, texts)):,} chars")
    examples = chat_examples(1000, 0)
    chars = sum(len(t) for t, _ in examples)
    out_chars = sum(e - s for t, spans in examples for s, e in spans)
    print(f"1000 transcripts: {chars:,} chars, {out_chars:,} of them assistant output")
    print("--- sample ---\n" + examples[0][0])


if __name__ == "__main__":
    main()
