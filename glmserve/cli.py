"""The `glmserve` command line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from glmserve.commands.bench import add_bench_parser
from glmserve.core.dtype_names import DTYPE_CHOICES

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "models" / "glm52-tiny"


def _model_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="checkpoint dir (default: bundled)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="glmserve", description="Serving for the GLM-5.2 model family")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate from one prompt with the local engine")
    _model_arg(gen)
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-token-ids", help="comma-separated token ids")
    gen.add_argument("--chat", action="store_true", help="wrap --prompt as a user message in the chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--mtp", default="auto", help="number of MTP drafts, 'auto' or 'off'")
    gen.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                     help="auto: bfloat16 where the CPU has AMX or AVX512-BF16, else float32")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    serve = sub.add_parser("serve-local", help="OpenAI-compatible server over one in-process engine")
    _model_arg(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", action="append", default=[], help="require this key (repeatable)")
    serve.add_argument("--mtp", default="auto", help="number of MTP drafts, 'auto' or 'off'")
    serve.add_argument("--reasoning-parser", choices=["glm45", "none"], default="glm45",
                       help="glm45: chat answers carry <think> blocks as reasoning_content; none: in the content")
    launch = sub.add_parser("serve", help="router, prefill and decode workers and kvstore as separate processes")
    _model_arg(launch)
    from glmserve.commands.serve import add_serve_args  # the launcher owns its flags

    add_serve_args(launch)
    add_bench_parser(sub)
    layout = sub.add_parser("kv-layout", help="print the KV block layout and bytes per token of a model")
    _model_arg(layout)
    layout.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    layout.add_argument("--block-size", type=int, default=64)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "kv-layout":
        from glmserve.commands.kv_layout import run_kv_layout

        return run_kv_layout(args)
    if args.command == "bench":
        from glmserve.commands.bench import run_bench

        return run_bench(args, argv)
    if args.command == "serve":
        from glmserve.commands.serve import run_serve

        return run_serve(args)
    if args.command == "serve-local":
        from glmserve.commands.serve_local import run_serve_local

        return run_serve_local(args)
    from glmserve.commands.generate import run_generate

    return run_generate(args)


if __name__ == "__main__":
    sys.exit(main())
