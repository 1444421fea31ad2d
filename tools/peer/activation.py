"""A pytest plugin for the peer suite (`tools.peer.vllm_peer_tests`): which tests configured the
chunk cache on, and which it refused, so that a mode that claims "on" proves it ran.

Loaded into vLLM's test session with `-p` when `CHUNK_CACHE_PEER_ACTIVATION` names the JSON file
to write at its end: `{"active": [test ids], "refused": [test ids]}`. It wraps
`config.engine.configure`, which the patched `VllmConfig` calls for every config a test builds;
an unpatched vLLM never calls it, so a pristine run writes empty lists.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

ENV = "CHUNK_CACHE_PEER_ACTIVATION"
_current: list[str] = ["<collection>"]
_active: set[str] = set()
_refused: set[str] = set()


def pytest_configure(config) -> None:
    from vllm_ascend_chunk.config import engine as engine_config
    from vllm_ascend_chunk.config.engine_settings import is_active

    configure = engine_config.configure

    def counted(vllm_config) -> None:
        try:
            configure(vllm_config)
        except engine_config.ChunkCacheSetupError:
            _refused.add(_current[0])
            raise
        if is_active(vllm_config):
            _active.add(_current[0])

    engine_config.configure = counted


def pytest_runtest_setup(item) -> None:
    _current[0] = item.nodeid


def pytest_sessionfinish(session, exitstatus) -> None:
    if out := os.environ.get(ENV):
        Path(out).write_text(json.dumps({"active": sorted(_active), "refused": sorted(_refused)}))
