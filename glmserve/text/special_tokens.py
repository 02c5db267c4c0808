"""GLM special tokens, in id order for the bundled toy tokenizer (ids 0..17), and how a streaming
parser holds back a partial tag.

The order matters: `tools/tiny_tokenizer.py` adds these first, so `<|endoftext|>` is id 0,
`[MASK]` id 1, ..., `</arg_value>` id 17. Real GLM checkpoints use other ids; always look ids up
through the tokenizer (`Tokenizer.token_to_id`), never hard-code them.
"""

from __future__ import annotations

ENDOFTEXT = "<|endoftext|>"
MASK = "[MASK]"
GMASK = "[gMASK]"
SMASK = "[sMASK]"
SOP = "<sop>"
EOP = "<eop>"
SYSTEM = "<|system|>"
USER = "<|user|>"
ASSISTANT = "<|assistant|>"
OBSERVATION = "<|observation|>"
THINK_START = "<think>"
THINK_END = "</think>"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
ARG_KEY_START = "<arg_key>"
ARG_KEY_END = "</arg_key>"
ARG_VALUE_START = "<arg_value>"
ARG_VALUE_END = "</arg_value>"

SPECIAL_TOKENS: tuple[str, ...] = (
    ENDOFTEXT,
    MASK,
    GMASK,
    SMASK,
    SOP,
    EOP,
    SYSTEM,
    USER,
    ASSISTANT,
    OBSERVATION,
    THINK_START,
    THINK_END,
    TOOL_CALL_START,
    TOOL_CALL_END,
    ARG_KEY_START,
    ARG_KEY_END,
    ARG_VALUE_START,
    ARG_VALUE_END,
)

# The tool-call markup: special tokens, yet part of the text the tool-call parser reads.
TOOL_MARKUP: tuple[str, ...] = (
    TOOL_CALL_START, TOOL_CALL_END, ARG_KEY_START, ARG_KEY_END, ARG_VALUE_START, ARG_VALUE_END,
)

# The reasoning block's tags: special tokens, yet part of the text the reasoning parser reads.
THINK_TAGS: tuple[str, ...] = (THINK_START, THINK_END)

# Generation stops on any of these. An assistant turn has no end marker of its own: the template
# follows it with the next role token, so the model learns to emit `<|user|>` (turn over),
# `<|observation|>` (waiting for tool results) or `<|endoftext|>` (end of a training document).
EOS_TOKENS: tuple[str, ...] = (ENDOFTEXT, USER, OBSERVATION)

# The token the tokenizer config names as eos/pad (transformers wants a single one).
EOS_TOKEN = ENDOFTEXT
PAD_TOKEN = ENDOFTEXT


def partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``: what a streaming
    parser holds back because the next delta may complete the tag (a tag may also be spelled in
    ordinary tokens, so it can arrive in pieces)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
