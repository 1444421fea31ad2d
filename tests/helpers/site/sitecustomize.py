"""Test processes only (tests/conftest.py puts this folder on PYTHONPATH): two of torch
inductor's costs of an engine start, paid once instead of in every engine process.

1. The vector-ISA probe. Every CPU engine start compiles vLLM's sampler with inductor, which
   probes each vector ISA the CPU lists by building a test library and loading it in a fresh
   `python -c "import torch ..."`; three to five such probes cost ~15 s per process on 2 cores,
   and a test run starts dozens of engines. The first process runs each probe for real and writes
   its answer under CHUNK_CACHE_TEST_ISA_MEMO; later processes read it. Same machine, same
   compiler: same answers.
2. The kernel cache. vLLM points inductor's cache (TORCHINDUCTOR_CACHE_DIR) at a folder of its
   own per compilation hash, and that hash changes with any engine setting (model path,
   max_model_len, parallelism...), so each new engine configuration compiled every kernel again
   from nothing: an engine start of ~33 s on 2 cores (AVX2) where a graph seen before takes ~8 s,
   and a run starts ~30 configurations. Under CHUNK_CACHE_TEST_INDUCTOR_CACHE every process uses
   that one folder:
   inductor's cache is keyed by the graph, its inputs, the compiler and torch's settings, so
   configurations that compile the same graph share its kernels (torch's own default is one
   folder per user).

Nothing happens unless those variables are set, and nothing is imported until inductor's
modules are.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

ISA_MODULE = "torch._inductor.cpu_vec_isa"
CACHE_MODULE = "torch._inductor.runtime.cache_dir_utils"


def _memoize(module: ModuleType) -> None:
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


def _share_cache(module: ModuleType) -> None:
    shared = os.environ["CHUNK_CACHE_TEST_INDUCTOR_CACHE"]
    original = module.cache_dir

    def cache_dir() -> str:
        """The shared folder, whatever vLLM wrote to TORCHINDUCTOR_CACHE_DIR."""
        os.makedirs(shared, exist_ok=True)
        return shared

    # Torch's modules already loaded (the pytest process may have imported them) hold it by name.
    for name, loaded in list(sys.modules.items()):
        torch_module = loaded is not None and (name == "torch" or name.startswith("torch."))
        if torch_module and vars(loaded).get("cache_dir") is original:
            loaded.cache_dir = cache_dir


class _AfterImport(importlib.abc.MetaPathFinder):
    """Patches a module once it has been executed, before anything imports names from it; the
    import itself is unchanged."""

    def __init__(self, name: str, patch: Callable[[ModuleType], None]) -> None:
        self.name, self.patch = name, patch

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        execute = spec.loader.exec_module

        def exec_module(module) -> None:
            execute(module)
            self.patch(module)

        spec.loader.exec_module = exec_module
        return spec


def _install(variable: str, name: str, patch: Callable[[ModuleType], None]) -> None:
    if not os.environ.get(variable):
        return
    if name in sys.modules:  # imported as `tests.helpers.site.sitecustomize` after torch's
        patch(sys.modules[name])
    else:
        sys.meta_path.insert(0, _AfterImport(name, patch))


_install("CHUNK_CACHE_TEST_ISA_MEMO", ISA_MODULE, _memoize)
_install("CHUNK_CACHE_TEST_INDUCTOR_CACHE", CACHE_MODULE, _share_cache)
