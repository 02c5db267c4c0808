"""`glmserve kv-layout`: how a model's KV is laid out in blocks, and its bytes per token."""

from __future__ import annotations

import argparse

import torch

from glmserve.model.config import GlmConfig
from glmserve.model.kv_layout import KVLayout


def run_kv_layout(args: argparse.Namespace) -> int:
    config = GlmConfig.from_pretrained(args.model)
    layout = KVLayout.for_config(config, args.block_size, getattr(torch, args.dtype))
    print(layout.describe())
    print(f"full indexer layers: {list(config.full_indexer_layers)}")
    return 0
