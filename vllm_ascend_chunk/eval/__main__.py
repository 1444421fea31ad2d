"""`python -m vllm_ascend_chunk.eval`: the `vllm-chunk-cache-eval` command."""

from vllm_ascend_chunk.eval.cli import main

raise SystemExit(main())
