"""The values of every `--dtype` flag, without importing torch (the launchers do not).

`glmserve.model.dtype_choice.resolve_dtype` turns one into a torch dtype.
"""

DTYPE_CHOICES = ("auto", "float32", "bfloat16")
