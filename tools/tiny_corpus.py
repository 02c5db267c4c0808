"""Training corpus of the toy model glm52-tiny: CPython stdlib source plus rendered agent chats.

A chat has one or two tasks, a tool set (what the tasks need plus distractors, each tool rendered with
varied names, keys and optional parameters; or no tools at all) and a system prompt or none. Tasks:
stdlib scenarios (explain, search, fix a test, list, compare), asks that need a coding or an everyday
tool, asks that need none (concepts, facts, arithmetic, greetings, code to write or explain), and asks
for a tool the chat does not offer (answered in text). `Mix` sets their shares.

Deterministic: transcript `i` of seed `s` comes from its own `random.Random(f"{s}:{i}")`, so
`chat_transcripts(n)` is a prefix of `chat_transcripts(n + k)`. Transcripts only quote train-split
files. `python -m tools.tiny_corpus` prints statistics and a sample.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from glmserve.text.chat import render_chat
from glmserve.text.special_tokens import ASSISTANT, ENDOFTEXT, OBSERVATION, SYSTEM, USER
from tools import tiny_code_asks, tiny_code_chats, tiny_plain_asks, tiny_tools, tiny_world_asks
from tools.tiny_phrasing import Ask
from tools.tiny_stdlib import SourcePool, stdlib_files, stdlib_root, stdlib_texts  # noqa: F401 (re-exported)

Message = dict[str, Any]
PlainGenerator = Callable[[random.Random, Sequence[str]], Ask]
TOOLS: dict[str, Message] = {
    n: tiny_tools.canonical_schema(n) for n in ("read_file", "list_dir", "grep", "run_tests", "edit_file", "run_command")
}
SYSTEM_PROMPTS = [
    "You are a coding agent working in a Python repository. Use the tools to inspect and change code.",
    "You are a helpful assistant for software engineering tasks.",
    "You are GLM, a careful programming assistant. Read the code before answering.",
    "You help developers understand and fix Python code. Be concise.",
    "You are an autonomous software engineer. Prefer small, verified changes.",
    "You are a helpful assistant.",
    "You are a friendly assistant. Use a tool only when the request needs one.",
    "You are GLM, created to help people. Answer directly when you can.",
    "Answer briefly.",
    "You are a personal assistant with access to the user's tools.",
    "You are a travel and productivity assistant.",
    "Be precise. Call functions when you need real data.",
    "You are a senior developer pairing with the user on their project.",
    "You are a terse assistant. No small talk.",
    "Act as a DevOps helper for a small team.",
    "You answer questions about code and run tools in the user's workspace.",
]
_PREAMBLES = ("Let me check.", "I'll look that up.", "Let me do that.", "One moment.", "Sure.")


@dataclass(frozen=True)
class Mix:
    """Shares of task kinds (normalized), and the chat shapes around them."""

    stdlib_scenario: float = 0.2
    code_ask: float = 0.18
    world_ask: float = 0.18
    plain: float = 0.25
    code_plain: float = 0.15
    missing_tool: float = 0.04
    no_tools_chat: float = 0.08  # chats offered no tools (only asks that need none)
    follow_up: float = 0.3  # chance of a second task in the chat
    no_system: float = 0.4
    preamble: float = 0.15  # calls that say a few words first
    max_tools: int = 4

    def pick_kind(self, rng: random.Random, plain_only: bool) -> str:
        shares = {"stdlib_scenario": self.stdlib_scenario, "code_ask": self.code_ask, "world_ask": self.world_ask,
                  "plain": self.plain, "code_plain": self.code_plain, "missing_tool": self.missing_tool}
        if plain_only:
            shares = {k: shares[k] for k in ("plain", "code_plain")}
        return rng.choices(list(shares), list(shares.values()))[0]


@dataclass
class _Task:
    kind: str
    ask: Ask | None = None  # asks
    messages: list[Message] = field(default_factory=list)  # stdlib scenarios, canonical calls
    needs: set[str] = field(default_factory=set)
    plain: PlainGenerator | None = None  # asks that need no tool: generated once the tools are known


def _task(kind: str, rng: random.Random, pool: SourcePool, prefix: str) -> _Task | None:
    if kind in ("stdlib_scenario", "code_plain"):
        scenarios = tiny_code_chats.TOOL_SCENARIOS if kind == "stdlib_scenario" else tiny_code_chats.PLAIN_SCENARIOS
        turn = tiny_code_chats.code_turn(rng, pool.pick(rng), scenarios, prefix)
        return None if turn is None else _Task(kind, messages=turn[0], needs=turn[1])
    if kind == "plain":
        return _Task(kind, plain=rng.choice(tiny_plain_asks.GENERATORS))
    generators = tiny_code_asks.GENERATORS if kind == "code_ask" else tiny_world_asks.GENERATORS
    if kind == "missing_tool":
        generators = rng.choice((tiny_code_asks.GENERATORS, tiny_world_asks.GENERATORS))
    name = rng.choice(list(generators))
    ask = generators[name](rng)
    return _Task(kind, ask=ask, needs=set() if kind == "missing_tool" else {name})


def _call(rng: random.Random, tool: tiny_tools.RenderedTool, args: dict[str, Any]) -> Message:
    return {"id": f"call_{rng.getrandbits(48):012x}", "type": "function",
            "function": {"name": tool.name, "arguments": tool.args(args)}}


def _materialize(task: _Task, tools: dict[str, tiny_tools.RenderedTool], rng: random.Random, mix: Mix) -> list[Message]:
    ask = task.ask
    if task.plain is not None:
        ask = task.plain(rng, [t.name for t in tools.values()])
    if ask is None:  # a stdlib scenario: map its canonical calls onto the rendered tools
        return [{**m, "tool_calls": [_renamed(c, tools) for c in m["tool_calls"]]} if m.get("tool_calls") else m
                for m in task.messages]
    user = {"role": "user", "content": ask.text}
    if task.kind == "missing_tool":
        return [user, {"role": "assistant", "content": tiny_plain_asks.missing_tool(ask).answer}]
    if ask.tool is None:
        return [user, {"role": "assistant", "content": ask.answer}]
    call = _call(rng, tools[ask.tool], ask.args or {})
    preamble = rng.choice(_PREAMBLES) if rng.random() < mix.preamble else None
    return [user, {"role": "assistant", "content": preamble, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": ask.result},
            {"role": "assistant", "content": ask.answer}]


def _renamed(call: Message, tools: dict[str, tiny_tools.RenderedTool]) -> Message:
    tool = tools[call["function"]["name"]]
    return {**call, "function": {"name": tool.name, "arguments": tool.args(call["function"]["arguments"])}}


def _transcript(pool: SourcePool, rng: random.Random, mix: Mix) -> tuple[list[Message], list[Message]]:
    prefix = rng.choice(["", "", "src/", "lib/", "app/"])
    plain_only = rng.random() < mix.no_tools_chat
    tasks: list[_Task] = []
    for _ in range(1 if rng.random() >= mix.follow_up else 2):
        while (task := _task(mix.pick_kind(rng, plain_only), rng, pool, prefix)) is None:
            pass
        tasks.append(task)
    needed = set().union(*(t.needs for t in tasks))
    missing = {t.ask.tool for t in tasks if t.kind == "missing_tool" and t.ask and t.ask.tool}
    tools: dict[str, tiny_tools.RenderedTool] = {}
    if not plain_only:
        others = [s.canonical for s in tiny_tools.SPECS if s.canonical not in needed | missing]
        extra = rng.sample(others, max(0, min(rng.randint(0, mix.max_tools - 1), mix.max_tools - len(needed))))
        if not needed and not extra:
            extra = rng.sample(others, 1)
        names = sorted(needed | set(extra))
        rng.shuffle(names)
        tools = {n: tiny_tools.render(tiny_tools.SPECS_BY_NAME[n], rng) for n in names}
    messages: list[Message] = []
    for task in tasks:
        messages += _materialize(task, tools, rng, mix)
    system = rng.choice(SYSTEM_PROMPTS) if rng.random() >= mix.no_system else ""
    head = [{"role": "system", "content": system}] if system else []
    return head + messages, [t.schema for t in tools.values()]


def assistant_spans(text: str) -> list[tuple[int, int]]:
    """Char spans [start, end) of what the model generates: after `<|assistant|>\\n`, up to and
    including the token that ends the turn (next role token or `<|endoftext|>`)."""
    spans, pos, head = [], 0, ASSISTANT + "\n"
    while (i := text.find(head, pos)) >= 0:
        start = i + len(head)
        ends = [(j, t) for t in (USER, OBSERVATION, SYSTEM, ENDOFTEXT, ASSISTANT) if (j := text.find(t, start)) >= 0]
        j, tok = min(ends) if ends else (len(text), "")
        spans.append((start, j + len(tok)))
        pos = j
    return spans


def chat_examples(n: int, seed: int = 0, mix: Mix = Mix()) -> list[tuple[str, list[tuple[int, int]]]]:
    """Transcripts with the char spans of the assistant's output, for a loss mask (see
    `tools.tiny_tokenizer.loss_mask`)."""
    pool, out = SourcePool(n, seed), []
    for i in range(n):
        messages, tools = _transcript(pool, random.Random(f"{seed}:{i}"), mix)
        text = render_chat(messages, tools or None, add_generation_prompt=False) + ENDOFTEXT
        out.append((text, assistant_spans(text)))
    return out


def chat_transcripts(n: int, seed: int = 0, mix: Mix = Mix()) -> list[str]:
    """`n` rendered transcripts, each ending in `<|endoftext|>` (the end-of-document stop token)."""
    return [text for text, _ in chat_examples(n, seed, mix)]


def main() -> None:
    for split in ("train", "heldout"):
        texts = stdlib_texts(split)  # type: ignore[arg-type]
        print(f"stdlib {split}: {len(texts)} files, {sum(map(len, texts)):,} chars")
    examples = chat_examples(1000, 0)
    chars = sum(len(t) for t, _ in examples)
    out_chars = sum(e - s for t, spans in examples for s, e in spans)
    print(f"1000 transcripts: {chars:,} chars, {out_chars:,} of them assistant output")
    for text, _ in examples[:6]:
        print("--- sample ---\n" + text)


if __name__ == "__main__":
    main()
