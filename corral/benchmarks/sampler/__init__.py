"""`corral bench sampler`: CPU cost of one decode step's whole-vocabulary work (argmax, draws, filters)."""
