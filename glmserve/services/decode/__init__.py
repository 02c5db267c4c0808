"""The decode worker service: owns a request's life, gets its prompt KV from a prefill worker,
decodes it with MTP speculative decoding and streams the tokens."""
