"""Test processes only (tests/conftest.py puts this folder on PYTHONPATH): torch inductor's
vector-ISA probe, memoized across the processes of one test run.

Every CPU engine start compiles vLLM's sampler with inductor, which probes each vector ISA the
CPU lists by building a test library and loading it in a fresh `python -c "import torch ..."`;
three to five such probes cost ~15 s per process on 2 cores, and a test run starts dozens of
engines. The first process runs each probe for real and writes its answer under
CHUNK_CACHE_TEST_ISA_MEMO; later processes read it. Same machine, same compiler: same answers.
Nothing happens unless that variable is set, and nothing is imported until inductor's module is.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.util
import os
import sys
from pathlib import Path

MODULE = "torch._inductor.cpu_vec_isa"


def _memoize(module) -> None:
    memo = Path(os.environ["CHUNK_CACHE_TEST_ISA_MEMO"])
    probe = module.VecISA.check_build

    def check_build(self, code: str) -> bool:
        key = hashlib.sha256(f"{self._arch_flags}\0{code}".encode()).hexdigest()
        answer = memo / key
        if answer.exists():
            return answer.read_text() == "1"
        ok = probe(self, code)
        memo.mkdir(parents=True, exist_ok=True)
        scratch = memo / f"{key}.{os.getpid()}"
        scratch.write_text("1" if ok else "0")
        os.replace(scratch, answer)  # atomic: concurrent workers probe alike
        return ok

    module.VecISA.check_build = check_build


class _AfterImport(importlib.abc.MetaPathFinder):
    """Patches the module once it has been executed; the import itself is unchanged."""

    def find_spec(self, name, path, target=None):
        if name != MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        execute = spec.loader.exec_module

        def exec_module(module) -> None:
            execute(module)
            _memoize(module)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("CHUNK_CACHE_TEST_ISA_MEMO"):
    if MODULE in sys.modules:  # imported as `tests.helpers.site.sitecustomize` after torch's
        _memoize(sys.modules[MODULE])
    else:
        sys.meta_path.insert(0, _AfterImport())
