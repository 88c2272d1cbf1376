"""`corral bench soak`: many mixed requests at concurrency 16 with hostile traffic beside ordinary traffic."""
