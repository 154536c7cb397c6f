"""The reference worker: a tiny real model in NumPy, a paged KV cache, a scheduler and KV transfer."""
