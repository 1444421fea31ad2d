"""Frontend (API server / LLM process): chunked prompts → token ids + `ChunkCacheInfo`."""
