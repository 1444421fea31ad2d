"""Device ops: KV copy and rotary correction; torch reference plus per-backend kernels."""
