"""Router service: OpenAI-compatible HTTP API in front of a `GenerationBackend` (never imports torch;
only `LocalEngineBackend.from_model_dir` loads an engine, in the process that asks for it)."""
