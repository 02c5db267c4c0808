"""Deterministic filler text: prose-like word runs and code-like lines drawn from a fixed word list
by a seeded generator (same seed, same text, on every machine and Python version).

Sizes are asked in approximate tokens: about one token per word for common English-like words on
large vocabularies. The server's ``usage`` gives the real counts; a tokenizer, when given, the exact
ones.
"""

from __future__ import annotations

import random

WORDS = tuple("""
the of and to in is for on with as by at from that this be are or an it not we can will
value result request response client server token block cache prefix session model buffer config
error state queue worker router stream update read write open close start stop check parse build
index count batch limit offset length size name path file line data item list map key entry node
tree graph edge event handler task job schedule retry timeout deadline budget metric report trace
test case assert expect mock fixture setup teardown module package import export class method
function return yield await async loop thread lock signal channel socket address port host route
table column row query filter sort merge split join group order select insert delete create drop
load save store fetch push pull commit branch patch diff review release version tag label status
""".split())


def seeded(*parts: object) -> random.Random:
    """A generator seeded by the string of ``parts`` (string seeds hash with SHA-512: stable)."""
    return random.Random(":".join(str(p) for p in parts))


def words(rng: random.Random, n: int) -> str:
    """``n`` words separated by single spaces, no leading or trailing space."""
    return " ".join(rng.choice(WORDS) for _ in range(n))


def identifier(rng: random.Random) -> str:
    return f"{rng.choice(WORDS)}_{rng.choice(WORDS)}"


def code_lines(rng: random.Random, approx_tokens: int) -> str:
    """Python-looking lines (a function per few lines) totalling about ``approx_tokens`` tokens."""
    lines: list[str] = []
    budget = approx_tokens
    while budget > 0:
        fn, arg = identifier(rng), rng.choice(WORDS)
        lines.append(f"def {fn}({arg}):")
        lines.append(f"    {identifier(rng)} = {arg}.{rng.choice(WORDS)}({rng.choice(WORDS)})")
        lines.append(f"    return {identifier(rng)}({arg}, {rng.randrange(1000)})")
        budget -= 24
    return "\n".join(lines) + "\n"
