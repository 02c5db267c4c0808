"""Load harness: drives any OpenAI-compatible server over HTTP only (`glmserve bench`).

Talks HTTP and nothing else: no engine, model or service imports (a tokenizer from `glmserve.text`
is used only when the user gives one).
"""
