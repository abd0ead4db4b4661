"""Benchmark harnesses: step time of data-parallel variants, measured side by side."""
