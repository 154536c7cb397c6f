"""The reference worker: a tiny real model in NumPy, paged KV cache, scheduler, KV transfer."""
