"""A real `vllm serve` process and the `openai` client (most tests also compare with the shared
offline engine)."""
