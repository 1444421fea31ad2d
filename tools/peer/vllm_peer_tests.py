#!/usr/bin/env python3
"""vLLM's own tests as a peer suite: pristine vLLM, patched with the chunk cache off, and on.

    python -m tools.peer.vllm_peer_tests [--out DIR] [--modes pristine off on] [--groups core ...]
    python -m tools.peer.vllm_peer_tests --report DIR      # diff the junit files of an earlier run

The tests of the pinned vLLM come from its PyPI sdist (downloaded once, unpacked into the user
cache folder, `~/.cache/vllm-ascend-chunk/`); the few test-only packages they import go into a
folder there too (`--target`, so the project's environment is unchanged). The groups run are
those of the vLLM parts the patch series touches and that need no model download.

- `pristine`: a shadow of the installed `vllm/` (symlinks, the files the series touches copied
  and reverted with `apply_patches.sh --revert --target`) first on PYTHONPATH; the installed,
  patched vLLM is never modified;
- `off`: the installed, patched vLLM with `VLLM_ENABLE_CHUNK_CACHE=false`;
- `on`: the same with `VLLM_ENABLE_CHUNK_CACHE=true` and a set pool size
  (`VLLM_CHUNK_CACHE_SIZE_GB`, `ON_POOL_GB` unless set): many tests build vLLM's `Scheduler` or a
  connector straight from a `VllmConfig`, with no engine core to size an automatic pool.

Offline (the default), the hub models the tests name are local stand-ins (`tools.peer.models`:
config.json only, in an `HF_HOME` of the cache folder), so the tests that build a `ModelConfig`
reach the chunk cache. A plugin (`tools.peer.activation`) records in which tests the chunk cache
was configured on or refused; a run in which "on" turned it on nowhere, or "pristine" or "off"
turned it on anywhere, fails (exit status 1): it would prove nothing.

Writes per mode and group a junit file, a log and the activation record, `results.json` (every
test's outcome per mode, the differences, the activations) and `summary.txt`, and prints the
summary.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from tools.peer import activation as peer_activation
from tools.peer import models as peer_models

REPO = Path(__file__).resolve().parents[2]
APPLY = REPO / "scripts" / "apply_patches.sh"
VERSION = (REPO / "patches" / "vllm" / "TARGET_VERSION").read_text().strip()
MODES = ("pristine", "off", "on")
ON_POOL_GB = "0.05"
"""The pool size of the `on` mode (a page of every stand-in model fits)."""
GROUPS = {
    "core": ["tests/v1/core"],  # kv_cache_utils (0010), request (0002), scheduler (0020)
    "kv_connector": ["tests/v1/kv_connector/unit"],  # connector selection and HMA (0008)
    "renderers": ["tests/renderers"],  # per-part tokenization (0006)
    "config": [
        "tests/engine/test_arg_utils.py",
        "tests/v1/engine/test_engine_args.py",
        "tests/test_config.py",
    ],  # VllmConfig post-init (0008)
    "requests": [
        "tests/test_inputs.py",
        "tests/v1/test_request.py",
        "tests/v1/test_serial_utils.py",
    ],  # EngineCoreRequest, preprocessing (0001, 0005)
}
# Imported by vLLM's tests but not by vLLM (versions of its requirements/test, or close to them).
TEST_TOOLS = ["tblib==3.1.0", "pytest-asyncio>=1.2", "pytest-mock>=3.14", "ray==2.48.0", "msgpack"]
SDIST_PARTS = ("tests/", "examples/", "pyproject.toml")


OUTCOMES = ("passed", "failed", "error", "skipped")


@dataclass(frozen=True)
class Outcome:
    outcome: str  # passed, failed, error, skipped
    message: str = ""


# -- pure parts: junit parsing, diffing, summary ---------------------------------------------
def parse_junit(xml_text: str) -> dict[str, Outcome]:
    """Outcome of every test case of a pytest junit report, by `classname::name`."""
    results: dict[str, Outcome] = {}
    for case in ET.fromstring(xml_text).iter("testcase"):
        test_id = f"{case.get('classname', '')}::{case.get('name', '')}".lstrip(":")
        outcome, message = "passed", ""
        for tag in ("skipped", "error", "failure"):  # the last found wins: failure > error
            if (child := case.find(tag)) is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                message = child.get("message") or (child.text or "")
        previous = results.get(test_id)
        if previous is None or previous.outcome in ("passed", "skipped"):
            results[test_id] = Outcome(outcome, message)  # a teardown error keeps the failure
    return results


def signature(message: str, width: int = 160) -> str:
    """A failure message reduced to what groups alike failures: first line, no numbers."""
    first = next((line.strip() for line in message.splitlines() if line.strip()), "")
    first = re.sub(r"0x[0-9a-fA-F]+|\d+", "N", first)
    return first[:width]


def differences(results: dict[str, dict[str, Outcome]], base: str, other: str) -> list[dict]:
    """Tests whose outcome differs between two modes (a test missing in one is `absent`)."""
    absent = Outcome("absent")
    diffs = []
    for test_id in sorted(set(results[base]) | set(results[other])):
        a, b = results[base].get(test_id, absent), results[other].get(test_id, absent)
        if a.outcome != b.outcome:
            diffs.append(
                {
                    "test": test_id,
                    base: a.outcome,
                    other: b.outcome,
                    "message": b.message if b.outcome in ("failed", "error") else a.message,
                }
            )
    return diffs


def summary(results: dict[str, dict[str, Outcome]], pairs: list[tuple[str, str]]) -> str:
    lines = [f"vLLM {VERSION} peer tests"]
    for mode, tests in results.items():
        counts = Counter(o.outcome for o in tests.values())
        lines.append(f"  {mode:9s} " + ", ".join(f"{counts[k]} {k}" for k in OUTCOMES if counts[k]))
    for base, other in pairs:
        diffs = differences(results, base, other)
        lines.append(f"\n{base} -> {other}: {len(diffs)} tests differ")
        moves = Counter((d[base], d[other]) for d in diffs)
        for (a, b), n in moves.most_common():
            lines.append(f"  {n:5d}  {a} -> {b}")
        reasons = Counter((d[base], d[other], signature(d["message"])) for d in diffs)
        if reasons:
            lines.append("  by message:")
        for (a, b, why), n in reasons.most_common():
            lines.append(f"  {n:5d}  {a} -> {b}: {why}")
    return "\n".join(lines)


def activation_problems(activations: dict[str, dict[str, list[str]]]) -> list[str]:
    """Why the activation records disprove the run: "on" never on, or another mode on."""
    problems = []
    for mode, record in activations.items():
        touched = len(record["active"]) + len(record["refused"])
        if mode == "on" and not record["active"]:
            problems.append("mode on: the chunk cache was configured on in no test")
        elif mode != "on" and touched:
            problems.append(f"mode {mode}: the chunk cache was configured on or refused in {touched} tests")
    return problems


def read_activations(out: Path, mode: str) -> dict[str, list[str]]:
    record: dict[str, list[str]] = {"active": [], "refused": []}
    for path in sorted(out.glob(f"{mode}-*.activation.json")):
        for key, tests in json.loads(path.read_text()).items():
            record[key] += tests
    return record


def report(out: Path, modes: list[str]) -> str:
    """Read the junit and activation files under `out`, write `results.json` and `summary.txt`."""
    results: dict[str, dict[str, Outcome]] = {}
    activations = {mode: read_activations(out, mode) for mode in modes}
    for mode in modes:
        results[mode] = {}
        for junit in sorted(out.glob(f"{mode}-*.xml")):
            results[mode].update(parse_junit(junit.read_text()))
    pairs = [
        (a, b)
        for a, b in (("pristine", "off"), ("off", "on"), ("pristine", "on"))
        if a in results and b in results
    ]
    text = summary(results, pairs)
    text += "\n\nchunk cache configured (tests where it was on / refused at start-up):\n" + "\n".join(
        f"  {mode:9s} {len(r['active'])} on, {len(r['refused'])} refused" for mode, r in activations.items()
    )
    text += "".join(f"\nFAILED: {problem}" for problem in activation_problems(activations))
    (out / "results.json").write_text(
        json.dumps(
            {
                "vllm": VERSION,
                "outcomes": {m: {t: asdict(o) for t, o in r.items()} for m, r in results.items()},
                "differences": {f"{a}->{b}": differences(results, a, b) for a, b in pairs},
                "activations": activations,
            },
            indent=1,
        )
    )
    (out / "summary.txt").write_text(text + "\n")
    return text


# -- the sdist, the test tools and the pristine shadow ---------------------------------------
def cache_dir() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vllm-ascend-chunk"
    root.mkdir(parents=True, exist_ok=True)
    return root


def pip(python: str, *args: str, env: dict | None = None) -> None:
    subprocess.run(
        [python, "-m", "pip", "--disable-pip-version-check", "--quiet", *args], check=True, env=env
    )


def fetch_sdist(python: str, cache: Path) -> Path:
    """The pinned vLLM sdist. pip prepares its metadata even to download it: vLLM's setup.py
    then needs setuptools-rust and setuptools-scm, no compiler with VLLM_TARGET_DEVICE=empty,
    and its version pinned (the `empty` target would append `+empty`)."""
    sdist = cache / f"vllm-{VERSION}.tar.gz"
    if sdist.exists():
        return sdist
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        tools = Path(tmp) / "tools"
        pip(python, "install", "--target", str(tools), "setuptools-rust", "setuptools-scm>=8")
        env = {
            **os.environ,
            "PYTHONPATH": str(tools),
            "VLLM_TARGET_DEVICE": "empty",
            "VLLM_VERSION_OVERRIDE": VERSION,
        }
        pip(
            python,
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            "--no-build-isolation",
            f"vllm=={VERSION}",
            "-d",
            tmp,
            env=env,
        )
        os.replace(Path(tmp) / sdist.name, sdist)
    return sdist


def vllm_tests(python: str, cache: Path) -> Path:
    """The sdist's tests/, examples/ (chat templates) and pyproject.toml (pytest markers)."""
    root = cache / f"vllm-{VERSION}-tests"
    if (root / "tests" / "conftest.py").exists():
        return root
    sdist = fetch_sdist(python, cache)
    with tempfile.TemporaryDirectory(dir=cache) as tmp, tarfile.open(sdist) as tar:
        top = f"vllm-{VERSION}/"
        members = [m for m in tar.getmembers() if m.name.removeprefix(top).startswith(SDIST_PARTS)]
        tar.extractall(tmp, members=members, filter="data")
        shutil.rmtree(root, ignore_errors=True)
        os.replace(Path(tmp) / top, root)
    return root


PLUGIN = "chunk_cache_peer_activation"
"""The plugin's module name in the test-tools folder (this repository's `tests` package would
shadow vLLM's if the repository were on the path)."""


def test_tools(python: str, cache: Path) -> Path:
    tools = cache / f"vllm-{VERSION}-test-tools"
    if not (tools / "tblib").exists():
        pip(python, "install", "--no-deps", "--target", str(tools), *TEST_TOOLS)
    shutil.copy(peer_activation.__file__, tools / f"{PLUGIN}.py")
    return tools


def installed_site(python: str) -> Path:
    code = (
        "import importlib.util, os; s = importlib.util.find_spec('vllm'); "
        "print(os.path.dirname(list(s.submodule_search_locations)[0]))"
    )
    return Path(
        subprocess.run([python, "-c", code], check=True, capture_output=True, text=True).stdout.strip()
    )


def series_files() -> list[str]:
    return sorted(
        {
            f
            for p in (REPO / "patches" / "vllm").glob("[0-9]*.patch")
            for f in re.findall(r"^\+\+\+ b/(\S+)", p.read_text(), flags=re.M)
        }
    )


def pristine_shadow(python: str, into: Path) -> Path:
    """`into/vllm`: the installed vLLM as symlinks, the series' files copied and reverted."""
    site = installed_site(python)
    shutil.copytree(
        site / "vllm",
        into / "vllm",
        symlinks=True,
        copy_function=os.symlink,
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    for rel in series_files():
        (into / rel).unlink()
        shutil.copy2(site / rel, into / rel)
    subprocess.run(
        [str(APPLY), "--revert", "--target", str(into)], check=True, capture_output=True, text=True
    )
    check = subprocess.run([str(APPLY), "--check", "--target", str(into)], capture_output=True, text=True)
    if any(line.split()[:1] == ["applied"] for line in check.stdout.splitlines()):
        raise RuntimeError(f"the shadow tree is still patched:\n{check.stdout}")
    return into


# -- running ---------------------------------------------------------------------------------
def run_group(
    python: str, root: Path, paths: list[str], env: dict, junit: Path, log: Path, timeout: int
) -> int:
    cmd = [
        python,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "-c",
        str(root / "pyproject.toml"),
        "--rootdir",
        str(root),
        "--continue-on-collection-errors",
        "-q",
        "-rN",
        f"--timeout={timeout}",
        "-p",
        PLUGIN,
        f"--junitxml={junit}",
        *paths,
    ]
    env = {**env, peer_activation.ENV: str(junit.with_suffix(".activation.json"))}
    with log.open("w") as out:
        return subprocess.run(cmd, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT).returncode


def mode_env(mode: str, tools: Path, shadow: Path | None, hf_home: Path | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    path = [str(tools)] if mode != "pristine" else [str(shadow), str(tools)]
    env["PYTHONPATH"] = os.pathsep.join(path)
    env["VLLM_ENABLE_CHUNK_CACHE"] = "false" if mode == "off" else "true"
    if mode == "on":
        env.setdefault("VLLM_CHUNK_CACHE_SIZE_GB", ON_POOL_GB)
    if hf_home is not None:  # the local stand-ins; other downloads fail at once, in every mode
        env.update(HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return env


def check_imports(python: str, env: dict, mode: str) -> None:
    """The mode's interpreter imports the vLLM it should: the shadow's unpatched, else patched."""
    code = "import inspect, vllm.v1.request as r; print('chunk_cache' in inspect.getsource(r))"
    out = subprocess.run([python, "-c", code], env=env, check=True, capture_output=True, text=True).stdout
    patched = out.split()[-1] == "True"  # vLLM may log to stdout first
    if patched == (mode == "pristine"):
        raise RuntimeError(f"mode {mode}: imports a {'patched' if patched else 'pristine'} vLLM")


def run_all(args: argparse.Namespace) -> None:
    cache = cache_dir()
    root, tools = vllm_tests(args.python, cache), test_tools(args.python, cache)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        shadow = pristine_shadow(args.python, Path(tmp)) if "pristine" in args.modes else None
        hf_home = None if args.online else peer_models.write_cache(cache / "peer-models")
        envs = {mode: mode_env(mode, tools, shadow, hf_home) for mode in args.modes}
        for mode, env in envs.items():
            check_imports(args.python, env, mode)
        for group in args.groups:  # every mode of a group before the next: partial runs compare
            for mode, env in envs.items():
                junit, log = args.out / f"{mode}-{group}.xml", args.out / f"{mode}-{group}.log"
                rc = run_group(args.python, root, GROUPS[group], env, junit, log, args.timeout)
                print(f"{mode:9s} {group:13s} exit {rc}  ({log})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", default=sys.executable, help="interpreter of the patched vLLM")
    parser.add_argument("--out", type=Path, default=Path("vllm-peer-tests"))
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--groups", nargs="+", choices=list(GROUPS), default=list(GROUPS))
    parser.add_argument("--timeout", type=int, default=300, help="seconds per test")
    parser.add_argument("--online", action="store_true", help="let tests reach the model hub")
    parser.add_argument("--report", type=Path, help="only diff the junit files of this folder")
    args = parser.parse_args()
    if args.report is None:
        run_all(args)
    out = args.report or args.out
    text = report(out, [m for m in args.modes if any(out.glob(f"{m}-*.xml"))])
    print(text)
    if "\nFAILED: " in text:
        sys.exit(1)


if __name__ == "__main__":
    main()
