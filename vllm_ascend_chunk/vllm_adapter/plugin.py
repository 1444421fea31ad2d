"""`vllm.general_plugins` entry point: vLLM calls `register()` in every process it starts."""

from __future__ import annotations

import logging

from vllm_ascend_chunk.config.settings import get_config

logger = logging.getLogger("vllm.chunk_cache")


def register() -> None:
    """Validate the configuration (fail fast on a bad value) and say what is active; register the
    connector by name, where vLLM's `MultiConnector` looks its children's statistics up
    (`build_kv_connector_stats`, in the process that logs them)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from vllm_ascend_chunk.config.engine import CONNECTOR_MODULE
    from vllm_ascend_chunk.config.engine_settings import CONNECTOR

    logger.info(get_config().describe())
    try:
        KVConnectorFactory.get_connector_class_by_name(CONNECTOR)
    except ValueError:  # not registered yet in this process
        KVConnectorFactory.register_connector(CONNECTOR, CONNECTOR_MODULE, CONNECTOR)
