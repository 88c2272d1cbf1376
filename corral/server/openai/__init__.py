"""The OpenAI protocol layer: request fields, response pieces and their mapping onto corral's engine."""
