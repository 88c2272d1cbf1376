"""`corral bench engine`: the decode loop alone (no HTTP), constrained and free text, at fixed concurrency."""
