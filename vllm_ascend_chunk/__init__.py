"""Chunk Cache for vLLM(-Ascend): reuse the KV cache of RAG documents wherever they appear.

The package is imported by thin patches in vLLM (see `patches/README.md`) and registered as a
`vllm.general_plugins` entry point. Modules follow the data flow: `config` (environment),
`metadata` (what a request carries from the frontend into the engine core), `plugin`.
"""

__version__ = "0.1.0"
