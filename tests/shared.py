"""What tests across packages share: where the model is, free ports on 127.0.0.1 (fixtures on top of
these are in ``tests/conftest.py``; service launchers in ``tests/services/*_fixtures.py``)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# The bundled model; GLMSERVE_TEST_MODEL_DIR points the tests at another dir of the same format.
MODEL_DIR = Path(os.environ.get("GLMSERVE_TEST_MODEL_DIR", REPO / "models" / "glm52-tiny"))
HAS_MODEL = (MODEL_DIR / "model.safetensors").exists()
requires_model = pytest.mark.skipif(not HAS_MODEL, reason=f"no model at {MODEL_DIR}")


def free_port() -> int:
    """A port nothing listens on now, on 127.0.0.1 (the only interface tests may use)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
