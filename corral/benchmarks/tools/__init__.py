"""`corral bench tools`: tool-call compliance with JSONSchemaBench schemas as function parameters."""
