"""Text side of glmserve: special tokens, chat template, tokenizer, detokenizer, tool-call parsing (no torch)."""
