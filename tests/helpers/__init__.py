"""Code the tests share: workloads and their independent expectations (`chunk_cases`, the HF
references), the engine and server processes (`engine_runner`, `server_utils`), the coordinator's
invariants and the patch-series helpers."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
"""The repository root."""
