"""Code only the tests share (what benchmarks and tools share with them is in `harness/`): the
engine processes and the test client (`engine_runner`, `server_utils`), the coordinator's
invariants, a test-only tier, the patch-series helpers; `REPO` here."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
"""The repository root."""
