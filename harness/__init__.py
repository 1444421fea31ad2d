"""What the tests, the benchmarks and the tools share: a `vllm serve` process (`serve_util`), a
loopback Mooncake Store and its faults (`mooncake_store`, `store_faults`), the RAG workload
(`rag_workload`), the independent HF references (`hf_reference`, `hf_recovery`), the chunked
test cases with their expectations (`chunk_cases`) and where a result came from (`machine`).
It imports none of `tests`, `benchmarks` or `tools`."""
