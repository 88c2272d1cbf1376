"""corral's server: OpenAI-compatible HTTP over a constrained decode engine."""
