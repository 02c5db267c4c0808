"""Worker flags for the prefix cache: ``--kvstore`` (validated) and ``--revision``."""

from __future__ import annotations

import pytest

from glmserve.services.decode.main import DecodeConfig
from glmserve.services.prefill.main import PrefillConfig

BASE = ["--model", "m", "--worker-id", "w"]


@pytest.mark.parametrize("config", [PrefillConfig, DecodeConfig])
def test_kvstore_and_revision_flags(config) -> None:
    c = config.from_args([*BASE, "--kvstore", "127.0.0.1:50070", "--revision", "rev-7"])
    assert (c.kvstore, c.revision) == ("127.0.0.1:50070", "rev-7")
    assert config.from_args(BASE).kvstore is None
    for bad in ("nohost", "h:0", ":50070", "h:port"):
        with pytest.raises(ValueError, match="kvstore"):
            config.from_args([*BASE, "--kvstore", bad])
