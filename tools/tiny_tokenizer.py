"""Train and save the byte-level BPE tokenizer of the toy model glm52-tiny.

    python -m tools.tiny_tokenizer --out models/glm52-tiny [--vocab-size 8192] [--transcripts 4000]

The saved dir loads both with `glmserve.text.tokenizer.Tokenizer.from_dir` and with
`transformers.AutoTokenizer.from_pretrained` (PreTrainedTokenizerFast; transformers 5.23 reads
`chat_template.jinja` from the dir, checked by tests/text/test_chat_template.py).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from glmserve.text.chat_template import CHAT_TEMPLATE
from glmserve.text.special_tokens import EOS_TOKEN, PAD_TOKEN, SPECIAL_TOKENS

# GPT-4 style split (as GLM-4 uses): words with one leading non-letter, numbers in groups of
# up to 3 digits, punctuation runs, newline runs; then ByteLevel maps bytes to printable chars.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _special_tokens() -> list[AddedToken]:
    return [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]


def train_tokenizer(texts: Iterable[str], vocab_size: int = 8192, min_frequency: int = 2) -> Tokenizer:
    """Byte-level BPE; the GLM special tokens get ids 0..17 in `SPECIAL_TOKENS` order."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    # Registered before training so the training text is split on them (no merges wasted on
    # pieces of `<|user|>`), and ids 0..17 are theirs. No post-processor: no automatic BOS/EOS.
    tok.add_special_tokens(_special_tokens())
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=_special_tokens(),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    for i, t in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(t) != i:
            raise RuntimeError(f"special token {t} got id {tok.token_to_id(t)}, expected {i}")
    return tok


def save_tokenizer(
    tokenizer: Tokenizer,
    model_dir: str | Path,
    chat_template: str = CHAT_TEMPLATE,
    model_max_length: int | None = None,
) -> None:
    """Write tokenizer.json, tokenizer_config.json and chat_template.jinja into `model_dir`."""
    d = Path(model_dir)
    d.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(d / "tokenizer.json"))
    config: dict[str, object] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,  # decode must give back the exact text
        "extra_special_tokens": [t for t in SPECIAL_TOKENS if t not in (EOS_TOKEN, PAD_TOKEN)],
    }
    if model_max_length is not None:
        config["model_max_length"] = model_max_length
    (d / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (d / "chat_template.jinja").write_text(chat_template)


def loss_mask(
    tokenizer: Tokenizer, text: str, spans: Sequence[tuple[int, int]]
) -> tuple[list[int], list[int]]:
    """Token ids of `text` and a 0/1 mask marking tokens that overlap the char `spans`
    (the assistant output from `tools.tiny_corpus.chat_examples`): train the loss only there."""
    enc = tokenizer.encode(text, add_special_tokens=False)
    mask = [int(any(s < end and start < e for s, e in spans)) for start, end in enc.offsets]
    return enc.ids, mask


def main(argv: Sequence[str] | None = None) -> None:
    from tools.tiny_corpus import chat_transcripts, stdlib_texts

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("models/glm52-tiny"))
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--transcripts", type=int, default=4000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    texts = [*stdlib_texts("train"), *chat_transcripts(args.transcripts, args.seed)]
    tok = train_tokenizer(texts, args.vocab_size)
    save_tokenizer(tok, args.out)
    print(f"saved {tok.get_vocab_size()} tokens to {args.out}")


if __name__ == "__main__":
    main()
