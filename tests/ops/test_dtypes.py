"""Dtypes through ``te_compile.ops`` linears, as in Transformer Engine: an input whose dtype is
not the parameters' is cast to it (the output has the parameters' dtype, the input's gradient
the input's own), and under ``torch.autocast`` the output has autocast's dtype while the
gradients keep the parameters' and the input's. Values against float64 references of the
operands the GEMM sees, eager and compiled (one frame)."""

from __future__ import annotations

import pytest
import torch

from te_compile import ops
from tests.utils import (
    DEVICES,
    assert_close,
    chain_roundings,
    compile_counted,
    make_reference_and_test_tensors,
    to_reference,
)

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _coarser(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """The less precise of two dtypes (bfloat16 below float16 below float32)."""
    return max((a, b), key=lambda d: torch.finfo(d).eps)


def _run(module, compiled, *args):
    if not compiled:
        return module(*args)
    run, counter = compile_counted(module, backend="aot_eager")
    out = run(*args)
    assert counter.frame_count == 1
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize(
    "in_dtype,param_dtype", [(a, b) for a in _FLOATS for b in _FLOATS if a != b]
)
def test_linear_casts_input_to_parameter_dtype(device, compiled, fused, in_dtype, param_dtype):
    torch.manual_seed(0)
    linear = ops.Linear(16, 12, device=device, dtype=param_dtype)
    with torch.no_grad():
        linear.bias.normal_()
    # Alone (one GEMM with the bias in its epilogue) or in a fused linear + bias + GELU.
    module = ops.Sequential(linear, ops.GELU()) if fused else linear
    x_ref, x = make_reference_and_test_tensors((5, 16), dtype=in_dtype, device=device)
    w_ref, b_ref = to_reference(linear.weight), to_reference(linear.bias)
    y = _run(module, compiled, x)
    assert y.dtype == param_dtype
    # The GEMM sees the input rounded to the parameters' dtype.
    xc_ref = x_ref.to(param_dtype).to(torch.float64)
    y_ref = xc_ref @ w_ref.T + b_ref
    if fused:
        y_ref = torch.nn.functional.gelu(y_ref, approximate="tanh")  # TE's GELU
    assert_close(y, y_ref, param_dtype, roundings=chain_roundings(param_dtype, 2))
    dy = torch.randn_like(y_ref)
    y.backward(dy.to(device=device, dtype=y.dtype))
    y_ref.backward(dy)
    assert x.grad.dtype == in_dtype
    assert linear.weight.grad.dtype == param_dtype
    tol = _coarser(in_dtype, param_dtype)
    assert_close(x.grad, x_ref.grad, tol, reduced=True, roundings=chain_roundings(tol, 3))
    assert_close(linear.weight.grad, w_ref.grad, param_dtype, reduced=True,
                 roundings=chain_roundings(param_dtype, 3))  # fmt: skip


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16])
def test_linear_output_has_torch_autocast_dtype(compiled, bias, model_dtype, autocast_dtype):
    # CPU autocast: it takes bfloat16 and float16 (CUDA's also float32, the same rule).
    torch.manual_seed(0)
    linear = ops.Linear(16, 12, bias=bias, dtype=model_dtype)
    x_ref, x = make_reference_and_test_tensors((5, 16), dtype=model_dtype)
    params = [p for p in linear.parameters()]
    refs = [to_reference(p) for p in params]

    def step(inp):
        with torch.autocast("cpu", dtype=autocast_dtype):
            return linear(inp)

    y = _run(step, compiled, x)
    assert y.dtype == autocast_dtype
    # Autocast rounds the input and the parameters to its dtype.
    rounded = [r.to(autocast_dtype).to(torch.float64) for r in (x_ref, *refs)]
    y_ref = rounded[0] @ rounded[1].T + (rounded[2] if bias else 0)
    assert_close(y, y_ref, autocast_dtype)
    dy = torch.randn_like(y_ref)
    y.backward(dy.to(y.dtype))
    y_ref.backward(dy)
    assert x.grad.dtype == model_dtype
    assert all(p.grad.dtype == model_dtype for p in params)
    assert_close(x.grad, x_ref.grad, autocast_dtype, reduced=True,
                 roundings=chain_roundings(autocast_dtype, 2))  # fmt: skip
    for p, r in zip(params, refs, strict=True):
        assert_close(p.grad, r.grad, autocast_dtype, reduced=True,
                     roundings=chain_roundings(autocast_dtype, 2))  # fmt: skip
