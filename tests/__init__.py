"""The test suite, by what a test starts: `unit/` and `kernels/` (no engine, seconds), `models/`
(transformers forwards), `patches/` (the patch series on scratch trees), `engine/` (offline
engines), `server/` (`vllm serve`); shared fixtures in `conftest.py`, shared code in `helpers/`."""
