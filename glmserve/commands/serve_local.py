"""`glmserve serve-local`: the router's OpenAI API over one in-process engine (no disaggregation).

The quickest way to talk to a model; `glmserve serve` (router, prefill, decode, kvstore as separate
processes) is the platform proper.
"""

from __future__ import annotations

import argparse
import json
import logging

import uvicorn

from glmserve.commands.generate import mtp_setting
from glmserve.services.local_backend import LocalEngineBackend
from glmserve.services.router.app import create_app
from glmserve.text.tokenizer import Tokenizer


def run_serve_local(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = json.loads((args.model / "config.json").read_text())
    backend = LocalEngineBackend.from_model_dir(args.model, mtp=mtp_setting(args.mtp))
    app = create_app(
        backend,
        Tokenizer.from_dir(args.model),
        model_name=args.model.name,
        api_keys=args.api_key or None,
        max_context=config["max_position_embeddings"],
        separate_reasoning=args.reasoning_parser != "none",
    )
    print(f"glmserve: serving {args.model.name} at http://{args.host}:{args.port}/v1", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
