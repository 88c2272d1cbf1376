"""`corral bench serve`: a load benchmark of a running corral over HTTP, constrained vs unconstrained at several
concurrency levels, against a naive baseline (transformers `generate` + xgrammar's logits processor)."""
