"""A process that has imported vLLM once and forks a child per engine run (`run_engine`).

    python tests/helpers/engine_zygote.py      (started by `Zygote`, one per test process)

Importing vLLM costs ~8 s of CPU per process, more than a tiny engine's start; the suite starts
dozens of engines. The zygote imports vLLM and torch and nothing that reads the chunk cache's
settings (no vLLM plugin loaded, no configuration read: it checks), then for each request it
reads on stdin (one JSON line: argv, env, cwd, stdout and stderr paths) forks a child that takes
that environment and working directory whole, as a fresh process would, and runs
`engine_runner.main`; it answers the child's pid, then its exit status (one JSON line each).
What torch reads from the environment when it is imported, and what the loader reads when the
process starts (`LD_PRELOAD`), are the zygote's: it starts with inductor set as vLLM's CPU
platform sets it for its processes (`ZYGOTE_ENV`) and without `LD_PRELOAD`. (vLLM preloads
torch's libgomp into the workers it starts; an engine run here is one process, as it always was
in these tests, and with libgomp preloaded its start took 3-5 s longer on 2 cores.) A test that
needs other values of those starts its engine as a process of its own.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()

ZYGOTE_ENV = {"TORCHINDUCTOR_COMPILE_THREADS": "1", "TORCHINDUCTOR_CPP_DYNAMIC_THREADS": "1"}
"""What vLLM's CPU platform (`CpuPlatform.check_and_update_config`) sets for inductor before it
starts a process: read by torch when it is imported, so set before the zygote imports it."""


def _import_vllm() -> None:
    import vllm.envs
    import vllm.plugins
    from vllm import LLM, SamplingParams  # noqa: F401

    from vllm_ascend_chunk.config import get_config

    # What a child reads from its environment must not have been read here.
    assert not vllm.plugins.plugins_loaded, "the zygote loaded vLLM's plugins"
    assert get_config.cache_info().currsize == 0, "the zygote read the chunk cache's settings"
    assert not vllm.envs._is_envs_cache_enabled(), "the zygote froze vLLM's environment"


def _child(job: dict) -> None:
    """In the forked child: become the process `job` describes and run the engine."""
    os.setsid()
    os.environ.clear()
    os.environ.update(job["env"])
    os.chdir(job["cwd"])
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    for fd, path in ((1, job["stdout"]), (2, job["stderr"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    sys.argv = [str(HERE.with_name("engine_runner.py")), *job["args"]]
    code = 1
    try:
        from tests.helpers import engine_runner

        engine_runner.main()
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    raise SystemExit(code)  # the interpreter's exit: vLLM's and multiprocessing's exit hooks run


def serve() -> None:
    answers = os.fdopen(os.dup(1), "w")  # vLLM logs to stdout: that goes to stderr here
    os.dup2(2, 1)
    _import_vllm()
    for line in sys.stdin:
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:
            answers.close()
            _child(job)
        print(json.dumps({"pid": pid}), file=answers, flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"status": os.waitstatus_to_exitcode(status)}), file=answers, flush=True)


class Zygote:
    """The test process's side: starts the zygote on first use and runs engines through it."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._pending = b""
        self._log = Path(tempfile.mkdtemp(prefix="chunk-cache-zygote-")) / "zygote.log"

    def _started(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            self._pending = b""
            repo = str(HERE.parents[2])
            paths = (repo, os.environ.get("PYTHONPATH"))
            with self._log.open("a") as log:
                self._proc = subprocess.Popen(
                    [sys.executable, str(HERE)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=log,
                    text=True,
                    env={
                        **{k: v for k, v in os.environ.items() if k != "LD_PRELOAD"},
                        **ZYGOTE_ENV,
                        "PYTHONPATH": os.pathsep.join(p for p in paths if p),
                    },
                    start_new_session=True,
                )
        return self._proc

    def _answer(self, timeout: float) -> dict:
        """The zygote's next line (read from the pipe unbuffered: two may come at once)."""
        fd = self._proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._pending:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError
            data = os.read(fd, 4096)
            if not data:
                tail = self._log.read_text()[-3000:]
                raise RuntimeError(f"the engine zygote ended (status {self._proc.wait()}):\n{tail}")
            self._pending += data
        line, self._pending = self._pending.split(b"\n", 1)
        return json.loads(line)

    def run(self, args: list[str], env: dict[str, str], stdout: Path, stderr: Path, timeout: float) -> int:
        """Runs `engine_runner.py args...` as a child of the zygote; its exit status."""
        proc = self._started()
        job = {"args": args, "env": env, "cwd": os.getcwd(), "stdout": str(stdout), "stderr": str(stderr)}
        proc.stdin.write(json.dumps(job) + "\n")
        proc.stdin.flush()
        pid = self._answer(timeout)["pid"]
        try:
            return self._answer(timeout)["status"]
        except BaseException:  # timed out, or the test was interrupted: the engine goes too
            os.killpg(pid, signal.SIGKILL)
            self._answer(60)
            raise

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.stdin.close()
            self._proc.wait(timeout=60)


_zygote: Zygote | None = None


def zygote() -> Zygote:
    """This process's zygote (started on first use, ended at exit)."""
    global _zygote
    if _zygote is None:
        _zygote = Zygote()
        atexit.register(_zygote.close)
    return _zygote


if __name__ == "__main__":
    serve()
