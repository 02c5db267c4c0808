"""`glmserve generate`: one prompt through the local engine, streamed as text or printed as JSON."""

from __future__ import annotations

import argparse
import json
import sys
import time

from glmserve.core.generation import SamplingParams
from glmserve.engine.engine import Engine
from glmserve.engine.engine_config import mtp_option
from glmserve.text.tokenizer import Tokenizer


def mtp_setting(value: str) -> str | int:
    try:
        return mtp_option(value)
    except ValueError as e:
        raise SystemExit(f"--{e}") from None


def run_generate(args: argparse.Namespace) -> int:
    tokenizer = Tokenizer.from_dir(args.model)
    if args.prompt_token_ids:
        prompt = [int(t) for t in args.prompt_token_ids.split(",") if t.strip()]
    elif args.chat:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
    else:
        prompt = tokenizer.encode(args.prompt)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed
    )
    engine = Engine.from_model_dir(args.model, dtype=args.dtype, mtp=mtp_setting(args.mtp))
    start = time.perf_counter()
    first = None
    req = engine.add_request("cli", prompt, params)
    while engine.has_unfinished():
        for out in engine.step():
            if out.token_ids and first is None:
                first = time.perf_counter() - start
            if not args.json:
                sys.stdout.write(out.text)
                sys.stdout.flush()
    total = time.perf_counter() - start
    if args.json:
        result = {
            "prompt_token_ids": prompt,
            "token_ids": req.output_ids,
            "text": req.output_text.text,
            "finish_reason": req.finish_reason,
            "timings": {"ttft_s": first, "total_s": total, "tokens_per_s": len(req.output_ids) / total},
            "mtp": {"draft_tokens": engine.stats.draft_tokens, "accepted_tokens": engine.stats.accepted_tokens,
                    "mean_acceptance_length": engine.stats.mean_acceptance_length},
        }
        print(json.dumps(result))
    else:
        sys.stdout.write("\n")
    return 0
