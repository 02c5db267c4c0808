"""Cost of grammar-constrained decoding per generated token, with and without MTP drafts.

The bundled model, greedy, a batch of ``--batch`` chat asks per call. Variants: free output, a
``json_schema`` grammar (response_format) and forced tool calls (``tool_choice`` required), each on
an engine with MTP off and with ``--drafts`` fixed drafts. The compiled grammars are cached (the
warm-up call compiles them; compile times are reported apart). Calls alternate within each round
(`time_interleaved`), so a slow spell of the machine hits every variant alike; the ratio is against
free output on the same engine in the same run. Output lengths differ per variant (and with them
how long a batch stays full), so wall time per token compares only roughly; ``processing`` is the
time spent in the engine's logits processing (grammar masks, matcher advance, draft masks: every
`LogitsProcessor` call, timed around each call) per generated token, the direct cost.

    python bench/bench_constrained.py [--batch 4 --max-tokens 48 --rounds 3 --drafts 2]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from statistics import median

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.common import RunMonitor, markdown_table, print_header, setup, time_interleaved  # noqa: E402
from glmserve.core.generation import SamplingParams  # noqa: E402
from glmserve.core.grammar_spec import GrammarSpec  # noqa: E402
from glmserve.engine.engine import Engine, EngineConfig  # noqa: E402
from glmserve.engine.grammar_cache import GrammarCache  # noqa: E402
from glmserve.model.loader import load_model  # noqa: E402
from glmserve.text.tokenizer import Tokenizer  # noqa: E402
from tools import tiny_corpus  # noqa: E402

ASKS = ["What is the weather in Oslo?", "Read the file setup.py", "List the files in src", "Hello there!",
        "Search for TODO in the code", "Run the tests in tests/unit", "What is 7 times 8?", "Show me config.yaml"]
TOOLS = [tiny_corpus.TOOLS[name] for name in ("read_file", "list_dir", "grep", "run_command")]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]},
                                           "rain": {"type": "boolean"}},
          "required": ["city", "unit", "rain"], "additionalProperties": False}
GRAMMARS = {
    "free": None,
    "json_schema": GrammarSpec.from_response_format(
        {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}),
    "tool_calls": GrammarSpec.from_tool_choice(TOOLS, "required", parallel_tool_calls=False),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/glm52-tiny")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--drafts", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup(args.threads, seed=0)
    monitor = RunMonitor()
    model, tok = load_model(args.model), Tokenizer.from_dir(args.model)
    cache = GrammarCache(tok, model.config.vocab_size)
    compile_s = {}
    for name, spec in GRAMMARS.items():
        if spec is not None:
            start = time.perf_counter()
            cache.get(spec)
            compile_s[name] = time.perf_counter() - start
    engines = {str(mtp): Engine(model, EngineConfig(mtp=mtp, prefix_caching=False), tokenizer=tok, grammars=cache)
               for mtp in ("off", args.drafts)}
    prompts = [tok.apply_chat_template([{"role": "user", "content": a}], TOOLS) for a in ASKS[: args.batch]]
    tokens: dict[str, int] = {}
    accepted: dict[str, float] = {}
    spent = {str(mtp): _time_processing(engine) for mtp, engine in engines.items()}
    processing: dict[str, list[float]] = {}

    def call(label: str, engine: Engine, spec: GrammarSpec | None, clock: list[float]):
        def run() -> None:
            before = (engine.stats.draft_tokens, engine.stats.accepted_tokens, clock[0])
            params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, grammar=spec)
            reqs = engine.generate(prompts, params)
            tokens[label] = sum(len(r.output_ids) for r in reqs)
            processing.setdefault(label, []).append((clock[0] - before[2]) / tokens[label])
            drafted = engine.stats.draft_tokens - before[0]
            accepted[label] = (engine.stats.accepted_tokens - before[1]) / drafted if drafted else float("nan")
        return run

    fns = {f"{name}|{mtp}": call(f"{name}|{mtp}", engine, spec, spent[mtp])
           for mtp, engine in engines.items() for name, spec in GRAMMARS.items()}
    timings = time_interleaved(fns, warmup=1, repeats=args.rounds)
    print_header("Constrained decoding cost per token", "python bench/bench_constrained.py " + " ".join(argv or sys.argv[1:]))
    rows = []
    for label, timing in timings.items():
        name, mtp = label.split("|")
        per_token = timing.median / tokens[label]
        free = timings[f"free|{mtp}"].median / tokens[f"free|{mtp}"]
        timed = processing[label][1:]  # the warm-up call compiled nothing but is left out anyway
        rows.append([name, mtp, tokens[label], f"{per_token * 1e3:.1f}", f"{per_token / free:.2f}",
                     f"{median(timed) * 1e3:.2f}", f"{accepted[label]:.2f}"])
    print(markdown_table(["output", "mtp drafts", "tokens per call", "ms / token", "vs free, same engine",
                          "processing ms / token", "draft acceptance"], rows))
    print("\n- grammar compile (once per schema, cached after): "
          + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in compile_s.items()))
    print(f"- run: {monitor.summary()}")


def _time_processing(engine: Engine) -> list[float]:
    """Wrap the engine's logits-processing calls with a clock; returns its one-item total."""
    clock, processor = [0.0], engine.logits_processor  # the drafter calls the same object
    for name in ("adjust", "kept", "draft_logits", "drafted"):
        inner = getattr(processor, name)

        def timed(*a, _inner=inner, **k):
            start = time.perf_counter()
            try:
                return _inner(*a, **k)
            finally:
                clock[0] += time.perf_counter() - start
        setattr(processor, name, timed)
    return clock


if __name__ == "__main__":
    main()
