"""Maintainer tools: the patch series (apply, regenerate, vLLM's own tests), the long server
fuzz, the offline CUDA bundle and GPU session, and the NPU self-check."""
