"""`vllm.general_plugins` entry point: vLLM calls `register()` in every process it starts."""

from __future__ import annotations

import logging

from vllm_ascend_chunk.config import get_config

logger = logging.getLogger("vllm.chunk_cache")


def register() -> None:
    """Validate the configuration (fail fast on a bad value) and say what is active."""
    logger.info(get_config().describe())
