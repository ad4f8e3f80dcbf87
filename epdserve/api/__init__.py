"""The OpenAI-compatible HTTP surface: wire schemas, errors, the server."""
