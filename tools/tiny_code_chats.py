"""Agent chats about real standard-library code: explain, search, fix a failing test, list, compare,
and code questions answered without tools (explain a snippet, write or name a function).

Scenarios write calls under the canonical tool names and keys (tools/tiny_tools.py); the chat
assembler maps them to the spellings its rendered tools show.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tools.tiny_phrasing import either, pick
from tools.tiny_stdlib import EXCLUDED_DIRS, Func, SourceFile, stdlib_root

Message = dict[str, Any]
Turn = tuple[list[Message], set[str]]  # messages, canonical names of the tools they call

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


def _explain(c: _Ctx) -> Turn | None:
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
            pick(
                rng,
                f"`{f.name}` is defined on line {f.lineno} of {c.path} and takes {args}.",
                f"In {c.path}, `{f.name}` (lines {f.lineno}-{f.end}) takes {args}.",
            )
            + doc
            + calls
        )
    )
    return msgs, {"read_file"}


def _grep(c: _Ctx) -> Turn | None:
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


def _fix_test(c: _Ctx) -> Turn | None:
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


def _list_dir(c: _Ctx) -> Turn | None:
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


def _parallel_read(c: _Ctx) -> Turn | None:
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


def _no_tool(c: _Ctx) -> Turn | None:
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
        _assistant(pick(rng, "You're welcome.", "Glad it helped.", "Happy to help.")),
    ], set()


def _write_function(c: _Ctx) -> Turn | None:
    f = c.func
    if not f.doc or "." in f.name or f.end - f.lineno > 25:
        return None
    doc = f.doc.rstrip(".")
    args = ", ".join(f.args)
    text = either(c.rng, ("Write a Python function `{n}({a})` that does this: {d}",
                          "Implement {n}({a}). {d}", "Write {n}({a}): {d}"),
                  ("How would you write a function {n}({a})? It should do this: {d}",), n=f.name, a=args, d=doc)
    code = "\n".join(c.src.lines[f.lineno - 1 : f.end])
    return [{"role": "user", "content": text}, _assistant(f"Here is one way:\n```python\n{code}\n```")], set()


def _name_function(c: _Ctx) -> Turn | None:
    f = c.func
    if not f.doc or f.name.startswith("_"):
        return None
    text = either(c.rng, ("Suggest a name for a function that does this: {d}",),
                  ("What would you call a function that does this: {d}?",), d=f.doc.rstrip(".").lower())
    return [{"role": "user", "content": text}, _assistant(f"`{f.name.split('.')[-1]}` would be a good name.")], set()


TOOL_SCENARIOS: tuple[Callable[[_Ctx], Turn | None], ...] = (_explain, _explain, _grep, _fix_test, _list_dir,
                                                               _parallel_read)
PLAIN_SCENARIOS: tuple[Callable[[_Ctx], Turn | None], ...] = (_no_tool, _write_function, _name_function)


def code_turn(rng: random.Random, src: SourceFile, scenarios: tuple[Callable[[_Ctx], Turn | None], ...],
              prefix: str) -> Turn | None:
    """One scenario on `src` (None when its functions do not fit the scenario)."""
    return rng.choice(scenarios)(_Ctx(rng, src, prefix + src.rel, rng.choice(src.funcs)))
