"""The OpenAI-compatible HTTP server (`impasto serve`)."""
