"""Worker side (device): the pool tensors, KV capture and load, RoPE position shifts."""
