"""Tiny random checkpoints and tokenizer for tests, `tinyserve demo` and benchmarks."""
