"""Attention on CUDA (``te::attention_fwd/_bwd`` through PyTorch's fused kernels): every row of
the kernel table (``docs/attention.md``, "Kernels") against the float64 reference on the CPU
(the op's reference math, itself checked against the (i, j) loop definitions in
``test_attention.py``), the kernel each case runs, dropout (a function of the CUDA generator,
the same mask in the forward and the backward, recomputed under checkpointing, at its rate) and
compile on the GPU. Skipped without a CUDA GPU: the CPU suite covers the reference math and the
kernel table's choices."""

from __future__ import annotations

import dataclasses
import importlib
import math
from dataclasses import dataclass, field

import pytest
import torch
import torch.utils.checkpoint
from torch.nn.attention import SDPBackend, sdpa_kernel

import te_compile as te
from tests.utils import (
    HAS_CUDA,
    assert_close,
    assert_matches_eager,
    chain_roundings,
    compile_counted,
)

A = importlib.import_module("te_compile.functional.attention")
F = te.functional

pytestmark = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU; none on this machine")


@dataclass(frozen=True)
class Case:
    """One call: dense ``[b, s, h, d]`` (``bshd``/``sbhd``) or packed ``thd`` when ``lens_q``
    is given; ``kernel``: the row of the kernel table it must run on an sm_80+ GPU."""

    kernel: str
    mask_type: str = "causal"
    qkv_format: str = "bshd"
    b: int = 2
    sq: int = 37
    skv: int = 37
    h: int = 8
    hk: int = 8
    d: int = 64
    dv: int | None = None
    window: tuple[int, int] | None = None
    padding: tuple[tuple[int, ...], tuple[int, ...]] | None = None  # lengths (q, kv) per batch
    arbitrary: bool = False
    bias: str | None = None  # a core_attention_bias_type, with a [1, h, sq, skv] bias
    alibi: bool = False
    lens_q: tuple[int, ...] | None = None  # thd: sequence lengths (padding tokens after them)
    lens_kv: tuple[int, ...] | None = None
    sink: str | None = None  # a softmax_type with a sink: "off-by-one" or "learnable"
    extra: dict = field(default_factory=dict)


CASES = {
    # No size equal to another (b=2 would be duck-sized with hk=2, which the choice of kernel
    # reads as an int: a batch-size change would then recompile).
    "cudnn-causal": Case("cudnn", b=4, sq=40, skv=40, hk=2),
    "cudnn-sbhd-mqa-no-mask": Case("cudnn", mask_type="no_mask", qkv_format="sbhd", hk=1),
    "cudnn-head-dims-128-64": Case("cudnn", d=128, dv=64),
    "flash-causal": Case("flash"),
    "flash-sbhd-gqa": Case("flash", qkv_format="sbhd", hk=2),
    "flash-mqa-no-mask": Case("flash", mask_type="no_mask", hk=1),
    "flash-bottom-right-cross": Case("flash", mask_type="causal_bottom_right", sq=19, skv=45),
    "flash-window": Case("flash", window=(7, 0)),
    "flash-window-both-sides": Case("flash", mask_type="no_mask", window=(5, 3)),
    "flash-head-dim-40-dv-24": Case("flash", mask_type="no_mask", d=40, dv=24),
    "efficient-top-left-causal-cross": Case("efficient", sq=19, skv=45),
    "efficient-padding": Case("efficient", mask_type="padding", padding=((37, 20), (30, 37))),
    "efficient-padding-causal": Case(
        "efficient", mask_type="padding_causal", padding=((25, 37), (37, 11))
    ),
    "efficient-padding-causal-bottom-right": Case(
        "efficient", mask_type="padding_causal_bottom_right", hk=2, padding=((30, 9), (37, 20))
    ),
    "efficient-arbitrary": Case("efficient", mask_type="arbitrary", hk=4),
    "efficient-bias": Case("efficient", bias="post_scale_bias"),
    "efficient-pre-scale-bias": Case("efficient", mask_type="no_mask", bias="pre_scale_bias"),
    "efficient-alibi": Case("efficient", alibi=True, hk=2),
    "efficient-top-left-window-cross": Case("efficient", sq=30, skv=45, window=(6, 0)),
    "flash-bottom-right-sq-gt-skv": Case("flash", mask_type="causal_bottom_right", sq=45, skv=19),
    "flash-varlen": Case("flash_varlen", "padding_causal", "thd", lens_q=(17, 1, 40), hk=2),
    "flash-varlen-window": Case(
        "flash_varlen", "padding_causal", "thd", lens_q=(17, 33, 9), window=(4, 0)
    ),
    "flash-varlen-cross-bottom-right": Case(
        "flash_varlen",
        "padding_causal_bottom_right",
        "thd",
        lens_q=(5, 12, 3),
        lens_kv=(20, 12, 31),
    ),
    "efficient-varlen-cross-causal": Case(
        "efficient_varlen", "padding_causal", "thd", lens_q=(5, 12, 3), lens_kv=(20, 12, 31)
    ),
    "math-varlen-alibi": Case("math", "padding_causal", "thd", lens_q=(9, 16), alibi=True),
    # PyTorch's fused kernels have no sink term: the reference math runs.
    "math-sink-off-by-one-padding": Case(
        "math", mask_type="padding_causal", padding=((37, 20), (30, 37)), sink="off-by-one"
    ),
    # 4 key/value heads, not 2: with the batch of 2, dynamic shapes would duck-size the two
    # into one symbol, and the compiled test's batch-3 call would recompile.
    "math-sink-learnable-gqa": Case("math", hk=4, sink="learnable"),
    "math-sink-learnable-varlen": Case(
        "math", "padding_causal", "thd", lens_q=(17, 1, 40), hk=2, sink="learnable"
    ),
}


def _backends(kernel: str):
    """The SDPA backends a case runs under: cuDNN first for the ``cudnn`` rows, cuDNN off for the
    others (the op follows SDPA's preference, which puts cuDNN first on sm90 with cuDNN 9.15+)."""
    B = SDPBackend
    if kernel == "cudnn":
        order = [B.CUDNN_ATTENTION, B.FLASH_ATTENTION, B.EFFICIENT_ATTENTION, B.MATH]
        return sdpa_kernel(order, set_priority=True)
    return sdpa_kernel([B.FLASH_ATTENTION, B.EFFICIENT_ATTENTION, B.MATH])


def _kernel(case: Case, dtype: torch.dtype) -> str:
    """The table's row for fp32: cuDNN and flash take half precision only."""
    if dtype == torch.float32 and case.kernel == "cudnn":
        return "efficient"
    if dtype == torch.float32 and case.kernel.startswith("flash"):
        if case.kernel == "flash_varlen":  # the varlen kernel takes no window, nor empty rows
            empty_rows = case.lens_kv is not None and "bottom_right" in case.mask_type
            return "math" if case.window is not None or empty_rows else "efficient_varlen"
        return "efficient"
    return case.kernel


def _packed(lens: tuple[int, ...], device: str) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32).to(device)


def _inputs(case: Case, dtype: torch.dtype, device: str) -> tuple[list[torch.Tensor], dict]:
    """q, k, v (leaves on ``device`` in ``dtype``) and the other arguments, the same numbers on
    every device."""
    gen = torch.Generator().manual_seed(0)
    dv = case.dv or case.d
    if case.lens_q is not None:
        lens_kv = case.lens_kv or case.lens_q
        shapes = [
            (sum(case.lens_q) + 3, case.h, case.d),
            (sum(lens_kv) + 2, case.hk, case.d),
            (sum(lens_kv) + 2, case.hk, dv),
        ]
    else:
        shapes = [
            (case.b, case.sq, case.h, case.d),
            (case.b, case.skv, case.hk, case.d),
            (case.b, case.skv, case.hk, dv),
        ]
    qkv = [torch.randn(s, generator=gen) for s in shapes]
    if case.qkv_format == "sbhd":
        qkv = [x.transpose(0, 1).contiguous() for x in qkv]
    kw: dict = {"qkv_format": case.qkv_format, "attn_mask_type": case.mask_type}
    if case.window is not None:
        kw["window_size"] = case.window
    if case.lens_q is not None:
        # One tensor for both when the layouts agree: the op then knows they do (identity).
        kw["cu_seqlens_q"] = cu_q = _packed(case.lens_q, device)
        kw["cu_seqlens_kv"] = cu_q if case.lens_kv is None else _packed(case.lens_kv, device)
    if case.padding is not None:
        (lq, lk) = case.padding
        q_pad = torch.arange(case.sq)[None] >= torch.tensor(lq)[:, None]
        kv_pad = torch.arange(case.skv)[None] >= torch.tensor(lk)[:, None]
        kw["attention_mask"] = (q_pad[:, None, None].to(device), kv_pad[:, None, None].to(device))
    if case.arbitrary or case.mask_type == "arbitrary":
        mask = torch.rand(case.b, 1, case.sq, case.skv, generator=gen) < 0.3
        kw["attention_mask"] = mask.to(device)
    if case.bias is not None:
        bias = torch.randn(1, case.h, case.sq, case.skv, generator=gen)
        kw["core_attention_bias_type"] = case.bias
        kw["core_attention_bias"] = bias.to(device=device, dtype=dtype).requires_grad_()
    if case.alibi:
        kw["core_attention_bias_type"] = "alibi"
    if case.sink is not None:
        kw["softmax_type"] = case.sink
        if case.sink == "learnable":  # fp32, as the module's Parameter
            sink = torch.randn(case.h, generator=gen) * 2
            kw["softmax_offset"] = sink.to(device).requires_grad_()
    leaves = [x.to(device=device, dtype=dtype).requires_grad_() for x in qkv]
    return leaves, kw


def _run(case: Case, dtype: torch.dtype, device: str, grad_seed: int = 1):
    (q, k, v), kw = _inputs(case, dtype, device)
    out = F.dot_product_attention(q, k, v, **kw)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed))
    out.backward(grad.to(device=device, dtype=dtype))
    extra = [kw.get(name) for name in ("core_attention_bias", "softmax_offset")]
    grads = [q.grad, k.grad, v.grad] + [t.grad for t in extra if t is not None]
    return out, grads


@pytest.fixture
def kernels_run(monkeypatch):
    """The kernel-table rows the op's CUDA calls chose, in call order (``_plan`` answers None
    for the reference math; the CPU reference runs are not recorded)."""
    seen: list[str] = []
    plan = A._plan

    def recording(a):
        p = plan(a)
        if a.query.device.type == "cuda":
            seen.append("math" if p is None else p.kind)
        return p

    monkeypatch.setattr(A, "_plan", recording)
    return seen


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name", list(CASES))
def test_cuda_matches_float64_reference(name, dtype, kernels_run):
    """Output and every gradient against float64 on the CPU, and the kernel the table promises
    (``flash*`` on sm_80+ in half precision, ``efficient*`` otherwise)."""
    case = CASES[name]
    if case.kernel.startswith("flash") and torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("flash attention needs sm_80 or newer")
    with _backends(case.kernel):
        out, grads = _run(case, dtype, "cuda")
    ref, ref_grads = _run(case, torch.float64, "cpu")
    if case.kernel == "cudnn" and dtype != torch.float32 and set(kernels_run) == {"flash"}:
        pytest.skip("SDPA does not run cuDNN attention here (needs cuDNN 9 on sm_80+)")
    expected = _kernel(case, dtype)
    assert kernels_run and set(kernels_run) == {expected}, kernels_run
    # Softmax, the P @ V sum and the backward's dS each round in the kernels' precision; an
    # output is a sum of products of rounded probabilities and values (reduced).
    assert_close(out, ref, dtype, roundings=2, reduced=True)
    for g, r in zip(grads, ref_grads, strict=True):
        assert torch.isfinite(g).all()
        assert_close(g, r, dtype, roundings=chain_roundings(dtype, 4), reduced=True)


def test_cuda_follows_sdpa_and_matches_it(kernels_run):
    """With PyTorch's default backends, a plain causal GQA call runs the kernel SDPA picks for
    the same tensors: the same output bit for bit, the same gradients up to the order of the
    backward's atomic adds (cuDNN accumulates dQ with atomics)."""
    case = Case("cudnn", qkv_format="bshd", sq=128, skv=128, hk=2)
    (q, k, v), kw = _inputs(case, torch.bfloat16, "cuda")
    out = F.dot_product_attention(q, k, v, **kw)  # [b, s, h * d]
    g = torch.randn_like(out)
    out.backward(g)
    ref_qkv = [x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v)]
    sdpa = torch._fused_sdp_choice(*ref_qkv, None, 0.0, True, enable_gqa=True)
    ref = torch.nn.functional.scaled_dot_product_attention(
        *ref_qkv, is_causal=True, enable_gqa=True
    ).transpose(1, 2)  # [b, s, h, d]
    ref.backward(g.view(ref.shape))
    names = {SDPBackend.CUDNN_ATTENTION.value: "cudnn", SDPBackend.FLASH_ATTENTION.value: "flash"}
    assert kernels_run == [names[sdpa]] * 2, (kernels_run, sdpa)
    assert torch.equal(out, ref.flatten(2))
    for a, b in zip((q, k, v), ref_qkv, strict=True):
        assert_close(a.grad, b.grad.transpose(1, 2), torch.bfloat16, roundings=2)


@pytest.mark.parametrize(
    "name",
    [
        "cudnn-causal",
        "flash-causal",
        "efficient-padding-causal",
        "flash-varlen",
        "math-sink-learnable-gqa",
    ],
)
def test_cuda_compiled_matches_eager_without_recompiles(name, kernels_run):
    """fullgraph, dynamic shapes: one frame for two batch / sequence sizes; the compiled step
    runs the same kernel as eager and matches it."""
    torch._dynamo.reset()
    case = CASES[name]
    with _backends(case.kernel):
        _compiled_matches_eager(case)
    assert set(kernels_run) == {case.kernel}


def _compiled_matches_eager(case: Case) -> None:
    (q, k, v), kw = _inputs(case, torch.bfloat16, "cuda")

    def fn(q, k, v, kw):
        return F.dot_product_attention(q, k, v, **kw)

    compiled, counter = compile_counted(fn, dynamic=True)
    variants = [case]
    if case.lens_q is not None:
        variants.append(Case(case.kernel, case.mask_type, "thd", lens_q=(3, 50, 8, 21), hk=2))
    elif case.padding is not None:
        variants.append(Case(case.kernel, case.mask_type, b=3, sq=53, skv=53,
                             padding=((53, 10, 40), (53, 53, 2))))  # fmt: skip
    else:
        variants.append(dataclasses.replace(case, b=3, sq=53, skv=53))
    for variant in variants:
        (q, k, v), kw = _inputs(variant, torch.bfloat16, "cuda")
        out = compiled(q, k, v, kw)
        out.float().square().sum().backward()
        eager_qkv = [x.detach().requires_grad_() for x in (q, k, v)]
        expected = fn(*eager_qkv, kw)
        expected.float().square().sum().backward()
        assert_matches_eager(out, expected)
        # The gradients are sums over keys (cuDNN's backward accumulates dQ with atomic adds, in
        # any order): their tolerance is relative to the largest magnitude.
        for a, b in zip((q, k, v), eager_qkv, strict=True):
            assert_close(a.grad, b.grad, torch.bfloat16, roundings=2, reduced=True)
    assert counter.frame_count == 1


# Dropout on CUDA: the mem-efficient kernels draw from the CUDA generator -------------------------


def _dropout(q, k, v, p=0.3, mask_type="causal", qkv_format="bshd", **kw):
    return F.dot_product_attention(
        q, k, v, qkv_format=qkv_format, attn_mask_type=mask_type, dropout_p=p, **kw
    )


def _qkv(shape=(2, 48, 4, 64), dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).to("cuda", dtype).requires_grad_() for _ in range(3)]


@pytest.mark.parametrize("thd", [False, True], ids=["bshd", "thd"])
def test_cuda_dropout_follows_the_cuda_generator(thd, kernels_run):
    if thd:
        q, k, v = (x.detach()[0].requires_grad_() for x in _qkv())
        cu = _packed((20, 28), "cuda")
        kw = {"qkv_format": "thd", "mask_type": "padding_causal", "cu_seqlens_q": cu,
              "cu_seqlens_kv": cu}  # fmt: skip
    else:
        q, k, v = _qkv()
        kw = {}
    torch.cuda.manual_seed(5)
    y1 = _dropout(q, k, v, **kw)
    torch.cuda.manual_seed(5)
    y2 = _dropout(q, k, v, **kw)
    y3 = _dropout(q, k, v, **kw)
    assert torch.equal(y1, y2)
    assert not torch.equal(y1, y3)
    assert set(kernels_run) == {"efficient_varlen" if thd else "efficient"}


def test_cuda_dropout_backward_uses_the_forward_mask():
    """With the mask fixed, attention is linear in v: out(v') = P_drop v', so the gradient that
    the backward gives for v must satisfy <g, out(v')> = <dv, v'> for any v' drawn under the
    same seed: the backward regenerated the forward's mask."""
    q, k, v = _qkv(dtype=torch.float32)
    torch.cuda.manual_seed(11)
    y = _dropout(q, k, v)
    g = torch.randn_like(y)
    y.backward(g)
    v2 = torch.randn_like(v)
    torch.cuda.manual_seed(11)
    y2 = _dropout(q.detach(), k.detach(), v2)
    lhs = (g.double() * y2.double()).sum()
    rhs = (v.grad.double() * v2.double()).sum()
    # tol: two float64 sums of the same bf16 products in other orders (not a dtype rounding)
    torch.testing.assert_close(lhs, rhs, rtol=1e-4, atol=1e-3)
    # And the mask differs from no dropout at all.
    assert not torch.allclose(y.detach(), _dropout(q, k, v, p=0.0).detach())


def test_cuda_dropout_rate():
    """q = k = ones, v = ones: each probability is 1/64, so an output counts its row's kept
    keys (times 1/(1-p))."""
    q = k = v = torch.ones(1, 64, 1, 64, device="cuda", dtype=torch.float32)
    torch.cuda.manual_seed(3)
    y = _dropout(q, k, v, p=0.25, mask_type="no_mask")
    kept = (y.reshape(64, 64)[:, 0].double() * 0.75 * 64).round()
    n, p = 64 * 64, 0.25
    dropped = n - kept.sum().item()
    assert abs(dropped - n * p) < 6 * math.sqrt(n * p * (1 - p))


def test_cuda_checkpoint_recomputes_the_same_dropout_mask():
    """torch.utils.checkpoint restores the CUDA generator: the recomputed forward draws the same
    Philox seed, so gradients equal those of the run without checkpointing."""
    torch.manual_seed(0)
    proj = torch.nn.Linear(64, 3 * 64, device="cuda")
    attn = te.DotProductAttention(4, 16, attention_dropout=0.4, qkv_format="sbhd")
    x = torch.randn(32, 2, 64, device="cuda")

    def run(t):
        q, k, v = proj(t).reshape(t.shape[0], t.shape[1], 3, 4, 16).unbind(2)
        return attn(q, k, v)

    def grads(fn):
        proj.zero_grad(set_to_none=True)
        xi = x.detach().requires_grad_()
        torch.cuda.manual_seed(123)
        y = fn(xi)
        y.backward(torch.ones_like(y))
        return [y.detach(), xi.grad, *(p.grad for p in proj.parameters())]

    plain = grads(run)
    ckpt = grads(lambda t: torch.utils.checkpoint.checkpoint(run, t, use_reentrant=False))
    for a, b in zip(plain, ckpt, strict=True):
        assert torch.equal(a, b)
    torch.cuda.manual_seed(7)
    assert not torch.equal(run(x).detach(), plain[0])
