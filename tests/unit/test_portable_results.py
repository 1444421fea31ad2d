"""Benchmark results name no machine's directories (`serve_util.portable`)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks.serve_util import REPO, portable


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


@pytest.mark.parametrize("result", sorted((REPO / "benchmarks").glob("*.json")), ids=lambda p: p.name)
def test_committed_results_hold_no_absolute_paths(result: Path):
    absolute = [
        word
        for text in _strings(json.loads(result.read_text()))
        for word in re.split(r"[\s=]+", text)
        if re.match(r"/\w", word)
    ]
    assert not absolute, absolute[:5]
