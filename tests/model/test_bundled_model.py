"""models/glm52-tiny: transformers reads it as GLM-5.2, and it has learned what it was trained for."""

from __future__ import annotations

import json

import pytest
import torch

from glmserve.model.forward_batch import ForwardBatch
from glmserve.model.glm_model import with_input_ids
from glmserve.model.greedy import greedy_generate
from glmserve.text.tool_calls import parse_tool_calls
from tests.model.conftest import BUNDLED_DIR as MODEL_DIR
from tools import tiny_corpus

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a text file, optionally only a range of lines (1-based, inclusive).",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string", "description": "Path of the file."}},
                "required": ["path"],
            },
        },
    }
]

pytestmark = pytest.mark.skipif(not (MODEL_DIR / "model.safetensors").exists(), reason="bundled model missing")


@pytest.fixture(scope="module")
def model(bundled_model):
    return bundled_model


@pytest.fixture(scope="module")
def tokenizer(bundled_tokenizer):
    return bundled_tokenizer


def _heldout_windows(tokenizer, n: int, length: int) -> list[list[int]]:
    files = tiny_corpus.stdlib_texts("heldout")[:n]
    return [tokenizer.encode(text)[:length] for text in files if len(tokenizer.encode(text)) >= length]


def test_config_is_glm52_schema():
    config = json.loads((MODEL_DIR / "config.json").read_text())
    assert config["model_type"] == "glm_moe_dsa" and config["architectures"] == ["GlmMoeDsaForCausalLM"]
    assert config["num_hidden_layers"] == 8 and config["first_k_dense_replace"] == 3
    assert config["max_position_embeddings"] >= 32768 and config["rope_parameters"]["rope_theta"] == 8e6
    assert (MODEL_DIR / "model.safetensors").stat().st_size < 50 * 2**20


@torch.no_grad()
def test_transformers_gives_the_same_logits(model, tokenizer):
    from transformers import GlmMoeDsaForCausalLM

    ref = GlmMoeDsaForCausalLM.from_pretrained(MODEL_DIR, attn_implementation="eager", dtype=torch.float32).eval()
    ids = _heldout_windows(tokenizer, 3, 320)[0]  # longer than index_topk: sparse attention is on
    expected = ref(torch.tensor([ids])).logits[0]
    got = model.forward_logits(ForwardBatch.build([ids], [0], [[0]], block_size=512))
    assert (got - expected).abs().max().item() <= 1e-4


def test_transformers_tokenizer_renders_the_same_ids(tokenizer):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(MODEL_DIR)
    messages = [
        {"role": "system", "content": "You are a careful engineer."},
        {"role": "user", "content": "Show me the top of json/decoder.py"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "read_file", "arguments": {"path": "json/decoder.py"}}}
        ]},
        {"role": "tool", "content": '"""Implementation of JSONDecoder\n"""'},
    ]
    ours = tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True)
    theirs = hf.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=True)
    theirs = theirs["input_ids"] if isinstance(theirs, dict) or hasattr(theirs, "keys") else theirs
    assert ours == list(theirs)


@torch.no_grad()
def test_heldout_loss_and_mtp_agreement(model, tokenizer):
    """Numbers of the model card, on a few held-out standard-library files."""
    windows = _heldout_windows(tokenizer, 6, 258)
    assert len(windows) >= 3
    losses, agree, count = [], 0, 0
    for ids in windows:
        batch = ForwardBatch.build([ids[:-2]], [0], [[0]], block_size=512)
        normed = model.final_norm(model(model.context(batch))[0])
        logits = model.logits(normed)
        losses.append(torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:-1])).item())
        mtp_batch = with_input_ids(batch, torch.tensor(ids[1:-1]))
        draft = model.mtp_logits(model.mtp_step(model.context(mtp_batch), normed)[0]).argmax(-1)
        agree += int((draft[:-1] == logits.argmax(-1)[1:]).sum())
        count += len(draft) - 1
    print(f"held-out loss {sum(losses) / len(losses):.3f}, MTP top-1 agreement {agree / count:.3f}")
    assert sum(losses) / len(losses) < 4.5
    assert agree / count >= 0.5


def test_greedy_chat_with_tools_emits_a_tool_call(model, tokenizer):
    messages = [{"role": "user", "content": "Can you explain the function JSONDecoder.decode from json/decoder.py?"}]
    prompt = tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True)
    out = greedy_generate(model, prompt, max_new_tokens=48, stop_ids=tokenizer.eos_token_ids)
    text = tokenizer.decode([t for t in out if t not in tokenizer.eos_token_ids])
    calls = parse_tool_calls(text, tools=TOOLS).tool_calls
    assert calls, text
    assert calls[0]["function"]["name"] in {"read_file", "grep", "list_dir", "run_tests", "run_command", "edit_file"}
    json.loads(calls[0]["function"]["arguments"])
