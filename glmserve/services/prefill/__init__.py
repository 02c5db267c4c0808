"""The prefill worker service: computes prompts and writes their KV into decode workers' blocks."""
