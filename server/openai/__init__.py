"""OpenAI's protocol layer: what a request asks for and how an answer is shaped, apart from the engine."""
