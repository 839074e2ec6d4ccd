"""Which GEMM of LayerNormMLP differs between FP8 primary weights and the high-precision module
under current scaling, run as tests/modules/test_fp8_primary_weights.py's bits-equal test runs
it (both forwards in one autocast, the FP8 module first).

    PYTHONPATH=. python bench/diag/diag_primary_bits.py [cuda|cpu]
"""

import sys

import torch

import te_compile as te
from te_compile.quantization import Float8CurrentScaling, autocast
from tests.modules.test_fp8_primary_weights import _build, _fp8_names, _primary, _x

LOG = []
_orig = torch._scaled_mm


def _spy(a, b, *args, **kw):
    out = _orig(a, b, *args, **kw)
    LOG.append((tuple(a.shape), a.stride(), tuple(b.shape), b.stride(), out.clone()))
    return out


torch._scaled_mm = _spy
dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"
recipe = Float8CurrentScaling()
hp = _build("LayerNormMLP", dev, fuse_wgrad_accumulation=True)
m = _primary("LayerNormMLP", dev, recipe)
te.FP8MasterWeights(m)
for n in _fp8_names(m):
    getattr(hp, n).main_grad = torch.zeros(getattr(hp, n).shape, device=dev)
x = _x(dev).requires_grad_()
x0 = x.detach().clone().requires_grad_()
with autocast(recipe=recipe):
    y = m(x)
    n_fwd = len(LOG)
    y0 = hp(x0)
g = torch.randn_like(y)
y.backward(g)
n_bwd = len(LOG)
y0.backward(g)
a_calls = LOG[:n_fwd] + LOG[2 * n_fwd : n_bwd]
b_calls = LOG[n_fwd : 2 * n_fwd] + LOG[n_bwd:]
print("calls", n_fwd, n_bwd, len(LOG))
for i, (a, b) in enumerate(zip(a_calls, b_calls, strict=True)):
    d = (a[-1].float() - b[-1].float()).abs().max().item()
    print(
        f"gemm {i}: equal={torch.equal(a[-1], b[-1])} maxdiff={d:.3g} primary={a[:-1]} hp={b[:-1]}"
    )
for (n, p), p0 in zip(m.named_parameters(), hp.parameters(), strict=True):
    if p.grad is not None:
        print(
            n, torch.equal(p.grad, p0.grad), (p.grad.float() - p0.grad.float()).abs().max().item()
        )
for n in _fp8_names(m):
    print(n, "main_grad", torch.equal(getattr(m, n).main_grad, getattr(hp, n).main_grad))
