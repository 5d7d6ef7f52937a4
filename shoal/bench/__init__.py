"""Benchmarks: shoal measured side by side with plain PyTorch in the same run."""
