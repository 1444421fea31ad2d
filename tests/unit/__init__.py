"""No engine, no server, no model forward, no ops on tensors (`tests/kernels/`): the package's
logic and the pure parts of the benchmark and tool code, in seconds (`pytest tests/unit`)."""
