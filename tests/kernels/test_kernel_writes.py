"""What Inductor believes our kernels write.

Under ``torch.compile`` a traced-through op's kernels are recorded with
``torch.library.wrap_triton``, and functionalisation takes the tensors a kernel writes from
PyTorch's static analysis of the kernel's Triton IR. A pointer the analysis cannot separate
from a written one counts as written: a store address built from a value that a ``@triton.jit``
helper returned counts every pointer passed to that helper. Functionalisation then copies the
"result" back into the input: into a parameter (``a leaf Variable that requires grad is being
used in an in-place operation``) or, worse, silently into a tensor the caller still reads.

Each case calls a launch wrapper of ``te_compile.kernels`` on CPU tensors with the kernels not
run but analysed (for an sm_90 target, so no GPU is needed) and asserts that no kernel is
believed to write a tensor the wrapper was given (the delayed-scaling update, which is meant to
write its state, excepted by name).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") == "1":  # the interpreter has no IR to analyse
    pytest.skip("the kernels' IR is analysed without the interpreter", allow_module_level=True)

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402

from te_compile.kernels import act_quantize as act_q  # noqa: E402
from te_compile.kernels import (  # noqa: E402
    activation,
    dropout,
    moe,
    norm,
    quantize,
    quantize_mx,
    quantize_rows,
    rotary,
)

KERNEL_MODULES = (
    act_q,
    activation,
    dropout,
    moe,
    norm,
    quantize,
    quantize_mx,
    quantize_rows,
    rotary,
)
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
BF16 = torch.bfloat16


class _Sm90:
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


def _writes(kernel, args: tuple, kwargs: dict) -> dict[str, torch.Tensor]:
    """The tensors PyTorch's analysis says ``kernel(*args, **kwargs)`` writes, by name."""
    from torch._higher_order_ops import triton_kernel_wrap as wrap

    named = dict(zip(kernel.arg_names, args, strict=False))
    named.update({k: v for k, v in kwargs.items() if k not in ("num_warps", "num_stages")})
    if hasattr(wrap, "identify_accessed_tensors"):  # torch 2.13
        accesses = wrap.identify_accessed_tensors(kernel, named, {})
        names = [d.name for d in accesses.read_writes.writes]
    else:  # torch 2.11
        names = wrap.identify_mutated_tensors(kernel, named, {})
    return {name: named[name] for name in names if isinstance(named.get(name), torch.Tensor)}


@pytest.fixture
def launches(monkeypatch):
    """The launches made while the test runs, as ``(kernel name, {param: written tensor})``;
    the kernels are analysed, not run."""
    before = driver._active
    driver.set_active(_Sm90())
    seen: list[tuple[str, dict[str, torch.Tensor]]] = []

    def launch(kernel, grid):
        def call(*args, **kwargs):
            seen.append((kernel.__name__, _writes(kernel, args, kwargs)))

        return call

    for module in KERNEL_MODULES:
        if hasattr(module, "launch"):
            monkeypatch.setattr(module, "launch", launch)
    # The C++ casts (te_cuda) never run while tracing; here neither.
    monkeypatch.setattr(quantize, "cuda_cast", lambda *a, **k: None, raising=False)
    yield seen
    driver._active = before


def _t(*shape, dtype=BF16):
    return torch.randn(*shape).to(dtype)


def _cases() -> dict[str, tuple[Callable, tuple, dict]]:
    """name -> ``(wrapper, args, kwargs)``."""
    z, z2, g = _t(64, 128), _t(64, 256), _t(64, 128)
    b, b2, w, x = _t(128), _t(256), _t(128), _t(64, 128)
    one = torch.ones(1)
    mean, rsigma = torch.rand(64), torch.rand(64) + 1
    cases: dict[str, tuple[Callable, tuple, dict]] = {}
    for act, zz, bb in (("gelu", z, b), ("swiglu", z2, b2)):
        for bias in (None, bb):
            tag = f"{act}-{'nobias' if bias is None else 'bias'}"
            cases |= {
                f"act_quantize-fwd-{tag}": (
                    act_q.act_quantize, (zz, bias, None, act, E4M3, None, 64, True, False), {}
                ),
                f"act_quantize-bwd-{tag}": (
                    act_q.act_quantize, (zz, bias, g, act, E5M2, None, 64, True, True), {}
                ),
                f"act_quantize-delayed-{tag}": (
                    act_q.act_quantize, (zz, bias, g, act, E5M2, one, 64, True, True), {}
                ),
                f"act_quantize_block-fwd-{tag}": (
                    act_q.act_quantize_block, (zz, bias, None, act, E4M3, 64, False, False), {}
                ),
                f"act_quantize_block-bwd-{tag}": (
                    act_q.act_quantize_block, (zz, bias, g, act, E4M3, 64, True, False), {}
                ),
                f"activation_forward-{tag}": (activation.activation_forward, (zz, bias, act), {}),
                f"activation_backward-{tag}": (
                    activation.activation_backward, (g, zz, bias, act), {"need_dbias": True}
                ),
            }  # fmt: skip
    for n, nb in (("LayerNorm", b), ("RMSNorm", None)):
        cases |= {
            f"norm_quantize-{n}": (
                act_q.norm_quantize, (x, w, nb, n, 1e-5, False, E4M3, None, 64), {}
            ),
            f"norm_quantize-delayed-{n}": (
                act_q.norm_quantize, (x, w, nb, n, 1e-5, False, E4M3, one, 64), {}
            ),
            f"norm_quantize_block-{n}": (
                act_q.norm_quantize_block, (x, w, nb, n, 1e-5, True, E4M3, 64, False), {}
            ),
        }  # fmt: skip
    cases |= {
        "layernorm_fwd": (norm.layernorm_fwd, (x, w, b, 1e-5, False), {}),
        "layernorm_bwd": (norm.layernorm_bwd, (g, x, mean, rsigma, w, False, True), {}),
        "rmsnorm_fwd": (norm.rmsnorm_fwd, (x, w, 1e-5, True), {}),
        "rmsnorm_bwd": (norm.rmsnorm_bwd, (g, x, rsigma, w, True), {}),
        "l2normalization_fwd": (norm.l2normalization_fwd, (x, 1e-6), {}),
        "amax": (quantize.amax, (x,), {}),
        "quantize_current": (quantize.quantize_current, (x, E4M3, True), {}),
        "quantize_tensorwise": (quantize.quantize_tensorwise, (x, one, E4M3, True), {}),
        "quantize_blockwise": (quantize.quantize_blockwise, (x, E4M3, 1, False, True), {}),
        "quantize_blockwise_sums": (quantize.quantize_blockwise_sums, (x, E4M3, True), {}),
        "quantize_rowwise": (quantize_rows.quantize_rowwise, (x, E4M3), {}),
        "quantize_columnwise_transposed": (
            quantize_rows.quantize_columnwise_transposed,
            (x, E4M3),
            {},
        ),
        "quantize_mxfp8": (quantize_mx.quantize_mxfp8, (x, E4M3, True, True), {}),
        "quantize_nvfp4": (quantize_mx.quantize_nvfp4, (x.float(), one, True, True), {}),
        "dropout": (dropout.dropout, (x, torch.zeros(2, dtype=torch.int64), 2**31, 2.0), {}),
    }
    row_map = torch.tensor([[0, -1], [2, 1]], dtype=torch.int32)
    cases |= {
        "moe_gather_sum": (moe.gather_sum, (x, row_map, None), {}),
        "moe_gather_sum_weighted": (moe.gather_sum, (x, row_map, torch.rand(2, 2)), {}),
        "moe_gather_dot": (
            moe.gather_dot,
            (x, torch.tensor([1, -1], dtype=torch.int32), torch.rand(2), x[:2].clone()),
            {},
        ),
        "moe_gather_sum_counted": (
            moe.gather_sum,
            (x, row_map, None, torch.tensor([1, 2], dtype=torch.int32)),
            {},
        ),
    }
    q, packed, freqs = _t(16, 2, 4, 64), _t(24, 4, 64), torch.randn(32, 1, 1, 48)
    cu = torch.tensor([0, 16, 48], dtype=torch.int32)
    for interleaved in (False, True):
        for backward in (False, True):
            tag = f"{'interleaved' if interleaved else 'half'}-{'bwd' if backward else 'fwd'}"
            kw = {"backward": backward}
            cases |= {
                f"rotary-sbhd-{tag}": (
                    rotary.rotary, (q, freqs, None, "sbhd", interleaved, 1, 0), kw
                ),
                f"rotary-thd-cp-{tag}": (
                    rotary.rotary, (packed, freqs, cu, "thd", interleaved, 2, 1), kw
                ),
            }  # fmt: skip
    return cases


CASES = _cases()


def _storages(value) -> list[int]:
    if isinstance(value, torch.Tensor):
        return [value.untyped_storage().data_ptr()]
    if isinstance(value, (tuple, list)):
        return [p for v in value for p in _storages(v)]
    return []


@pytest.mark.parametrize("case", sorted(CASES))
def test_kernels_write_no_input(case, launches):
    wrapper, args, kwargs = CASES[case]
    try:
        wrapper(*args, **kwargs)
    except TypeError as e:  # a case that does not match its wrapper's signature is a test bug
        raise AssertionError(f"{case}: {e}") from e
    assert launches, f"{case}: no kernel was launched"
    inputs = set(_storages(args)) | set(_storages(list(kwargs.values())))
    wrong = {
        name: sorted(
            param for param, t in writes.items() if t.untyped_storage().data_ptr() in inputs
        )
        for name, writes in launches
    }
    assert not {k: v for k, v in wrong.items() if v}, (
        f"{case}: the analysis believes these kernels write an input: {wrong}"
    )
