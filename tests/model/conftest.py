"""The bundled model models/glm52-tiny, loaded once per test module that asks for it."""

from __future__ import annotations

from pathlib import Path

import pytest

from glmserve.model.loader import load_model
from glmserve.text.tokenizer import Tokenizer

BUNDLED_DIR = Path(__file__).resolve().parents[2] / "models" / "glm52-tiny"


@pytest.fixture(scope="module")
def bundled_model():
    if not (BUNDLED_DIR / "model.safetensors").exists():
        pytest.skip("bundled model missing")
    return load_model(BUNDLED_DIR)


@pytest.fixture(scope="module")
def bundled_tokenizer():
    return Tokenizer.from_dir(BUNDLED_DIR)
