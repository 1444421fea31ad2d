"""Worker side (device): the pool tensors, KV save and load, RoPE position shifts."""
