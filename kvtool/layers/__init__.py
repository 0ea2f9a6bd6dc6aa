"""Data-plane building blocks of the model: attention over the paged KV cache, sampling."""
