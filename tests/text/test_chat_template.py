"""A tokenizer trained and saved by tools/tiny_tokenizer.py loads in glmserve and in transformers
alike, and both render and tokenize chats identically; the corpus builder is deterministic."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers

from glmserve.text.chat import render_chat
from glmserve.text.chat_template import CHAT_TEMPLATE
from glmserve.text.special_tokens import EOS_TOKENS, SPECIAL_TOKENS
from glmserve.text.tokenizer import Tokenizer
from tools.tiny_corpus import assistant_spans, chat_examples, chat_transcripts, stdlib_files
from tools.tiny_tokenizer import loss_mask, save_tokenizer, train_tokenizer

UNICODE_CODE = (
    "def grüße(name: str) -> str:\r\n"
    '    """Say hi 👋 — «quoted» 中文 テスト, e\u0301 (combining), ß, Ω."""\n'
    "\treturn f'{name!r}: 😀🚀' + '\\u00e9'  # trailing spaces   \n\n\n"
    "x = [1_000, 0x1F, 3.14e-2]; y = {'k': None}  <|user|> [gMASK]\n"
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file (<100 KB & UTF-8).",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "start_line": {"type": "integer"}},
                "required": ["path"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run_tests",
            "description": "Run pytest.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "verbose": {"type": "boolean"}},
            },
        },
    },
]

MESSAGES = [
    {"role": "system", "content": "You are a coding agent. Ünïcode is fine."},
    {"role": "user", "content": "Why does json/decoder.py fail? 😀"},
    {
        "role": "assistant",
        "content": "Let me look.",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "read_file", "arguments": {"path": "json/decoder.py", "start_line": 3}},
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "run_tests", "arguments": {"path": "tests", "verbose": True}},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "    3\timport re\n"},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "1 failed"}]},
    {"role": "assistant", "content": "The regex is wrong."},
    {"role": "user", "content": "Fix it."},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    texts = (
        [p.read_text() for p in stdlib_files("train")[:12]] + chat_transcripts(15, seed=1) + [UNICODE_CODE]
    )
    d = tmp_path_factory.mktemp("glm52-tiny")
    save_tokenizer(train_tokenizer(texts, vocab_size=1500), d)
    return d


@pytest.fixture(scope="module")
def ours(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def hf(model_dir: Path) -> transformers.PreTrainedTokenizerBase:
    return transformers.AutoTokenizer.from_pretrained(model_dir)


def test_special_token_ids(ours: Tokenizer) -> None:
    assert [ours.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(18))
    assert ours.eos_token_ids == tuple(ours.token_to_id(t) for t in EOS_TOKENS) == (0, 7, 9)
    assert ours.vocab_size == 1500


def test_transformers_loads_dir(model_dir: Path, hf: transformers.PreTrainedTokenizerBase) -> None:
    assert isinstance(hf, transformers.PreTrainedTokenizerFast)
    assert hf.eos_token == "<|endoftext|>" and hf.pad_token_id == 0
    assert "chat_template" not in json.loads((model_dir / "tokenizer_config.json").read_text())
    assert hf.chat_template == CHAT_TEMPLATE  # picked up from chat_template.jinja


def test_chat_with_tools_same_text_and_ids(ours: Tokenizer, hf: transformers.PreTrainedTokenizerBase) -> None:
    for gen in (True, False):
        text = hf.apply_chat_template(MESSAGES, tools=TOOLS, add_generation_prompt=gen, tokenize=False)
        assert text == ours.render_chat(MESSAGES, TOOLS, add_generation_prompt=gen)
        ids = hf.apply_chat_template(
            MESSAGES, tools=TOOLS, add_generation_prompt=gen, tokenize=True, return_dict=False
        )
        assert list(ids) == ours.apply_chat_template(MESSAGES, TOOLS, add_generation_prompt=gen)
    text = ours.render_chat(MESSAGES, TOOLS)
    assert text.startswith("[gMASK]<sop><|system|>\n# Tools") and text.endswith(
        "<|user|>\nFix it.<|assistant|>\n"
    )
    assert '"description": "Read a file (<100 KB & UTF-8)."' in text  # tojson does not HTML-escape
    ids = ours.apply_chat_template(MESSAGES, TOOLS)
    assert ids[:2] == [2, 4] and ids[-2:] == [8, ours.encode("\n")[0]]  # [gMASK] <sop> ... <|assistant|> \n


def test_encode_decode_round_trip(ours: Tokenizer, hf: transformers.PreTrainedTokenizerBase) -> None:
    texts = [UNICODE_CODE, *(p.read_text() for p in stdlib_files("heldout")[:3])]
    for text in texts:
        ids = ours.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == text == hf.decode(ids, clean_up_tokenization_spaces=False)
    ids = ours.encode("a<|user|>b")
    assert ours.token_to_id("<|user|>") in ids  # special tokens in the text are recognised
    assert ours.decode(ids, skip_special_tokens=True) == "ab"


def test_string_arguments_and_errors() -> None:
    as_string = [
        {
            **m,
            "tool_calls": [
                {**c, "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"])}}
                for c in m["tool_calls"]
            ],
        }
        if "tool_calls" in m
        else m
        for m in MESSAGES
    ]
    assert render_chat(as_string, TOOLS) == render_chat(MESSAGES, TOOLS)
    with pytest.raises(ValueError, match="role"):
        render_chat([{"role": "wizard", "content": "x"}])
    with pytest.raises(ValueError, match="arguments"):
        render_chat(
            [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]
        )
    with pytest.raises(ValueError, match="arguments"):
        render_chat([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}])


def test_corpus_is_deterministic_and_split() -> None:
    train, heldout = stdlib_files("train"), stdlib_files("heldout")
    assert heldout and not set(train) & set(heldout) and len(heldout) < 0.05 * len(train)
    assert chat_transcripts(4, seed=3) == chat_transcripts(5, seed=3)[:4]
    text, spans = chat_examples(1, seed=3)[0]
    assert (
        text.startswith("[gMASK]<sop>") and text.endswith("<|endoftext|>") and spans == assistant_spans(text)
    )
    assert text[spans[-1][0] : spans[-1][1]].endswith("<|endoftext|>")
    assert all(text[s - len("<|assistant|>\n") : s] == "<|assistant|>\n" for s, _ in spans)


def test_loss_mask_covers_assistant_output(ours: Tokenizer, model_dir: Path) -> None:
    import tokenizers

    text, spans = chat_examples(1, seed=4)[0]
    ids, mask = loss_mask(tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json")), text, spans)
    assert ids == ours.encode(text) and len(mask) == len(ids)
    assert ours.decode([i for i, m in zip(ids, mask, strict=True) if m]) == "".join(
        text[s:e] for s, e in spans
    )
