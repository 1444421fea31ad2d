"""The tiny models and the HF reference forms: transformers forwards on the tiny models, no vLLM
engine."""
