"""Diagnostics and launch sweeps (GPU unless stated): each script answers one question about a
kernel or a step and prints a log; not benchmarks of record (see ../README.md)."""
