"""The patch series on scratch trees (a copy of the installed vLLM, the pristine vllm-ascend sdist):
apply, check, revert, refusals, regeneration."""
