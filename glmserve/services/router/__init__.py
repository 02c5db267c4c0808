"""Router service: OpenAI-compatible HTTP API in front of a `GenerationBackend`. It never imports
torch, the engine or the model (`tests/test_import_direction.py`); the in-process engine backend of
`glmserve serve-local` lives in `glmserve.services.local_backend`."""
