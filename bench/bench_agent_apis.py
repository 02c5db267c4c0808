"""What the agent API adapters cost the router: one conversation (a system prompt, tools, an ask)
sent as chat completions, as ``/v1/responses`` and as ``/v1/messages``, whole and streamed, over
real HTTP to a router on 127.0.0.1 whose backend replays ``--tokens`` fixed tokens without delay (no
model: only the router's work is timed: parsing, the chat template, tokenizing, the run, the
answer's reshaping and its JSON or SSE). Calls alternate within each round (`time_interleaved`),
so a slow spell of the machine hits every variant alike; the ratio is against chat in the same run.

    python bench/bench_agent_apis.py [--tokens 64 --rounds 7]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.common import RunMonitor, markdown_table, print_header, time_interleaved  # noqa: E402
from glmserve.services.router.app import create_app  # noqa: E402
from glmserve.text.tokenizer import Tokenizer  # noqa: E402
from tests.services.router_fixtures import ScriptedBackend, serve  # noqa: E402
from tests.shared import MODEL_DIR  # noqa: E402
from tools import tiny_corpus  # noqa: E402

MODEL = "glm52-tiny"
TOOLS = [tiny_corpus.TOOLS[name] for name in ("read_file", "list_dir", "grep", "run_command")]
SYSTEM, ASK = tiny_corpus.SYSTEM_PROMPTS[0], "What is a linked list?"


def bodies(max_tokens: int) -> dict[str, tuple[str, dict]]:
    """Per API, its path and the same conversation in its own shape."""
    return {
        "chat": ("/v1/chat/completions", {"model": MODEL, "max_tokens": max_tokens, "tools": TOOLS, "messages": [
            {"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}]}),
        "responses": ("/v1/responses", {"model": MODEL, "max_output_tokens": max_tokens, "instructions": SYSTEM,
                                        "input": ASK, "tools": [{"type": "function", **t["function"]} for t in TOOLS]}),
        "messages": ("/v1/messages", {"model": MODEL, "max_tokens": max_tokens, "system": SYSTEM,
                                      "messages": [{"role": "user", "content": ASK}],
                                      "tools": [{"name": t["function"]["name"],
                                                 "description": t["function"].get("description", ""),
                                                 "input_schema": t["function"]["parameters"]} for t in TOOLS]}),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=64, help="tokens each answer has")
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args(argv)
    monitor = RunMonitor()
    tokenizer = Tokenizer.from_dir(MODEL_DIR)
    answer = (tokenizer.encode(" a linked list holds its items in nodes") * args.tokens)[: args.tokens]
    backend = ScriptedBackend(lambda _: answer, tokenizer)
    with serve(create_app(backend, tokenizer, MODEL, max_context=4096)) as url, httpx.Client(base_url=url) as http:
        def call(path: str, body: dict, stream: bool):
            def run() -> None:
                if stream:
                    with http.stream("POST", path, json={**body, "stream": True}) as reply:
                        assert reply.status_code == 200
                        for _ in reply.iter_raw():
                            pass
                else:
                    assert http.post(path, json=body).status_code == 200
            return run

        variants = {f"{api} {'stream' if stream else 'whole'}": call(path, body, stream)
                    for stream in (False, True) for api, (path, body) in bodies(args.tokens).items()}
        timings = time_interleaved(variants, warmup=2, repeats=args.rounds, min_sample_s=0.3)
    print_header("Agent API adapters: router time per request", "python bench/bench_agent_apis.py "
                 + " ".join(argv if argv is not None else sys.argv[1:]))
    rows = []
    for name, timing in timings.items():
        base = timings[f"chat {name.split()[1]}"].median
        rows.append((name, timing.median * 1e3, timing.spread, timing.median / base))
    print(markdown_table(["API", "ms / request (median)", "spread", "x chat"], rows))
    print(f"\n- tokens per answer: {args.tokens}; backend: scripted (no model), one event per token, no delay")
    print(f"- run: {monitor.summary()}")


if __name__ == "__main__":
    main()
