"""Tiny checkpoint factory for tests, `tinyserve demo` and benchmarks."""
