"""Device code only: Triton kernels and their launch wrappers (no torch.library here)."""
