"""Shared fixtures. Engines are session-scoped: one start costs ~40 s on a 2-core CPU."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import pytest

from tests.helpers import REPO
from tests.helpers.stale_shm import remove_stale_segments

MODELS = Path(os.environ.get("CHUNK_CACHE_MODELS_DIR", REPO / ".models"))

# The CPU backend reserves this many GiB for the paged KV cache; keep engines small.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# The chunk pool is carved out of that budget.
os.environ.setdefault("VLLM_CHUNK_CACHE_SIZE_GB", "0.25")
# In-process engine core, so tests can look at the scheduler's `Request`s.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def pytest_addoption(parser) -> None:
    parser.addoption(
        "--strict-skips",
        action="store_true",
        help="a skipped test fails, unless it is marked `cuda` or `optional`, or its reason starts "
        "with 'no CUDA' (scripts/test.sh: a test that needs two cores, a store binary or a model runs)",
    )


USER_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
INDUCTOR_CACHE = USER_CACHE / "vllm-ascend-chunk" / "inductor"
"""The kernel cache every test process shares (CHUNK_CACHE_TEST_INDUCTOR_CACHE overrides it)."""


def pytest_configure(config) -> None:
    """Torch inductor's vector-ISA probe (~15 s per engine process) runs once per test run, and
    its kernels compile once per graph, not once per engine configuration:
    tests/helpers/site/sitecustomize.py does both here and in every child process. Under
    pytest-xdist the controller makes the memo and its workers inherit it. The controller also
    removes the shared-memory segments that killed CPU workers of earlier runs left behind
    (tests/helpers/stale_shm.py): a TP or PP engine that draws a leftover's port cannot start."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        memo = tempfile.mkdtemp(prefix="chunk-cache-isa-probe-")
        config.isa_probe_memo = memo
        os.environ["CHUNK_CACHE_TEST_ISA_MEMO"] = memo
        os.environ.setdefault("CHUNK_CACHE_TEST_INDUCTOR_CACHE", str(INDUCTOR_CACHE))
        config.stale_shm_removed = remove_stale_segments()
    site = str(REPO / "tests" / "helpers" / "site")
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if site not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (site, *paths) if p)
    importlib.import_module("tests.helpers.site.sitecustomize")


def pytest_unconfigure(config) -> None:
    shutil.rmtree(getattr(config, "isa_probe_memo", ""), ignore_errors=True)


# The files that take longest (seconds of a run on 2 cores, fixtures included), run first so that
# pytest-xdist's workers (scripts/test.sh) finish together; a file past ~30 s belongs here.
SLOW_FILES = (
    "tests/engine/test_model_families.py",  # 360 (12 engines, one at TP=2); 730 on a loaded machine
    "tests/install/test_gpu_session.py",  # 180
    "tests/engine/test_chunk_engines.py",  # 170
    "tests/install/test_quickstart.py",  # 150-270 (pip's cache cold or warm)
    "tests/server/test_disaggregated_prefill.py",  # 120
    "tests/store/test_parallel_tiers.py",  # 115
    "tests/store/test_shared_servers.py",  # 95
    "tests/engine/test_model_parallel.py",  # 85
    "tests/server/test_eval_cli.py",  # 80-135 (two servers, one after the other)
    "tests/store/test_data_parallel_store.py",  # 75
    "tests/install/test_demo.py",  # 60
    "tests/store/test_rogue_writer.py",  # 55
    "tests/store/test_shared_engines.py",  # 50
    "tests/server/test_data_parallel.py",  # 40
    "tests/store/test_remote_store.py",  # 40
    "tests/engine/test_multi_connector.py",  # 40
    "tests/unit/test_coordinator.py",  # 35
    "tests/engine/test_host_tier.py",  # 30
    "tests/engine/test_memory_tier.py",  # 30
)


def pytest_collection_modifyitems(items) -> None:
    """The slow files first (in SLOW_FILES' order), then the others as collected."""
    rank = {path: i for i, path in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


ALLOWED_SKIP_MARKERS = ("cuda", "optional")
ALLOWED_SKIP_REASON = "no CUDA"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """With --strict-skips, a skip other than the allowed ones is reported as a failure."""
    report = yield
    if report.skipped and item.config.getoption("strict_skips") and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        marked = any(item.get_closest_marker(name) for name in ALLOWED_SKIP_MARKERS)
        if not (marked or reason.startswith(ALLOWED_SKIP_REASON)):
            report.outcome = "failed"
            report.longrepr = (
                f"SKIPPED IN A STRICT RUN: {item.nodeid}: {reason}\n"
                "--strict-skips (scripts/test.sh) runs every test but those marked `cuda` or "
                "`optional` and those skipped for 'no CUDA': give this test what it needs."
            )
    return report


_wall_times: defaultdict[str, float] = defaultdict(float)
_started = time.monotonic()


def pytest_runtest_logreport(report) -> None:
    """Wall time of each test (set-up, call, tear-down), added up per test directory; under
    pytest-xdist the controller receives every worker's reports."""
    _wall_times[Path(report.nodeid.split("::", 1)[0]).parent.as_posix()] += report.duration


def pytest_terminal_summary(terminalreporter, config) -> None:
    removed = getattr(config, "stale_shm_removed", [])
    if removed:
        terminalreporter.write_line(
            f"removed {len(removed)} stale vLLM CPU shared-memory segments before the run "
            f"(tests/helpers/stale_shm.py), e.g. {removed[0]}"
        )
    if not _wall_times:
        return
    terminalreporter.write_sep("=", "wall time per test directory (fixtures included where first used)")
    for directory, seconds in sorted(_wall_times.items()):
        terminalreporter.write_line(f"{seconds:8.1f} s  {directory}")
    terminalreporter.write_line(f"{sum(_wall_times.values()):8.1f} s  in all")
    workers = getattr(config.option, "numprocesses", None)
    if workers:
        elapsed = time.monotonic() - _started
        terminalreporter.write_line(f"{elapsed:8.1f} s  elapsed, tests run by {workers} pytest-xdist workers")


@pytest.fixture
def chunk_env(monkeypatch):
    """`chunk_env(NAME=value, OTHER=None)`: set (or, with None, unset) chunk cache environment
    variables for one test and read the process-wide configuration again; restored after it."""
    from vllm_ascend_chunk.config.settings import get_config

    def set_env(**values: str | None) -> None:
        for name, value in values.items():
            if value is None:  # set first, so that what the code under test sets is undone too
                monkeypatch.setenv(name, "")
                monkeypatch.delenv(name)
            else:
                monkeypatch.setenv(name, value)
        get_config.cache_clear()

    yield set_env
    get_config.cache_clear()


@pytest.fixture(scope="session")
def models_dir() -> Path:
    """The tiny models, generated if missing (scripts/setup_env.sh normally made them)."""
    subprocess.run(
        [sys.executable, str(REPO / "scripts" / "make_tiny_models.py"), "--out", str(MODELS)],
        check=True,
        capture_output=True,
    )
    return MODELS


@pytest.fixture(scope="session")
def raw_tok(models_dir: Path):
    """The tiny models' tokenizer through `tokenizers` alone: the independent tokenization."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(models_dir / "tiny-llama" / "tokenizer.json"))


@pytest.fixture(scope="session")
def tiny_llama_llm(models_dir: Path):
    """A real patched vLLM engine on the tiny Llama model (float32, greedy-friendly)."""
    from vllm import LLM

    # A small token budget makes long prompts and chunk prefills span several steps; stats on
    # for the metrics tests.
    llm = LLM(
        str(models_dir / "tiny-llama"),
        dtype="float32",
        max_model_len=4096,
        seed=0,
        max_num_batched_tokens=512,
        disable_log_stats=False,
    )
    yield llm
    del llm


@pytest.fixture
def scheduled_requests(tiny_llama_llm):
    """The engine core `Request`s of clients the scheduler receives while the test runs."""
    from vllm_ascend_chunk.scheduler.prefills import CHUNK_PREFILL_ID_PREFIX

    scheduler = tiny_llama_llm.llm_engine.engine_core.engine_core.scheduler
    seen = []
    original = scheduler.add_request

    def record(request, *args, **kwargs):
        if not request.request_id.startswith(CHUNK_PREFILL_ID_PREFIX):  # chunk prefills
            seen.append(request)
        return original(request, *args, **kwargs)

    scheduler.add_request = record
    yield seen
    scheduler.add_request = original


@pytest.fixture(scope="session")
def tiny_llama_server_log(tmp_path_factory) -> Path:
    """Where `tiny_llama_server` logs."""
    return tmp_path_factory.mktemp("server") / "vllm-serve.log"


@pytest.fixture(scope="session")
def tiny_llama_server(models_dir: Path, tiny_llama_server_log: Path):
    """A real patched `vllm serve` process on the tiny Llama model; yields its base URL. Started
    with the defaults (`VLLM_ENABLE_CHUNK_CACHE=1 VLLM_CPU_KVCACHE_SPACE=1`, no pool setting): the
    pool is sized from its KV memory, 0.25 of 1 GiB, as large as the offline engines' pools."""
    from tests.helpers.server_utils import vllm_server

    env = {"VLLM_ENABLE_CHUNK_CACHE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CHUNK_CACHE_SIZE_GB": None}
    with vllm_server(models_dir / "tiny-llama", tiny_llama_server_log, env=env) as url:
        yield url


@pytest.fixture(scope="session")
def client(tiny_llama_server):
    """An `openai` client of `tiny_llama_server` (no retries, every call timed out)."""
    from tests.helpers.server_utils import client

    return client(tiny_llama_server)
