"""The ops (`vllm_ascend_chunk/ops/`) on tensors, no engine: KV read-back per backend, the rotary
correction against vLLM's rotary embeddings, the Triton KV load (under the interpreter on CPU, on
the device with CUDA), the NPU ops on CPU tensors in the NPU layout and the NPU self-check."""
