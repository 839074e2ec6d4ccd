"""Host us per call of ``grouped_gemm.device_splits`` on CPU sizes: the old path (a copy, a
cumsum and a five-op device check) against the host path (one pinned copy). CUDA only."""

import time

import torch

from te_compile.functional.grouped_gemm import device_splits


def old(m_splits, inp):
    splits = m_splits.to(inp.device, non_blocking=True)
    offs = torch.cumsum(splits, 0, dtype=torch.int32)
    torch._assert_async((offs[-1] == inp.shape[0]) & (splits >= 0).all(), "bad")
    return splits, offs


x = torch.randn(128, 64, device="cuda", dtype=torch.bfloat16)
s = torch.tensor([16] * 8)
for name, fn in (("old device check", old), ("host path", device_splits)) * 2:
    for _ in range(200):
        fn(s, x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(2000):
        fn(s, x)
    torch.cuda.synchronize()
    print(f"{name}: {(time.perf_counter() - t) / 2000 * 1e6:.1f} us per call")
a, b = old(s, x), device_splits(s, x)
print("same values:", torch.equal(a[0].int(), b[0]), torch.equal(a[1], b[1]))
