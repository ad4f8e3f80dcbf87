"""The language-model engine: paged KV cache, continuous batching, chunked prefill, sampling."""
