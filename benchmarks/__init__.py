"""The benchmark and workload code, next to its committed results (`*.json`, `*.png`).

Run from the repository root as modules, e.g. `python -m benchmarks.bench_rag --help`.
"""
