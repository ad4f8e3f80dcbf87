"""The router: the public OpenAI endpoint of a disaggregated deployment."""
