"""The content of synthetic coding-agent sessions, all deterministic from a seed:

- one system prompt and one set of tool schemas shared by every session (the prefix a platform
  should cache once and not herd on);
- ``repos`` repositories whose context (files) opens a session's first user message, so sessions
  on the same repository share that prefix too;
- per turn: scripted tool calls (when the model made none; a toy model rarely does) and their
  results, code that the session appends, so its context grows turn by turn.
"""

from __future__ import annotations

import json
import random
from typing import Any

from glmserve.loadgen.synthetic_text import code_lines, identifier, seeded, words

TOOL_NAMES = ("read_file", "search_code", "list_dir", "run_tests", "edit_file", "git_diff", "run_shell",
              "find_symbol")


def tool_schemas(count: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = seeded("tools", seed)
    tools = []
    for i in range(count):
        name = TOOL_NAMES[i % len(TOOL_NAMES)] + ("" if i < len(TOOL_NAMES) else f"_{i // len(TOOL_NAMES)}")
        params = {p: {"type": "string", "description": words(rng, 12)} for p in ("path", "query", "pattern")[: 1 + i % 3]}
        tools.append({"type": "function", "function": {
            "name": name, "description": words(rng, 40),
            "parameters": {"type": "object", "properties": params, "required": list(params)[:1]}}})
    return tools


def system_prompt(approx_tokens: int, seed: int = 0) -> str:
    rng = seeded("system", seed)
    return "You are a coding agent working in a repository. " + words(rng, max(1, approx_tokens - 10))


def repo_context(repo: int, approx_tokens: int, seed: int = 0) -> str:
    rng = seeded("repo", seed, repo)
    files, budget, out = max(1, approx_tokens // 400), approx_tokens, []
    for _ in range(files):
        out.append(f"# file: src/{identifier(rng)}.py\n{code_lines(rng, min(400, budget))}")
        budget -= 400
    return "".join(out)


def task_message(session: int, approx_tokens: int, seed: int = 0) -> str:
    return "Task: " + words(seeded("task", seed, session), max(1, approx_tokens))


def follow_up(session: int, turn: int, approx_tokens: int, seed: int = 0) -> str:
    return "Next: " + words(seeded("follow-up", seed, session, turn), max(1, approx_tokens))


def scripted_calls(rng: random.Random, tools: list[dict[str, Any]], count: int, tag: str) -> list[dict[str, Any]]:
    calls = []
    for i in range(count):
        fn = rng.choice(tools)["function"]
        args = {p: f"src/{identifier(rng)}.py" for p in fn["parameters"]["properties"]}
        calls.append({"id": f"call_{tag}_{i}", "type": "function",
                      "function": {"name": fn["name"], "arguments": json.dumps(args)}})
    return calls


def tool_result(call: dict[str, Any], approx_tokens: int, seed: int = 0) -> str:
    return code_lines(seeded("tool-result", seed, call["id"], call["function"]["arguments"]), approx_tokens)
