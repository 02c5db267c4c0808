"""Loss weights of glm52-tiny's chat windows (tools/tiny_training_data.py): assistant output counts fully,
the rest with the context weight, and the decision tokens (a turn's first token, each `<tool_call>` and
the token naming the tool) with the decision weight."""

from __future__ import annotations

from tokenizers import Tokenizer

from tests.shared import MODEL_DIR
from tools import tiny_corpus
from tools.tiny_training_data import chat_stream


def _stream(decision_weight: float):
    tok = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    return tok, chat_stream(tok, tiny_corpus.chat_examples(12, seed=0), 0.1, decision_weight)


def test_decision_tokens_get_the_decision_weight():
    tok, plain = _stream(1.0)
    _, weighted = _stream(7.0)
    assert {round(w, 6) for w in plain.weights.tolist()} <= {0.1, 1.0}
    changed = (weighted.weights != plain.weights).nonzero().flatten().tolist()
    assert changed and all(plain.weights[i] == 1.0 and weighted.weights[i] == 7.0 for i in changed)
    ids = weighted.ids.tolist()
    before = [tok.decode([ids[i - 1]], skip_special_tokens=False) for i in changed]
    picked = [tok.decode([ids[i]], skip_special_tokens=False) for i in changed]
    assert all(b in ("\n", "<tool_call>") or p == "<tool_call>" for b, p in zip(before, picked, strict=True))
    assert "<tool_call>" in picked
    # every assistant turn's first token is one of them
    turn_starts = [i + 1 for i, t in enumerate(ids[:-1]) if tok.id_to_token(t) == "<|assistant|>"]
    assert all(any(c in (s, s + 1) for c in changed) for s in turn_starts)
