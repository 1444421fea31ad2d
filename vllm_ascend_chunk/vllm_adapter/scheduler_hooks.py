"""Entry points for the vLLM patch on the scheduler (`vllm.v1.core.sched.scheduler`).

The scheduler side's vLLM adapter is `vllm_scheduler` (subclasses); this module is the one line
the patch adds where a subclass cannot reach: how many tokens a request may compute this step.
It imports nothing from vLLM, so vLLM's scheduler module can import it.
"""

from __future__ import annotations


def cap_new_tokens(scheduler, request, num_new_tokens: int, num_computed_tokens: int) -> int:
    """`Scheduler.schedule`, where a running or waiting request's new tokens are counted: a
    `qattn` request computes its passes piece by piece (`scheduler/selection.py`)."""
    cap = getattr(scheduler, "chunk_token_cap", None)
    return num_new_tokens if cap is None else cap(request, num_new_tokens, num_computed_tokens)
