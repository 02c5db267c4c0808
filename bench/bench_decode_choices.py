"""The decode step's kernel choices, each switched off against the defaults, step by step interleaved.

One engine per (batch, context) holds `batch` requests in steady decode (MTP off, one token a step),
new ones every round. In every round each variant runs `--steps` steps of every load, variants in
rotating order, and the ratio to the defaults is taken within the round (this machine drifts 30-50%
within seconds). The variants switch off one choice each:

- weights unpacked: decode_forward's matmul weights as plain tensors, not prepacked for oneDNN
  (PackedLinear; F.linear instead: oneDNN reordering the weight at every call in bfloat16, MKL in float32);
- layer by layer: decode steps through the model's layers (`GlmForCausalLM.forward`), not the one
  function written for short-query batches (`decode_forward`); the choices below (marked +) are
  switched off on top of it, as they apply only there;
- + unfolded: kv_b_proj not folded into the query and output projections (AbsorbedProjections.folds);
- + indexer always: the indexer's queries and scores run even where every context is within
  index_topk (its selection is then the whole context);
- + experts grouped: routed experts run on rows grouped by expert, not densely (glmserve/model/moe.py,
  DENSE_MAX_TOKENS);
- all off: all of these together.

    python bench/bench_decode_choices.py [--batches 8,32 --contexts 64,256 --rounds 5 --dtype auto]
"""

from __future__ import annotations

import argparse
import sys
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from statistics import median

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.bench_floor import DecodeLoad  # noqa: E402
from bench.common import RunMonitor, markdown_table, print_header, rotated, setup  # noqa: E402
from glmserve.engine.engine import Engine, EngineConfig  # noqa: E402
from glmserve.model import attention, moe  # noqa: E402
from glmserve.model.dtype_choice import resolve_dtype  # noqa: E402
from glmserve.model.graph_weights import GraphWeights  # noqa: E402
from glmserve.model.loader import load_model  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/glm52-tiny")
    p.add_argument("--dtype", default="auto", help="auto (the CPU's fast dtype), float32 or bfloat16")
    p.add_argument("--batches", type=lambda t: [int(v) for v in t.split(",") if v], default=[8, 32])
    p.add_argument("--contexts", type=lambda t: [int(v) for v in t.split(",") if v], default=[64, 256],
                   help="prompt tokens of each decoding request")
    p.add_argument("--steps", type=int, default=10, help="timed steps of each variant and load per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


@contextmanager
def unfolded(model):
    projections = [layer.self_attn.absorbed for layer in model.model.layers.values()]
    saved = [p.folds for p in projections]
    for p in projections:
        p.folds = False
    try:
        yield
    finally:
        for p, folds in zip(projections, saved, strict=True):
            p.folds = folds


@contextmanager
def indexer_always(model):
    saved = attention.MLAttention._needs_index
    attention.MLAttention._needs_index = lambda self, ctx: True
    try:
        yield
    finally:
        attention.MLAttention._needs_index = saved


@contextmanager
def experts_grouped(model):
    saved = moe.DENSE_MAX_TOKENS
    moe.DENSE_MAX_TOKENS = 0
    try:
        yield
    finally:
        moe.DENSE_MAX_TOKENS = saved


@contextmanager
def weights_unpacked(model):
    saved = model._graph_weights
    model._graph_weights = GraphWeights.of(model, prepack=False)
    try:
        yield
    finally:
        model._graph_weights = saved


@contextmanager
def layer_by_layer(model):
    model.decode_graph_enabled = False
    try:
        yield
    finally:
        model.decode_graph_enabled = True


SWITCHES = {"weights unpacked": [weights_unpacked], "layer by layer": [layer_by_layer], "+ unfolded": [layer_by_layer, unfolded],
            "+ indexer always": [layer_by_layer, indexer_always], "+ experts grouped": [layer_by_layer, experts_grouped],
            "all off": [layer_by_layer, unfolded, indexer_always, experts_grouped]}


def timed_steps(load: DecodeLoad, model, switches, steps: int) -> float:
    """Seconds per step of `steps` steps with `switches` applied (after one untimed step)."""
    with ExitStack() as stack:
        for switch in switches:
            stack.enter_context(switch(model))
        load.step()
        start = time.perf_counter()
        for _ in range(steps):
            load.step()
        return (time.perf_counter() - start) / steps


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup(args.threads, args.seed)
    monitor = RunMonitor()
    dtype = resolve_dtype(args.dtype)
    model = load_model(args.model, dtype=dtype)
    gen = torch.Generator().manual_seed(args.seed)
    variants = {"defaults": [], **SWITCHES}
    steps_per_round = (args.steps + 1) * len(variants)
    engines = {}
    model._graph_weights = GraphWeights.of(model)  # the defaults' weights, before any variant swaps them
    for b in args.batches:
        for c in args.contexts:
            cache_bytes = 2 * b * (c + steps_per_round + 16) * 3000
            engines[(b, c)] = Engine(model, EngineConfig(mtp="off", prefix_caching=False, kv_cache_bytes=cache_bytes,
                                                         max_num_seqs=max(64, b)))
    times = {(key, v): [] for key in engines for v in variants}
    for r in range(args.rounds):
        for key, engine in engines.items():
            # Fresh requests every round, so the contexts stay near `context` (within index_topk or not).
            for request_id in list(engine.requests):
                engine.abort(request_id)
            load = DecodeLoad(engine, *key, gen)
            for v in rotated(list(variants), r):
                times[(key, v)].append(timed_steps(load, model, variants[v], args.steps))
        print(f"round {r + 1} done", file=sys.stderr)

    rows = []
    for b, c in engines:
        base = times[((b, c), "defaults")]
        row = [f"batch {b}, context {c}", f"{median(base) * 1e3:.1f}"]
        for v in SWITCHES:
            ratio = median(x / d for x, d in zip(times[((b, c), v)], base, strict=True))
            row.append(f"{median(times[((b, c), v)]) * 1e3:.1f} ({ratio:.2f}x)")
        rows.append(row)
    print_header("Decode-step kernel choices, each switched off",
                 " ".join(["python", f"bench/{Path(__file__).name}", *(sys.argv[1:] if argv is None else argv)]), monitor)
    print(f"- model: `{args.model}`, dtype {dtype} (`--dtype {args.dtype}`), MTP off, prefix caching off; "
          f"random prompts, new requests every round (contexts grow by {steps_per_round} tokens in a round); "
          f"{args.steps} steps a sample, {args.rounds} rounds, variants in rotating order; medians, ratio to "
          "the defaults within a round\n")
    print(markdown_table(["decode step", "defaults ms", *(f"{v} ms" for v in SWITCHES)], rows))


if __name__ == "__main__":
    main()
