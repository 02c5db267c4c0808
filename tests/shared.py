"""What tests across packages share: where the model is, free ports on 127.0.0.1 (fixtures on top of
these are in ``tests/conftest.py``; service launchers in ``tests/services/*_fixtures.py``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from glmserve.commands.free_ports import PortPicker

REPO = Path(__file__).resolve().parents[1]
# The bundled model; GLMSERVE_TEST_MODEL_DIR points the tests at another dir of the same format.
MODEL_DIR = Path(os.environ.get("GLMSERVE_TEST_MODEL_DIR", REPO / "models" / "glm52-tiny"))
HAS_MODEL = (MODEL_DIR / "model.safetensors").exists()
requires_model = pytest.mark.skipif(not HAS_MODEL, reason=f"no model at {MODEL_DIR}")


# One picker for the whole test run: a port it handed out is not handed out again while a service
# may still be about to bind it, and none is drawn from the kernel's ephemeral range.
PORTS = PortPicker("127.0.0.1")


def free_port() -> int:
    """A port nothing listens on now, on 127.0.0.1 (the only interface tests may use)."""
    return PORTS.port()


def free_port_run(count: int) -> int:
    """The first of ``count`` consecutive free ports on 127.0.0.1."""
    return PORTS.run(count)
