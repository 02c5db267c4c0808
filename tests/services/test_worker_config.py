"""Worker flags for the prefix cache: ``--kvstore`` (validated) and ``--revision``."""

from __future__ import annotations

import pytest

from glmserve.engine.engine_config import EngineConfig
from glmserve.services.decode.main import DECODE_STEP_TOKENS, DecodeConfig
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


def test_layersplit_stage_flags() -> None:
    base = ["--model", "m", "--worker-id", "p0", "--port", "5001"]
    c = PrefillConfig.from_args([*base, "--stage-index", "1", "--stage-addresses", "a:5000, b:5001",
                                 "--layer-split", "0-3,4-7", "--chunk-tokens", "512"])
    assert (c.stage_index, c.stage_address_list, c.layer_split, c.chunk_tokens) == (1, ["a:5000", "b:5001"],
                                                                                    "0-3,4-7", 512)
    for extra, message in [(["--stage-index", "0"], "stage_index: --stage-index and --stage-addresses"),
                           (["--stage-index", "2", "--stage-addresses", "a:5000,b:5001"], "stage_index: 2"),
                           (["--stage-index", "0", "--stage-addresses", "a:5000,b:5001"], "stage_addresses"),
                           (["--chunk-tokens", "0"], "chunk_tokens")]:
        with pytest.raises(ValueError, match=message):
            PrefillConfig.from_args([*base, *extra])


def test_step_token_budget_is_short_on_decode_workers() -> None:
    """A decode worker prefills its own prompts in short steps (DECODE_STEP_TOKENS), a prefill worker
    takes the engine's default unless told; the flag is checked."""
    assert DecodeConfig.from_args(BASE).engine_config()["max_step_tokens"] == DECODE_STEP_TOKENS
    assert DECODE_STEP_TOKENS < EngineConfig().max_step_tokens
    assert "max_step_tokens" not in PrefillConfig.from_args(BASE).engine_config()
    assert PrefillConfig.from_args([*BASE, "--max-step-tokens", "1024"]).engine_config()["max_step_tokens"] == 1024
    with pytest.raises(ValueError, match="max_step_tokens"):
        DecodeConfig.from_args([*BASE, "--max-step-tokens", "0"])


@pytest.mark.parametrize("config", [PrefillConfig, DecodeConfig])
def test_shared_prompt_tokens_flag_reaches_the_engine_and_is_checked(config) -> None:
    assert "max_shared_prompt_tokens" not in config.from_args(BASE).engine_config()
    options = config.from_args([*BASE, "--shared-prompt-tokens", "256"]).engine_config()
    assert EngineConfig(**{k: v for k, v in options.items() if k != "dtype"}).max_shared_prompt_tokens == 256
    with pytest.raises(ValueError, match="shared_prompt_tokens"):
        config.from_args([*BASE, "--shared-prompt-tokens", "0"])


@pytest.mark.parametrize("config", [PrefillConfig, DecodeConfig])
def test_mtp_flag_reaches_the_engine_and_is_checked(config) -> None:
    """--mtp sets EngineConfig.mtp (and with it the KV layout, which prefill and decode share)."""
    assert config.from_args(BASE).engine_config()["mtp"] == "auto"
    assert config.from_args([*BASE, "--mtp", "off"]).engine_config()["mtp"] == "off"
    assert config.from_args([*BASE, "--mtp", "2"]).engine_config()["mtp"] == 2
    for bad in ("sometimes", "-1", ""):
        with pytest.raises(ValueError, match="mtp"):
            config.from_args([*BASE, "--mtp", bad])
