"""JSONSchemaBench / MaskBench for corral's grammar backends: coverage, correctness and mask cost."""
