"""Tool use of a model on the fixed, hand-written asks of tools/tool_use_asks.json (none is used in
training): how often it calls a tool when one is needed, how often when none is, and whether its
free (`auto`, unconstrained) calls are valid for the offered schema.

    python -m tools.tool_use_eval --model models/glm52-tiny

Every ask runs twice, without a system prompt and with one of the set's system prompts, greedy,
up to `max_new_tokens`. A call is valid when it parses, names an offered tool and its arguments
validate against that tool's parameters with no keys beyond the schema's.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import torch

from glmserve.model.forward_batch import ForwardBatch
from glmserve.model.glm_model import GlmForCausalLM
from glmserve.model.kv_layout import KVLayout
from glmserve.model.paged_cache import PagedKVCache
from glmserve.text.special_tokens import TOOL_CALL_START
from glmserve.text.tokenizer import Tokenizer
from glmserve.text.tool_calls import parse_tool_calls

ASKS = Path(__file__).resolve().parent / "tool_use_asks.json"


@dataclass(frozen=True)
class Run:
    case: dict[str, Any]
    system: str  # "" for none
    tools: list[dict[str, Any]]
    text: str = ""


@dataclass(frozen=True)
class ToolUseReport:
    runs: tuple[Run, ...]

    def _count(self, needs_tool: bool, system: bool | None = None) -> tuple[int, int]:
        runs = [r for r in self.runs if r.case["needs_tool"] == needs_tool and system in (None, bool(r.system))]
        return sum(bool(_calls(r)) for r in runs), len(runs)

    def rates(self) -> dict[str, float]:
        """tool_asks_called, plain_asks_called, valid_free_calls, plus the right tool and the expected
        arguments among tool asks, and the first two split by system prompt."""
        attempts = sum(r.text.count(TOOL_CALL_START) for r in self.runs)
        valid = sum(_valid(r, c) for r in self.runs for c in _calls(r))
        tool_runs = [r for r in self.runs if r.case["needs_tool"]]
        out = {
            "tool_asks_called": _ratio(*self._count(True)),
            "plain_asks_called": _ratio(*self._count(False)),
            "valid_free_calls": _ratio(valid, attempts),
            "right_tool": _ratio(sum(any(c[0] == r.case["expect"]["name"] for c in _calls(r)) for r in tool_runs),
                                 len(tool_runs)),
            "expected_arguments": _ratio(sum(_matches(r) for r in tool_runs), len(tool_runs)),
            "free_calls": float(attempts),
        }
        for label, system in (("with_system", True), ("without_system", False)):
            out[f"tool_asks_called_{label}"] = _ratio(*self._count(True, system))
            out[f"plain_asks_called_{label}"] = _ratio(*self._count(False, system))
        return out


def _ratio(a: int, b: int) -> float:
    return a / b if b else 0.0


def _calls(run: Run) -> list[tuple[str, Any]]:
    parsed = parse_tool_calls(run.text, tools=run.tools).tool_calls
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed]


def _valid(run: Run, call: tuple[str, Any]) -> bool:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in run.tools}
    if call[0] not in schemas:
        return False
    strict = {**schemas[call[0]], "additionalProperties": False}
    return not any(jsonschema.Draft202012Validator(strict).iter_errors(call[1]))


def _matches(run: Run) -> bool:
    expect = run.case["expect"]
    return any(name == expect["name"] and all(args.get(k) == v for k, v in expect["args"].items())
               for name, args in _calls(run) if isinstance(args, dict))


def load_runs(path: Path = ASKS) -> list[Run]:
    """Every case without a system prompt, then every case with one (the set's prompts in turn)."""
    data = json.loads(path.read_text())
    prompts = data["system_prompts"]
    runs = []
    for with_system in (False, True):
        for i, case in enumerate(data["cases"]):
            tools = [data["tools"][name] for name in case["tools"]]
            runs.append(Run(case, prompts[i % len(prompts)] if with_system else "", tools))
    return runs


def prompt_ids(run: Run, tokenizer: Tokenizer) -> list[int]:
    messages = ([{"role": "system", "content": run.system}] if run.system else []) + [
        {"role": "user", "content": run.case["ask"]}
    ]
    return tokenizer.apply_chat_template(messages, run.tools, add_generation_prompt=True)


@torch.inference_mode()
def batched_greedy(
    model: GlmForCausalLM, prompts: Sequence[Sequence[int]], max_new_tokens: int, stop_ids: Sequence[int],
    block_size: int = 64,
) -> list[list[int]]:
    """Plain greedy decoding of several prompts at once (each sequence in its own blocks); the stop
    token, when one ends a sequence, is included."""
    layout = KVLayout.for_config(model.config, block_size, dtype=model.dtype, with_mtp=False)
    tables, used = [], 0
    for p in prompts:
        n = math.ceil((len(p) + max_new_tokens) / block_size)
        tables.append(list(range(used, used + n)))
        used += n
    cache = PagedKVCache(layout, used)
    batch = ForwardBatch.build([list(p) for p in prompts], [0] * len(prompts), tables, block_size)
    logits = model.forward_logits(batch, cache)[[s.end - 1 for s in batch.seqs]]
    outs: list[list[int]] = [[] for _ in prompts]
    active = list(range(len(prompts)))
    while True:
        for row, i in enumerate(active):
            outs[i].append(int(logits[row].argmax()))
        active = [i for i in active if outs[i][-1] not in stop_ids and len(outs[i]) < max_new_tokens]
        if not active:
            return outs
        step = ForwardBatch.build(
            [[outs[i][-1]] for i in active], [len(prompts[i]) + len(outs[i]) - 1 for i in active],
            [tables[i] for i in active], block_size,
        )
        logits = model.forward_logits(step, cache)


def evaluate_tool_use(
    model: GlmForCausalLM, tokenizer: Tokenizer, path: Path = ASKS, max_new_tokens: int = 64, group: int = 16
) -> ToolUseReport:
    runs = load_runs(path)
    stops = list(tokenizer.eos_token_ids)
    done = []
    for start in range(0, len(runs), group):
        chunk = runs[start : start + group]
        outs = batched_greedy(model, [prompt_ids(r, tokenizer) for r in chunk], max_new_tokens, stops)
        done += [Run(r.case, r.system, r.tools, tokenizer.decode([t for t in o if t not in stops]))
                 for r, o in zip(chunk, outs, strict=True)]
    return ToolUseReport(tuple(done))


def main(argv: Sequence[str] | None = None) -> None:
    from glmserve.model.loader import load_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=Path("models/glm52-tiny"))
    ap.add_argument("--show", action="store_true", help="print every answer")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    report = evaluate_tool_use(load_model(args.model), Tokenizer.from_dir(args.model))
    if args.show:
        for r in report.runs:
            print(f"[{'sys' if r.system else '---'}] {r.case['ask']!r} -> {r.text!r}")
    print(json.dumps({k: round(v, 3) for k, v in report.rates().items()}, indent=1))


if __name__ == "__main__":
    main()
