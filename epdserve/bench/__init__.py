"""Load generation and measurement against OpenAI-compatible endpoints."""
