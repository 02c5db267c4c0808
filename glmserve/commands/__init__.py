"""Implementations of the `glmserve` subcommands (heavy imports stay out of the CLI parser)."""
