"""Fixtures every test package may use (plain helpers are in ``tests/shared.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from glmserve.text.tokenizer import Tokenizer
from tests.shared import HAS_MODEL, MODEL_DIR


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The model the tests run (the bundled one by default); skips when it is missing."""
    if not HAS_MODEL:
        pytest.skip(f"no model at {MODEL_DIR}")
    return MODEL_DIR


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path) -> Tokenizer:
    """The model's tokenizer, loaded once per session."""
    return Tokenizer.from_dir(model_dir)
