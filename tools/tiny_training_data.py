"""Training windows for glm52-tiny: token streams with per-token loss weights.

Code: the stdlib files back to back; a window starts anywhere and every token counts. Chats: the
transcripts back to back; a window starts where a chat starts (so its tool list and ask are in
view when the assistant answers) and tokens count fully inside the assistant's output, with
`context_weight` elsewhere. A window may run on into the next chat, as packed pretraining does.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tokenizers import Tokenizer

from glmserve.text.special_tokens import TOOL_CALL_START


@dataclass(frozen=True)
class Stream:
    ids: torch.Tensor  # [T] int64
    weights: torch.Tensor  # [T] float32, the loss weight of predicting each token
    starts: torch.Tensor | None = None  # [D] int64 allowed window starts (None: anywhere)

    def window(self, rng: random.Random, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        last = len(self.ids) - length
        if self.starts is None:
            start = rng.randrange(0, last)
        else:
            start = int(self.starts[rng.randrange(0, int((self.starts < last).sum()))])
        return self.ids[start : start + length], self.weights[start : start + length]


def code_stream(tok: Tokenizer, texts: Sequence[str], eos: int) -> Stream:
    ids: list[int] = []
    for enc in tok.encode_batch(list(texts)):
        ids.extend(enc.ids)
        ids.append(eos)
    t = torch.tensor(ids, dtype=torch.int64)
    return Stream(t, torch.ones(len(t)))


def chat_stream(
    tok: Tokenizer, examples: Sequence[tuple[str, list[tuple[int, int]]]], context_weight: float,
    decision_weight: float = 1.0,
) -> Stream:
    """`examples` from `tiny_corpus.chat_examples` (text, assistant char spans). The tokens where a turn
    decides (its first token: a call or text; each `<tool_call>` and the token after it, which picks the
    tool) weigh `decision_weight`: a few tokens among the hundreds a turn adds to the loss."""
    ids: list[int] = []
    weights: list[float] = []
    starts: list[int] = []
    encodings = tok.encode_batch([text for text, _ in examples], add_special_tokens=False)
    for (text, spans), enc in zip(examples, encodings, strict=True):
        starts.append(len(ids))
        ids.extend(enc.ids)
        weights.extend(_token_weights(text, enc.offsets, spans, context_weight, decision_weight))
    return Stream(
        torch.tensor(ids, dtype=torch.int64),
        torch.tensor(weights, dtype=torch.float32),
        torch.tensor(starts, dtype=torch.int64),
    )


def _token_weights(text: str, offsets, spans, context_weight: float, decision_weight: float) -> list[float]:
    weights = [1.0 if any(s < end and start < e for s, e in spans) else context_weight for start, end in offsets]
    for s, e in spans:
        first = next((i for i, (_, end) in enumerate(offsets) if end > s), None)
        calls = [i for i, (start, end) in enumerate(offsets) if s <= start < e and text[start:end] == TOOL_CALL_START]
        names = [i + 1 for i in calls if i + 1 < len(offsets)]  # the token that starts the tool's name
        for i in ([first] if first is not None else []) + calls + names:
            weights[i] = decision_weight
    return weights


def sample_windows(
    streams: Sequence[Stream], shares: Sequence[float], rng: random.Random, n: int, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, length] token ids and loss weights, each row from a stream drawn by `shares`."""
    rows = [rng.choices(streams, shares)[0].window(rng, length) for _ in range(n)]
    return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])
