"""glmserve Engine vs transformers `generate()`: output tokens/s at 1, 8 and 32 concurrent requests.

Both run the bundled model in float32 on the same prompts (held-out stdlib source, 128-256 tokens)
and generate exactly `--max-tokens` greedy tokens per request (glmserve: `ignore_eos`; transformers:
no eos, so neither stops early and argmax is never altered). transformers runs each concurrency
level as one left-padded batch with its default cache; glmserve gets all requests at once and
batches them continuously, with MTP off and with the adaptive policy (`auto`). Every system does
one warm-up run at each concurrency level before the timed ones (MTP `auto` learns its costs there),
then `--rounds` rounds each time every system once (interleaved, so drifts of the machine's speed
hit them alike, and in rotating order): wall times are medians, ratios are taken within a round (median). Prefix caching is off so repeated prompts are recomputed. `agree@16`: fraction of requests whose
first 16 tokens equal transformers' tokens.

    python bench/bench_engine_throughput.py [--concurrency 1,8,32 --max-tokens 64 ...]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from statistics import median

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.common import int_list, markdown_table, print_header, rotated, setup  # noqa: E402
from glmserve.core.generation import SamplingParams  # noqa: E402
from glmserve.engine.engine import Engine, EngineConfig  # noqa: E402
from glmserve.engine.engine_stats import EngineStats  # noqa: E402
from glmserve.model.loader import load_model  # noqa: E402
from glmserve.model.revision import model_revision  # noqa: E402
from glmserve.text.tokenizer import Tokenizer  # noqa: E402
from tools.tiny_corpus import stdlib_texts  # noqa: E402

AGREE_TOKENS = 16
WARMUP_TOKENS = 32


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/glm52-tiny")
    p.add_argument("--concurrency", type=int_list, default=[1, 8, 32])
    p.add_argument("--max-tokens", type=int, default=64, help="generated tokens per request")
    p.add_argument("--min-len", type=int, default=128, help="shortest prompt, tokens")
    p.add_argument("--max-len", type=int, default=256, help="longest prompt, tokens")
    p.add_argument("--hf-attn", default="sdpa", help="transformers attn_implementation")
    p.add_argument("--rounds", type=int, default=3, help="timed runs per system, interleaved")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def code_prompts(tokenizer: Tokenizer, n: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    """`n` windows of held-out stdlib source, each `min_len..max_len` tokens at a random offset."""
    docs = [ids for ids in map(tokenizer.encode, stdlib_texts("heldout")) if len(ids) >= 2 * max_len]
    rng = random.Random(seed)
    out = []
    for i in range(n):
        ids = docs[i % len(docs)]
        length = rng.randint(min_len, max_len)
        start = rng.randrange(len(ids) - length)
        out.append(ids[start : start + length])
    return out


def run_glmserve(engine: Engine, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    reqs = engine.generate(prompts, params)
    return time.perf_counter() - start, [r.output_ids for r in reqs]


@torch.inference_mode()
def run_transformers(
    model, prompts: list[list[int]], max_tokens: int, pad_id: int
) -> tuple[float, list[list[int]]]:
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    start = time.perf_counter()
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=max_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=pad_id,
    )
    seconds = time.perf_counter() - start
    return seconds, out[:, width:].tolist()


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> float:
    same = sum(o[:AGREE_TOKENS] == r[:AGREE_TOKENS] for o, r in zip(outputs, reference, strict=True))
    return same / len(reference)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup(args.threads, args.seed)
    from transformers import GlmMoeDsaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # the unused MTP layer (model.layers.<n>.*) is expected
    tokenizer = Tokenizer.from_dir(args.model)
    n = max(args.concurrency)
    prompts = code_prompts(tokenizer, n, args.min_len, args.max_len, args.seed)
    hf = GlmMoeDsaForCausalLM.from_pretrained(
        args.model, dtype=torch.float32, attn_implementation=args.hf_attn
    )
    hf.eval()
    pad_id = hf.config.pad_token_id or 0
    model, revision = load_model(args.model, dtype=torch.float32), model_revision(args.model)
    engines = {
        mtp: Engine(model, EngineConfig(mtp=mtp, prefix_caching=False, max_num_seqs=max(64, n)), revision)
        for mtp in ("off", "auto")
    }
    rows = []
    for c in args.concurrency:
        batch = prompts[:c]
        run_transformers(hf, batch, WARMUP_TOKENS, pad_id)
        for engine in engines.values():
            run_glmserve(engine, batch, WARMUP_TOKENS)
            engine.stats = EngineStats()  # count the timed runs only
        # Rounds interleave the systems, so a slow spell of the machine hits them all alike, and rotate
        # their order (the run after another system's is not the same as the first); each ratio is
        # taken within a round, and the median is reported.
        seconds: dict[str, list[float]] = {name: [] for name in ("hf", *engines)}
        outputs = {}
        for r in range(args.rounds):
            for name in rotated(list(seconds), r):  # each system takes every place in the order
                if name == "hf":
                    s, outputs[name] = run_transformers(hf, batch, args.max_tokens, pad_id)
                else:
                    s, outputs[name] = run_glmserve(engines[name], batch, args.max_tokens)
                seconds[name].append(s)
        hf_s = median(seconds["hf"])
        rows.append([c, f"transformers ({args.hf_attn})", f"{hf_s:.2f}", f"{c * args.max_tokens / hf_s:.1f}",
                     "1.00", "1.00", "-"])
        for mtp, engine in engines.items():
            s = median(seconds[mtp])
            ratio = median(h / g for h, g in zip(seconds["hf"], seconds[mtp], strict=True))
            accept = f"{engine.stats.mean_acceptance_length:.2f}" if mtp == "auto" else "-"
            rows.append([c, f"glmserve mtp={mtp}", f"{s:.2f}", f"{c * args.max_tokens / s:.1f}", f"{ratio:.2f}",
                         f"{agreement(outputs[mtp], outputs['hf']):.2f}", accept])
        print(f"concurrency {c} done", file=sys.stderr)
    print_header(
        "Engine throughput: glmserve vs transformers",
        " ".join(["python", f"bench/{Path(__file__).name}", *(sys.argv[1:] if argv is None else argv)]),
    )
    print(
        f"- model: `{args.model}` (float32); prompts {args.min_len}-{args.max_len} tokens of held-out stdlib "
        f"source; {args.max_tokens} greedy tokens per request; prefix caching off; warm-up run first, "
        f"then {args.rounds} interleaved rounds in rotating order (medians; ratios within a round)\n"
    )
    print(
        markdown_table(
            [
                "concurrency",
                "system",
                "wall s",
                "output tok/s",
                "x transformers",
                f"agree@{AGREE_TOKENS}",
                "MTP accept len",
            ],
            rows,
        )
    )


if __name__ == "__main__":
    main()
