"""The remote KV tier: the stored object format, and the Mooncake Store client against real
Mooncake processes."""
