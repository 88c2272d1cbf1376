"""`corral bench drafts`: speculative decoding on answers that copy from their prompt."""
