"""Reading Hugging Face safetensors checkpoints: single file or sharded with an index."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from glmserve.core.errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class Checkpoint:
    """Name -> tensor access over the files of one checkpoint directory (opened lazily, read on demand)."""

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        index = self.dir / INDEX_FILE
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.file_of = {name: self.dir / file for name, file in weight_map.items()}
        elif (self.dir / SINGLE_FILE).exists():
            with safe_open(self.dir / SINGLE_FILE, framework="pt") as f:
                self.file_of = {name: self.dir / SINGLE_FILE for name in f.keys()}
        else:
            raise CheckpointError(f"{self.dir}: neither {INDEX_FILE} nor {SINGLE_FILE} found")
        self._stack = ExitStack()
        self._open: dict[Path, object] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.file_of

    def names(self) -> Iterator[str]:
        return iter(self.file_of)

    def get(self, name: str) -> torch.Tensor:
        path = self.file_of[name]
        if path not in self._open:
            self._open[path] = self._stack.enter_context(safe_open(path, framework="pt"))
        return self._open[path].get_tensor(name)

    def close(self) -> None:
        self._stack.close()
        self._open.clear()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
