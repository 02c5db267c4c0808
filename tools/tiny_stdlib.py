"""The CPython standard library as glm52-tiny's code corpus, and facts about its files for the chats.

The train/held-out split is a stable hash of each file's relative path (the same on every machine).
"""

from __future__ import annotations

import ast
import hashlib
import os
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Split = Literal["train", "heldout"]
EXCLUDED_DIRS = frozenset({"site-packages", "test", "tests", "idlelib", "lib2to3", "tkinter", "__pycache__"})
MAX_FILE_BYTES = 200_000
HELDOUT_PERCENT = 2


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


class SourcePool:
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
