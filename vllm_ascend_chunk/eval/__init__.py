"""`vllm-chunk-cache-eval`: what plain reuse and each recovery mode cost in answers, measured on
the user's own model and data against a running, patched `vllm serve` ([docs/results/quality.md]).

A client: it imports neither vLLM nor torch and needs nothing beyond the standard library
(matplotlib, if installed, for the plot). Modules: `samples` (the JSONL / MuSiQue / built-in
question sets and the prompt's text parts), `client` (the HTTP calls and what the server is:
reachable, serving the model, patched, chunk cache on), `measure` (one sample's requests),
`scores` (agreement, F1, contains, intervals), `report` (summary, recommendation, table, JSON,
PNG), `cli` (arguments, progress, resume).
"""
