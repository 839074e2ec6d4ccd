"""Benchmarks: te_compile vs PyTorch eager, torch.compile and peers (see README.md)."""
