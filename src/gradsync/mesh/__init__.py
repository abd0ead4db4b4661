"""Data parallelism inside a device mesh: which ranks sync, and DTensor parameters."""
