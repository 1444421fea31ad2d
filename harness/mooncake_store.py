"""Real Mooncake Store processes on loopback, for the tests, the tier benchmark and trying the
remote tier on one machine: a master (with its embedded HTTP metadata server) and a standalone
store process (`mooncake_client`) that holds the memory, so the clients contribute none
(Mooncake's "standalone-store" mode).

    python -m harness.mooncake_store      # a 4 GiB store until Ctrl-C; prints the settings
"""

from __future__ import annotations

import atexit
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from harness.serve_util import free_ports
from vllm_ascend_chunk.config.settings import RemoteConfig

STORE_BYTES = 256 << 20
"""Memory the store process contributes (by default)."""


def mooncake_binary(name: str) -> str:
    """`name` next to this interpreter (a virtual environment's bin/) or on PATH."""
    beside = Path(sys.executable).with_name(name)
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"{name} (pip package mooncake-transfer-engine) is not installed")
    return found


def wait_for(condition, timeout_s: float, what: str, interval_s: float = 0.05) -> None:
    """Poll `condition()` until true, or `TimeoutError` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not within {timeout_s} s")
        time.sleep(interval_s)


def _stopped(task: Path) -> bool:
    """Whether a thread (/proc/PID/task/TID) is stopped: state T, the field after its name."""
    try:
        return (task / "stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    except (FileNotFoundError, ProcessLookupError):
        return True  # gone: it serves nothing either


class MooncakeProcs:
    """A master and a store process, started and stopped on demand; logs under `log_dir`."""

    def __init__(
        self,
        log_dir: Path,
        store_bytes: int = STORE_BYTES,
        lease_ms: int = 10_000,
        client_ttl_s: int = 10,
    ) -> None:
        self.log_dir = log_dir
        self.store_bytes = store_bytes
        self.lease_ms = lease_ms
        """How long a read holds an object (Mooncake's default): a read slower than this fails."""
        self.client_ttl_s = client_ttl_s
        """How long the master keeps a silent store process's memory, and the objects in it
        (Mooncake's default): a store paused longer loses them."""
        self.rpc_port, self.metadata_port, self.metrics_port, self.store_port = free_ports(4)
        self.master: subprocess.Popen | None = None
        self.store: subprocess.Popen | None = None
        self._starts = 0
        atexit.register(self.stop)

    @property
    def master_address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://127.0.0.1:{self.metadata_port}/metadata"

    def config(self, **overrides) -> RemoteConfig:
        """A client config for this store (standalone-store: the client contributes no memory)."""
        return RemoteConfig(
            **{"master": self.master_address, "metadata_server": self.metadata_server, **overrides}
        )

    def raw_client(self):
        """A plain Mooncake client of this store (to write, remove or inspect objects directly)."""
        from mooncake.store import MooncakeDistributedStore

        client = MooncakeDistributedStore()
        cfg = self.config()
        if client.setup("127.0.0.1", cfg.metadata_server, 0, 16 << 20, "tcp", "", cfg.master) != 0:
            raise RuntimeError(f"no Mooncake client for the store at {self.master_address}")
        return client

    def start(self) -> MooncakeProcs:
        """Master, then the store process; returns when the store's memory is registered."""
        self.start_master()
        self.store = self._spawn(
            "mooncake_client",
            f"-master_server_address={self.master_address}",
            f"-metadata_server={self.metadata_server}",
            f"-global_segment_size={self.store_bytes}",
            "-host=127.0.0.1",
            f"-port={self.store_port}",
            "-protocol=tcp",
        )
        self.wait_store()
        return self

    def start_master(self) -> None:
        """Start the master; with a store process running, wait until it has registered again."""
        self.master = self._spawn(
            "mooncake_master",
            f"-rpc_port={self.rpc_port}",
            "-rpc_thread_num=2",
            "-enable_http_metadata_server=true",
            "-http_metadata_server_host=127.0.0.1",
            f"-http_metadata_server_port={self.metadata_port}",
            "-metrics_host=127.0.0.1",
            f"-metrics_port={self.metrics_port}",
            f"-default_kv_lease_ttl={self.lease_ms}",
            f"-client_ttl={self.client_ttl_s}",
        )
        wait_for(lambda: self._metrics() is not None, 10, "Mooncake master")
        if self.store is not None:
            self.wait_store()

    def wait_store(self, timeout_s: float = 15) -> None:
        wait_for(lambda: self.capacity() >= self.store_bytes, timeout_s, "Mooncake store process registered")

    def kill_master(self) -> None:
        self._end(self.master, signal.SIGKILL)
        self.master = None

    def pause(self) -> None:
        """SIGSTOP the store process: the master answers, transfers hang (the "slow store").
        Returns once every thread of it has stopped: a signal takes effect when the kernel next
        schedules a thread, and on a busy machine one read was served after `send_signal`."""
        assert self.store is not None
        self.store.send_signal(signal.SIGSTOP)
        tasks = Path(f"/proc/{self.store.pid}/task")
        wait_for(lambda: all(_stopped(t) for t in tasks.iterdir()), 10, "the store stopped", 0.005)

    def resume(self) -> None:
        assert self.store is not None
        self.store.send_signal(signal.SIGCONT)

    # -- faults (harness/store_faults.py plans them) ------------------------------------
    def restart_master(self, down_s: float = 1.0) -> None:
        """Kill the master (its index, so every object, is lost) and start it again after `down_s`."""
        self.kill_master()
        time.sleep(down_s)
        self.start_master()

    def pause_for(self, seconds: float) -> None:
        """The store process paused for `seconds`: every transfer hangs meanwhile."""
        self.pause()
        try:
            time.sleep(seconds)
        finally:
            self.resume()

    def slow_for(self, seconds: float, stop_s: float = 0.3, run_s: float = 0.2) -> int:
        """A slow store for `seconds`: paused `stop_s`, running `run_s`, again and again (transfers
        take several times as long, some past the clients' timeout). Returns the pauses."""
        bursts = 0
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.pause_for(stop_s)
            bursts += 1
            time.sleep(run_s)
        return bursts

    def remove_objects(self, pattern: str) -> int:
        """Remove the objects whose names match the regular expression `pattern` (Mooncake's
        `remove_by_regex`, forced); how many it removed."""
        client = self.raw_client()
        try:
            return client.remove_by_regex(pattern, True)
        finally:
            client.close()

    def server_env(
        self, timeout_s: float = 2.0, part_mb: float | None = None, secret: str = ""
    ) -> dict[str, str]:
        """The environment that points a `vllm serve` at this store (`VLLM_CHUNK_CACHE_REMOTE_*`)."""
        env = {
            "VLLM_CHUNK_CACHE_REMOTE_MASTER": self.master_address,
            "VLLM_CHUNK_CACHE_REMOTE_METADATA": self.metadata_server,
            "VLLM_CHUNK_CACHE_REMOTE_LOCAL_HOST": "127.0.0.1",
            "VLLM_CHUNK_CACHE_REMOTE_TIMEOUT_S": f"{timeout_s:g}",
        }
        if part_mb is not None:
            env["VLLM_CHUNK_CACHE_REMOTE_PART_MB"] = f"{part_mb:.6f}"
        if secret:
            env["VLLM_CHUNK_CACHE_REMOTE_SECRET"] = secret
        return env

    def stop(self) -> None:
        """End both processes (idempotent)."""
        if self.store is not None:
            self.store.send_signal(signal.SIGCONT)
        for proc in (self.store, self.master):
            self._end(proc, signal.SIGTERM)
        self.store = self.master = None

    def _spawn(self, binary: str, *flags: str) -> subprocess.Popen:
        self._starts += 1
        log = open(self.log_dir / f"{binary}.{self._starts}.log", "wb")  # noqa: SIM115 (the child's)
        with log:
            return subprocess.Popen(
                [mooncake_binary(binary), *flags, "-logtostderr"],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    @staticmethod
    def _end(proc: subprocess.Popen | None, sig: signal.Signals) -> None:
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(sig)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def _metrics(self) -> str | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=1) as r:
                return r.read().decode()
        except OSError:
            return None

    def capacity(self) -> int:
        """The bytes of memory the master has registered (0 once it dropped a stopped store's)."""
        for line in (self._metrics() or "").splitlines():
            if line.startswith("master_total_capacity_bytes "):
                return int(float(line.split()[1]))
        return 0


def main() -> None:
    """Start a loopback store, print the settings that point an instance at it, wait for Ctrl-C."""
    import tempfile

    procs = MooncakeProcs(Path(tempfile.mkdtemp(prefix="mooncake-")), store_bytes=4 << 30).start()
    print(
        f"export VLLM_CHUNK_CACHE_REMOTE_MASTER={procs.master_address} "
        f"VLLM_CHUNK_CACHE_REMOTE_METADATA={procs.metadata_server} "
        f"VLLM_CHUNK_CACHE_REMOTE_LOCAL_HOST=127.0.0.1\n"
        f"(4 GiB store, logs in {procs.log_dir}; Ctrl-C stops it)",
        flush=True,
    )
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        procs.stop()


if __name__ == "__main__":
    main()
