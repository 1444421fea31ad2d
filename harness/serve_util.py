"""Start a real `vllm serve` subprocess, wait for `/health`, read `/metrics`, stop it.

    with VllmServer(model_dir, ["--dtype", "float32"], env={"VLLM_ENABLE_CHUNK_CACHE": "true"}) as srv:
        srv.url            # http://127.0.0.1:PORT (the OpenAI API is under srv.url + "/v1")
        srv.metrics()      # {"vllm:prefix_cache_hits_total": 12.0, ...}, summed over label sets

The server runs in its own process group (so Ctrl-C reaches only this process, which then stops
it); `stop()` terminates the whole group, then kills it if it does not exit in time. Servers
still running at interpreter exit, or when this process gets SIGTERM/SIGHUP, are stopped too.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

_RUNNING: set[VllmServer] = set()
logger = logging.getLogger(__name__)

PORT_TAKEN = ("EADDRINUSE", "Address already in use")
"""In a server's log: a port picked free was taken before the server bound it (torch.distributed's
store: `DistNetworkError ... EADDRINUSE`; the API server's own: `[Errno 98] Address already in use`)."""

REPO = Path(__file__).resolve().parent.parent
# The generated models (scripts/setup_env.sh), unless CHUNK_CACHE_MODELS_DIR names another folder.
MODELS = Path(os.environ.get("CHUNK_CACHE_MODELS_DIR", REPO / ".models"))


def portable(text: str | Path) -> str:
    """`text` (a path, or a command line of words) naming no machine's directories, for results:
    paths in this checkout relative to it, other absolute paths (existing or about to be
    written) and existing relative ones outside it by their name."""
    words = []
    for word in str(text).split(" "):
        path = Path(word)
        if word.startswith(f"{REPO}{os.sep}"):
            word = word[len(str(REPO)) + 1 :]
        elif os.sep in word and (path.is_absolute() or path.exists()) and REPO not in path.resolve().parents:
            word = path.name
        words.append(word)
    return " ".join(words)


def env_assignment(text: str) -> tuple[str, str]:
    """`NAME=VALUE` (a `--server-env` argument) as (NAME, VALUE)."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=VALUE")
    return name, value


def free_ports(count: int) -> list[int]:
    """`count` distinct ports free on 127.0.0.1 now. Every socket stays bound until all are picked:
    ports picked one at a time, each socket closed before the next, can repeat (a Mooncake master
    and its store process once drew the same one, and the master dropped the store's memory)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


def free_port() -> int:
    """A port free on 127.0.0.1 now."""
    (port,) = free_ports(1)
    return port


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {sample name: value summed over its label sets}."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def scrape(url: str) -> str:
    """The `/metrics` text of the server at `url`."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return r.read().decode()


def requests_in_flight(url: str) -> int:
    """`vllm:num_requests_running` + `vllm:num_requests_waiting` (chunk prefills included)."""
    metrics = parse_prometheus(scrape(url))
    return int(metrics["vllm:num_requests_running"] + metrics["vllm:num_requests_waiting"])


def openai_client(url: str, timeout: float, **kwargs):
    """An `openai.OpenAI` client of the server at `url` that never retries (a dropped connection
    is an error, not a silent second request)."""
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=timeout, max_retries=0, **kwargs)


def tiny_serve_args(name: str, max_model_len: int = 4096) -> list[str]:
    """The `vllm serve` arguments every tiny-model server here starts with: served as `name`,
    float32, `max_model_len` tokens, seed 0."""
    return [
        "--served-model-name",
        name,
        "--dtype",
        "float32",
        "--max-model-len",
        str(max_model_len),
        "--seed",
        "0",
    ]


class VllmServer:
    """One `vllm serve MODEL ARGS...` subprocess on 127.0.0.1, its output in a log file."""

    def __init__(
        self,
        model: str | Path,
        args: Sequence[str] = (),
        *,
        env: Mapping[str, str | None] | None = None,
        log_path: str | Path | None = None,
        port: int | None = None,
        start_timeout: float = 300.0,
        checkout: Path | None = None,
    ) -> None:
        """`checkout`: another checkout of this project to serve from (its `.venv`, whose vLLM
        that checkout patched, started in that directory); default: this interpreter."""
        self.model = str(model)
        self.checkout = checkout
        self.python = str(checkout / ".venv" / "bin" / "python") if checkout else sys.executable
        self.args = list(args)
        self.env = dict(env or {})
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.start_timeout = start_timeout
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="vllm-serve-", suffix=".log")
            os.close(fd)
        self.log_path = Path(log_path)
        self.proc: subprocess.Popen | None = None

    @property
    def command(self) -> list[str]:
        return [
            self.python,
            "-m",
            "vllm.entrypoints.cli.main",
            "serve",
            self.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *self.args,
        ]

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def start(self) -> VllmServer:
        """Start the server and wait until it is healthy. A start that lost a port race (vLLM
        picks its internal ports free and binds them later, so a process starting beside it
        can take one first) is tried once more, on a new port; its log is kept beside the new one."""
        try:
            return self._start()
        except RuntimeError:
            log = self.log_tail(chars=1 << 20)
            if not any(sign in log for sign in PORT_TAKEN):
                raise
        lost = self.log_path.with_suffix(".port-taken.log")
        self.log_path.replace(lost)
        logger.warning("vllm serve lost a port race (log %s); starting it again", lost)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        return self._start()

    def _start(self) -> VllmServer:
        # An engine core in its own process talks to the API server; tests force it in-process.
        env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
        env.update(self.env)
        env = {k: v for k, v in env.items() if v is not None}  # None: unset for the server
        _install_signal_handlers()
        with self.log_path.open("w") as out:
            self.proc = subprocess.Popen(
                self.command,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                cwd=self.checkout,  # `python -m` imports from the working directory first
            )
        _RUNNING.add(self)
        try:
            self._wait_healthy()
        except BaseException:
            self.stop(timeout=5.0)  # still starting: it may not act on SIGTERM yet
            raise
        return self

    def _wait_healthy(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.start_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"vllm serve exited with {self.proc.returncode} (log {self.log_path}):\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"vllm serve did not start in {self.start_timeout:.0f} s "
                    f"(log {self.log_path}):\n{self.log_tail()}"
                )
            time.sleep(0.5)

    def metrics(self) -> dict[str, float]:
        return parse_prometheus(scrape(self.url))

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The whole server stopped (SIGSTOP to its process group) inside the block: an idle
        server next to a measured one still takes the cores now and then."""
        os.killpg(self.proc.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.killpg(self.proc.pid, signal.SIGCONT)

    def stop(self, timeout: float = 30.0) -> None:
        """Terminate the server's process group (API server and engine core); kill it if needed."""
        proc, self.proc = self.proc, None
        _RUNNING.discard(self)
        if proc is None or proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            try:
                proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        # The group may outlive its leader (an engine core still shutting down).
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _stop_all() -> None:
    for server in list(_RUNNING):
        server.stop(timeout=10.0)


def _on_signal(signum, frame) -> None:  # SIGTERM/SIGHUP: unwind through the `finally`s
    raise SystemExit(128 + signum)


_handlers_installed = False


def start_all(servers: Sequence[VllmServer]) -> list[float | Exception]:
    """Start `servers` at once (their compilations and graph captures overlap): per server its
    start-up seconds, or the exception that stopped it (that server is stopped again)."""
    from concurrent.futures import ThreadPoolExecutor

    _install_signal_handlers()  # here: signal handlers can only be set in the main thread

    def start(server: VllmServer) -> float:
        began = time.perf_counter()
        server.start()
        return time.perf_counter() - began

    with ThreadPoolExecutor(max_workers=max(1, len(servers))) as pool:
        futures = [pool.submit(start, server) for server in servers]
    out: list[float | Exception] = []
    for future in futures:
        try:
            out.append(future.result())
        except Exception as exc:  # the others' results are kept
            out.append(exc)
    return out


def _install_signal_handlers() -> None:
    global _handlers_installed
    if _handlers_installed:
        return
    _handlers_installed = True
    atexit.register(_stop_all)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        with contextlib.suppress(ValueError):  # not in the main thread
            if signal.getsignal(sig) in (signal.SIG_DFL, None):
                signal.signal(sig, _on_signal)
