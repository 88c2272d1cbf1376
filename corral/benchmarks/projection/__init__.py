"""`corral bench projection`: CPU cost of the model's linear projections, oneDNN-packed against F.linear."""
