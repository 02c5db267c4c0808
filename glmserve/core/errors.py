"""Errors shared by every layer of glmserve."""


class GlmServeError(Exception):
    """Base class of glmserve's own errors."""


class CheckpointError(GlmServeError):
    """A checkpoint on disk does not match what the configuration says it should hold."""
