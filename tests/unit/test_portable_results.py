"""Benchmark results name no machine's directories (`serve_util.portable`), and the command each
records names a script that exists."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from harness.serve_util import REPO, portable


def test_paths_in_the_checkout_become_relative_and_other_absolute_ones_their_name(tmp_path: Path):
    existing = tmp_path / "data.json"
    existing.write_text("{}")
    assert portable(REPO / "benchmarks" / "bench_rag.py") == "benchmarks/bench_rag.py"
    command = f"python {REPO}/benchmarks/bench_rag.py --data {existing} --out {tmp_path}/new/result.json"
    assert portable(command) == "python benchmarks/bench_rag.py --data data.json --out result.json"
    assert portable("--model .models/bench-llama --max-model-len 4096") == (
        "--model .models/bench-llama --max-model-len 4096"
    )


def _strings(value):
    if isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)
    elif isinstance(value, str):
        yield value


@pytest.mark.parametrize("result", sorted((REPO / "results").glob("*/*.json")), ids=lambda p: p.name)
def test_committed_results_hold_no_absolute_paths(result: Path):
    absolute = [
        word
        for text in _strings(json.loads(result.read_text()))
        for word in re.split(r"[\s=]+", text)
        if re.match(r"/\w", word) and not re.match(API_PATH, word)
    ]
    assert not absolute, absolute[:5]


API_PATH = r"/(v1/|health\b|metrics\b|reset_prefix_cache\b)"
"""The server's HTTP paths (a fuzz report names the endpoint of each failing case): not directories."""


def recorded_commands() -> list[tuple[str, str]]:
    """(result file, the command it records) of every committed result that records one."""
    results = sorted((REPO / "results").glob("*/*.json"))
    commands = [(p.name, json.loads(p.read_text()).get("command")) for p in results]
    return [(name, command) for name, command in commands if isinstance(command, str)]


@pytest.mark.parametrize("name, command", recorded_commands(), ids=[n for n, _ in recorded_commands()])
def test_the_recorded_command_names_a_script_that_exists(name: str, command: str):
    words = shlex.split(command)
    if f'"{words[0]} = ' in (REPO / "setup.py").read_text():  # a console script of the package
        return
    if "-m" in words:
        program = words[words.index("-m") + 1].replace(".", "/") + ".py"
    else:
        program = next((w for w in words if w.endswith((".py", ".sh"))), "")
    assert program and (REPO / program).is_file(), f"{name}: {command}"


def test_the_results_index_lists_every_committed_result():
    index = (REPO / "results" / "README.md").read_text()
    files = [
        p for p in (REPO / "results").glob("*/*") if p.suffix != ".png" or not p.with_suffix(".json").exists()
    ]
    missing = [f"{p.parent.name}/{p.name}" for p in files if f"`{p.name}`" not in index]
    assert not missing, f"results/README.md does not list {missing}"
