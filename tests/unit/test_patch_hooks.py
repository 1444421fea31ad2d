"""The patch series reaches the package through one module, `vllm_adapter.hooks`, and calls only
hooks it has."""

import re

from tests.helpers import REPO
from vllm_ascend_chunk.vllm_adapter import hooks

ADDED = [
    line[1:]
    for patch in sorted((REPO / "patches").glob("*/*.patch"))
    for line in patch.read_text().splitlines()
    if line.startswith("+") and not line.startswith("+++")
]


def test_every_patch_imports_only_the_hooks_module():
    imports = {line.strip() for line in ADDED if "vllm_ascend_chunk" in line}
    allowed = re.compile(
        r"from vllm_ascend_chunk\.vllm_adapter(?: import hooks as chunk_hooks|\.hooks import \w+)$"
    )
    assert imports and all(allowed.match(line) for line in imports), imports


def test_every_hook_a_patch_calls_exists_and_resolves():
    names = {name for line in ADDED for name in re.findall(r"\bchunk_hooks\.(\w+)", line)}
    assert names
    for name in names:
        hook = getattr(hooks, name)
        assert callable(hook), name
        if hook.__doc__ and hook.__doc__.startswith("`vllm_ascend_chunk."):
            module, _, attr = hook.__doc__.strip("`").rpartition(".")
            __import__(module)
            assert callable(getattr(__import__(module, fromlist=[attr]), attr)), name


def test_every_runtime_replacement_in_the_package_is_listed_for_check():
    """What the package replaces on vLLM's objects while an engine runs, outside the series
    (an assignment to a `forward`), is listed in patches/runtime-hooks.txt, which `--check` prints."""
    listed = {
        line.split(" | ")[0]
        for line in (REPO / "patches" / "runtime-hooks.txt").read_text().splitlines()
        if line and not line.startswith("#")
    }
    replacing = {
        str(path.relative_to(REPO))
        for path in (REPO / "vllm_ascend_chunk").rglob("*.py")
        if re.search(r"^\s*[\w.]+\.forward\s*=", path.read_text(), re.M)
    }
    assert replacing and listed == replacing
