"""Real patched vLLM engines offline: the shared in-process `LLM` (`tiny_llama_llm`) and engines in
their own processes (`helpers.engine_runner.run_engine`)."""
