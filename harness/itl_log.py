"""Every inter-token latency a `vllm serve` measures, one per line in a file: exact ITL quantiles
for benchmarks.

vLLM's `vllm:inter_token_latency_seconds` histogram has its lowest bucket edge at 10 ms, so on a
model that decodes a token in a few milliseconds its p50 and p99 only say "under 10 ms" (the
interpolated p50 is always 5 ms). `ItlFileLogger` is a vLLM stat-logger plugin (entry-point group
`vllm.stat_logger_plugins`) that appends the very samples that histogram counts (engine-core
timestamps of consecutive tokens of a request) to the file named by `$CHUNK_CACHE_BENCH_ITL_LOG`, in
seconds. `plugin_env` makes a server load it without installing anything: a distribution's metadata
in a directory put on the server's `PYTHONPATH`.
"""

from __future__ import annotations

import os
from pathlib import Path

from vllm.v1.metrics.loggers import StatLoggerBase
from vllm.v1.metrics.stats import IterationStats

from harness.serve_util import REPO

LOG_ENV = "CHUNK_CACHE_BENCH_ITL_LOG"
PLUGIN = "chunk_cache_itl_file"
_DIST = "chunk_cache_bench_itl_log-0.dist-info"


class ItlFileLogger(StatLoggerBase):
    """Appends each iteration's inter-token latencies (seconds) to `$CHUNK_CACHE_BENCH_ITL_LOG`."""

    def __init__(self, vllm_config: object, engine_index: int = 0) -> None:
        path = os.environ.get(LOG_ENV)
        if not path:
            raise RuntimeError(f"the ITL log plugin is loaded but {LOG_ENV} names no file")
        self._file = open(path, "a")  # noqa: SIM115 (the server's lifetime)

    def record(
        self,
        scheduler_stats: object,
        iteration_stats: IterationStats | None,
        mm_cache_stats: object = None,
        engine_idx: int = 0,
    ) -> None:
        if iteration_stats is not None and iteration_stats.inter_token_latencies_iter:
            self._file.write("".join(f"{itl!r}\n" for itl in iteration_stats.inter_token_latencies_iter))
            self._file.flush()

    def log_engine_initialized(self) -> None:
        pass


def plugin_env(directory: Path, log: Path) -> dict[str, str]:
    """The environment under which a `vllm serve` started from this checkout writes its ITLs to
    `log` (the plugin's metadata is written into `directory`)."""
    dist = directory / _DIST
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: chunk-cache-bench-itl-log\nVersion: 0\n")
    (dist / "entry_points.txt").write_text(
        f"[vllm.stat_logger_plugins]\n{PLUGIN} = {__name__}:{ItlFileLogger.__name__}\n"
    )
    log.write_text("")
    path = [str(directory), str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {"PYTHONPATH": os.pathsep.join(path), LOG_ENV: str(log)}
    if allowed := os.environ.get("VLLM_PLUGINS"):  # vLLM then loads only the plugins it names
        env["VLLM_PLUGINS"] = f"{allowed},{PLUGIN}"
    return env


def read(log: Path) -> list[float]:
    """The ITLs (seconds) written to `log` so far, in order (a line still being written is left
    for the next read)."""
    text = log.read_text()
    return [float(line) for line in text[: text.rfind("\n") + 1].splitlines()]
