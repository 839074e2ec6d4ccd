r"""Activations, element-wise and gated, with an optional fused bias, as two op pairs.

Element-wise (``ACTIVATIONS``), :math:`y = f(x + b)`:

.. math::
    \mathrm{gelu}(x) = \tfrac12 x\left(1 + \tanh\!\left(\sqrt{2/\pi}\,(x + 0.044715\,x^3)
        \right)\right), \qquad \mathrm{qgelu}(x) = x\,\sigma(1.702\,x),

    \mathrm{relu}(x) = \max(x, 0), \qquad \mathrm{srelu}(x) = \max(x, 0)^2,
    \qquad \mathrm{silu}(x) = x\,\sigma(x).

Gated (``GATED_ACTIVATIONS``): the last dim of ``inp + bias`` (size 2H) holds an activation
half :math:`a` and a linear half :math:`l`, and :math:`y = f(a)\,l` has last dim H, with
:math:`f` = sigmoid (``glu``), gelu (``geglu``), qgelu (``qgeglu``), relu (``reglu``), srelu
(``sreglu``), silu (``swiglu``). ``clamped_swiglu`` (GPT-OSS, Transformer Engine's
``ClampedSwiGLU``) clamps both halves first:

.. math::
    c = \min(a, \mathrm{limit}), \qquad
    y = c\,\sigma(\alpha c)\,\left(\mathrm{clamp}(l, -\mathrm{limit}, \mathrm{limit})
        + \mathrm{glu\_linear\_offset}\right)

with defaults ``limit=7.0, alpha=1.702, glu_linear_offset=1.0``; the clamps pass gradient where
the input is inside the range, bounds included (as ``torch.clamp``). ``situglu`` (soft-capped
SiLU GLU of Kimi K3, Transformer Engine's ``SiTUGLU``) soft-caps both halves with ``tanh``:

.. math::
    y = \beta_1 \tanh(a/\beta_1)\,\sigma(a)\;\beta_2 \tanh(l/\beta_2)

with defaults ``beta1=4.0, beta2=25.0`` (both finite and > 0).

The gated ops carry an activation's parameters in three float slots named after
``clamped_swiglu``'s (``limit, alpha, glu_linear_offset``), so that a parametrised activation
adds no op argument (and no argument to ``te::linear``'s epilogue): ``situglu`` reads
``beta1`` from ``limit`` and ``beta2`` from ``alpha`` and requires ``glu_linear_offset == 0``
(it has no offset): a caller passing ``clamped_swiglu``'s defaults (7.0, 1.702, 1.0) for it gets
an error, never wrong betas.

Layout of the gated input, as in Transformer Engine: by default the first half of the last dim is
:math:`a` and the second half :math:`l`. With ``glu_interleave_size=k`` the last dim holds
alternating blocks ``[a_0:k, l_0:k, a_k:2k, l_k:2k, ...]``, the layout a fused grouped MLP's FC1
produces (``k`` must divide H). Interleaving a contiguous input that way gives the same output.

Ops: ``te::activation_fwd/_bwd`` and ``te::gated_activation_fwd/_bwd`` (their schemas are the
signatures below), one pair per family, the activation chosen by name. Why by name and not one op
per activation: every activation shares the checks, the layouts, the kernels and the bias/dbias
fusion; 24 ops would repeat them 12 times and cost a registry entry each, while the name is a
compile-time constant to Triton (one specialisation per activation) and shows in FX graphs and
profiles as an argument. Why the bias is an optional input rather than a third op pair: it is the
same kernel with one more load (the bias ``Linear`` of LayerNormMLP's FC1 does not add, this op
does, in the same pass), like ``te::linear_fwd``'s ``Tensor? bias``. The backward recomputes
``inp + bias`` (only the inputs are saved) and returns ``dbias`` — the column sums of ``dinp``, in
fp32 from the unrounded ``dinp`` — from the same pass. The bias has ``inp``'s last dim (2H for
gated activations, in the input's column layout) and dtype.

Implementations: the CPU one is the reference math below (fp32, rounded once); CUDA runs the Triton
kernels of ``te_compile.kernels.activation`` (fp64 inputs take the reference math there too). Under
``torch.autocast`` the op runs in the autocast dtype (input and bias cast as ``nn.Linear`` casts
its bias), as Transformer Engine's activation ops do: in a transformer block it sits between
autocast GEMMs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from itertools import zip_longest

import torch
import torch.nn.functional as F
from torch import Tensor

from te_compile._checks import (
    FLOAT_DTYPES,
    check_finite,
    check_int,
    check_positive_finite,
    check_same_device,
    check_tensor,
    check_tensors,
)
from te_compile._library import differentiable, op
from te_compile._numerics import acc_dtype
from te_compile.kernels import runs_triton, submodule

__all__ = [
    "ACTIVATIONS",
    "CLAMPED_SWIGLU_DEFAULTS",
    "GATED_ACTIVATIONS",
    "activation_backward",
    "activation_forward",
    "activation_ref",
    "bias_activation",
    "check_activation",
    "check_gated_params",
    "clamped_swiglu",
    "fused_quantize_runs",
    "gated_activation_ref",
    "geglu",
    "gelu",
    "glu",
    "qgeglu",
    "qgelu",
    "reglu",
    "relu",
    "silu",
    "sreglu",
    "srelu",
    "swiglu",
]

_INF = float("inf")
ACTIVATIONS = ("gelu", "qgelu", "relu", "srelu", "silu")
GATED_ACTIVATIONS = (
    "glu", "geglu", "qgeglu", "reglu", "sreglu", "swiglu", "clamped_swiglu", "situglu")  # fmt: skip
# The activations of LayerNormMLP and GroupedMLP, as in Transformer Engine: situglu is a te.ops
# activation only (those modules' activation_params have no slot for its betas).
MODULE_ACTIVATIONS = tuple(a for a in (*ACTIVATIONS, *GATED_ACTIVATIONS) if a != "situglu")

# The function each name applies (gated: to its activation half; element-wise: itself).
_FUNCTION = {a: a for a in ACTIVATIONS} | {
    "glu": "sigmoid",
    "geglu": "gelu",
    "qgeglu": "qgelu",
    "reglu": "relu",
    "sreglu": "srelu",
    "swiglu": "silu",
    "clamped_swiglu": "clamped_silu",
    "situglu": "situ",
}
_QGELU_ALPHA = 1.702
# clamped_swiglu's parameters by name, at their defaults (the ops' signatures spell them out).
CLAMPED_SWIGLU_DEFAULTS = {"limit": 7.0, "alpha": 1.702, "glu_linear_offset": 1.0}
_GELU_C = (2.0 / torch.pi) ** 0.5


# 1. Reference math ----------------------------------------------------------------------------


def _act(x: Tensor, fn: str, limit: float, alpha: float) -> Tensor:
    if fn == "gelu":
        return F.gelu(x, approximate="tanh")
    if fn == "qgelu":
        return x * torch.sigmoid(_QGELU_ALPHA * x)
    if fn == "relu":
        return torch.relu(x)
    if fn == "srelu":
        return torch.relu(x).square()
    if fn == "silu":
        return F.silu(x)
    if fn == "sigmoid":
        return torch.sigmoid(x)
    if fn == "situ":  # limit, alpha: beta1, beta2
        return limit * torch.tanh(x / limit) * torch.sigmoid(x)
    c = x.clamp(max=limit)  # clamped_silu
    return c * torch.sigmoid(alpha * c)


def _dact(x: Tensor, fn: str, limit: float, alpha: float) -> Tensor:
    """f'(x), written out (the CPU backward; the float64 reference gradient is autograd's)."""
    if fn == "gelu":
        t = torch.tanh(_GELU_C * (x + 0.044715 * x**3))
        return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * _GELU_C * (1 + 3 * 0.044715 * x * x)
    if fn == "relu":
        return (x > 0).to(x.dtype)
    if fn == "srelu":
        return 2 * torch.relu(x)
    if fn == "sigmoid":
        s = torch.sigmoid(x)
        return s * (1 - s)
    if fn == "situ":
        t, s = torch.tanh(x / limit), torch.sigmoid(x)
        return (1 - t * t) * s + limit * t * s * (1 - s)
    a = {"qgelu": _QGELU_ALPHA, "silu": 1.0, "clamped_silu": alpha}[fn]
    c = x.clamp(max=limit) if fn == "clamped_silu" else x
    s = torch.sigmoid(a * c)
    d = s + a * c * s * (1 - s)
    return torch.where(x <= limit, d, 0.0) if fn == "clamped_silu" else d


def _with_bias(inp: Tensor, bias: Tensor | None) -> Tensor:
    acc = acc_dtype(inp)
    return inp.to(acc) if bias is None else inp.to(acc) + bias.to(acc)


def _glu_columns(h: int, k: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Column indices of the activation and the linear half of ``[..., 2 h]`` in either layout
    (``k == 0``: contiguous halves, the interleaved layout with ``k = h``). Indices, not views of
    ``[..., h // k, 2, k]`` blocks: under dynamic shapes their symbolic proofs cost more than the
    math."""
    k, j = k or max(h, 1), torch.arange(h, device=device)
    a = j // k * (2 * k) + j % k
    return a, a + k


def _split_glu(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    cols = _glu_columns(x.shape[-1] // 2, k, x.device)
    return x.index_select(-1, cols[0]), x.index_select(-1, cols[1])


def _merge_glu(a: Tensor, lin: Tensor, k: int) -> Tensor:
    out, cols = a.new_empty(*a.shape[:-1], 2 * a.shape[-1]), _glu_columns(a.shape[-1], k, a.device)
    out[..., cols[0]], out[..., cols[1]] = a, lin
    return out


def activation_ref(inp: Tensor, bias: Tensor | None, activation: str) -> Tensor:
    """``activation(inp + bias)`` in fp32 (fp64 stays fp64), cast to ``inp.dtype`` at the end."""
    return _act(_with_bias(inp, bias), _FUNCTION[activation], 0.0, 0.0).to(inp.dtype)


def gated_activation_ref(
    inp: Tensor,
    bias: Tensor | None,
    activation: str,
    glu_interleave_size: int = 0,
    limit: float = 7.0,
    alpha: float = 1.702,
    glu_linear_offset: float = 1.0,
) -> Tensor:
    """``f(a) * l`` of ``inp + bias`` split into halves (see module docstring), fp32, cast once."""
    a, lin = _split_glu(_with_bias(inp, bias), glu_interleave_size)
    if activation == "clamped_swiglu":
        lin = lin.clamp(-limit, limit) + glu_linear_offset
    elif activation == "situglu":
        check_situ_slots("te.gated_activation", limit, alpha, glu_linear_offset)
        lin = alpha * torch.tanh(lin / alpha)
    return (_act(a, _FUNCTION[activation], limit, alpha) * lin).to(inp.dtype)


# Checks shared by the implementations (eager) and the fakes (trace time) ----------------------


def _check_args(inp: Tensor, bias: Tensor | None, activation: str, gated: bool, k: int = 0) -> None:
    """A ValueError naming the argument, the same in eager and at trace time."""
    p = "te.gated_activation" if gated else "te.activation"
    if activation not in _FUNCTION:
        raise ValueError(
            f"{p}: unknown activation {activation!r}; element-wise activations are "
            f"{', '.join(ACTIVATIONS)}; gated activations are {', '.join(GATED_ACTIVATIONS)}"
        )
    if gated and activation in ACTIVATIONS:
        raise ValueError(
            f"{p}: activation must be a gated activation ({', '.join(GATED_ACTIVATIONS)}), got "
            f"the element-wise {activation!r}; glu_interleave_size applies to gated activations"
        )
    if not gated and activation in GATED_ACTIVATIONS:
        raise ValueError(
            f"{p}: activation must be element-wise ({', '.join(ACTIVATIONS)}), got the gated "
            f"{activation!r}; use te_compile.functional.{activation} or bias_activation"
        )
    if inp.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{p}: inp.dtype must be a floating type, got {inp.dtype}")
    if not gated and bias is None:
        return
    if inp.dim() < 1:
        raise ValueError(
            f"{p}: inp must have at least 1 dimension (a bias or gated halves need a last dim)"
        )
    n = inp.shape[-1]
    if gated and n % 2:
        raise ValueError(
            f"{p}: inp.shape[-1] ({n}) must be even: its first half is the activation input and "
            f"its second half the linear input"
        )
    if gated and k < 0:
        raise ValueError(
            f"{p}: glu_interleave_size must be >= 0 (0 or None: contiguous halves), got {k}"
        )
    if gated and k and (n // 2) % k:
        raise ValueError(
            f"{p}: glu_interleave_size ({k}) must divide half the last dim, "
            f"inp.shape[-1] // 2 = {n // 2}"
        )
    if bias is not None and bias.shape != inp.shape[-1:]:
        raise ValueError(
            f"{p}: bias must have shape [inp.shape[-1]] = [{n}], got {list(bias.shape)}"
        )
    if bias is not None and bias.dtype is not inp.dtype:
        raise ValueError(f"{p}: bias.dtype ({bias.dtype}) must equal inp.dtype ({inp.dtype})")


def _check_op(inp, bias, activation, config: tuple | None) -> None:
    """The forward ops' checks; ``config``: the gated op's ``(glu_interleave_size, limit, alpha,
    glu_linear_offset)``, None for the element-wise op."""
    if config is None:
        return _check_args(inp, bias, activation, False)
    k, limit, alpha, offset = config
    _check_args(inp, bias, activation, True, k)
    if activation == "situglu":
        check_situ_slots("te.gated_activation", limit, alpha, offset)
    check_gated_params("te.gated_activation", limit, alpha, offset)


def check_gated_params(owner: str, limit: float, alpha: float, glu_linear_offset: float) -> None:
    """``limit`` and ``alpha`` finite and > 0, ``glu_linear_offset`` finite (``clamped_swiglu``'s
    parameters; every gated op takes them): a ValueError naming the argument, from Python
    scalars only, so eager and trace time raise the same."""
    if (
        type(limit) is float and type(alpha) is float and type(glu_linear_offset) is float
        and 0 < limit < _INF and 0 < alpha < _INF and -_INF < glu_linear_offset < _INF
    ):  # fmt: skip
        return  # the hot path: one compound test (0.1 us against 1 us for the diagnosis)
    check_positive_finite(owner, limit=limit, alpha=alpha)
    check_finite(owner, glu_linear_offset=glu_linear_offset)


def check_situ_slots(owner: str, beta1: float, beta2: float, glu_linear_offset: float) -> None:
    """``situglu``'s slots: ``beta1`` (``limit``) and ``beta2`` (``alpha``) finite and > 0,
    ``glu_linear_offset`` 0 (module docstring); a ValueError naming the argument."""
    if 0 < beta1 < _INF and 0 < beta2 < _INF and glu_linear_offset == 0.0:
        return
    check_positive_finite(owner, beta1=beta1, beta2=beta2)
    raise ValueError(
        f"{owner}: activation 'situglu' has no glu_linear_offset; its slot must be 0.0 (beta1 "
        f"travels in limit, beta2 in alpha), got glu_linear_offset={glu_linear_offset}"
    )


def fused_quantize_runs(activation: str, params: tuple[float, float, float]) -> bool:
    """Whether ``kernels.act_quantize`` (the activation fused into the next GEMM's quantisation,
    ``te::mlp`` on CUDA) computes ``activation`` with these ``(limit, alpha, glu_linear_offset)``
    slots: it applies ``clamped_swiglu``'s defaults as literals and runs only the names of
    ``kernels.activation.FUNCTION_OF`` (no ``situglu``); the rest take the activation op's path.
    Imports Triton (a CUDA caller's question)."""
    if activation == "clamped_swiglu":
        return params == tuple(CLAMPED_SWIGLU_DEFAULTS.values())
    return activation in _kernels().FUNCTION_OF


def check_activation(
    inp: Tensor, bias: Tensor | None, activation: str, glu_interleave_size: int = 0
) -> None:
    """The checks of the activation ops for ``activation`` of ``inp + bias`` (any name of
    ``ACTIVATIONS`` or ``GATED_ACTIVATIONS``): a ValueError naming the argument, as the ops
    raise it. For ops that apply an activation in an epilogue (``inp`` may be a stand-in with
    the GEMM output's shape and dtype on the meta device)."""
    _check_args(inp, bias, activation, activation in GATED_ACTIVATIONS, glu_interleave_size)


_kernels = functools.partial(submodule, "activation")  # Triton: imported on first CUDA use


# 2. Forward ops -------------------------------------------------------------------------------


def _forward(inp: Tensor, bias: Tensor | None, activation: str, config=None) -> Tensor:
    """Both forward ops' implementations (``config`` as :func:`_check_op`'s)."""
    _check_op(inp, bias, activation, config)
    if runs_triton(inp):
        return _kernels().activation_forward(inp, bias, activation, *(config or ()))
    if config is None:
        return activation_ref(inp.contiguous(), bias, activation)
    return gated_activation_ref(inp.contiguous(), bias, activation, *config)


@op("activation_fwd")
def activation_fwd(inp: Tensor, bias: Tensor | None, activation: str) -> Tensor:
    """``activation(inp + bias)``."""
    return _forward(inp, bias, activation)


@op("gated_activation_fwd")
def gated_activation_fwd(
    inp: Tensor,
    bias: Tensor | None,
    activation: str,
    glu_interleave_size: int = 0,
    limit: float = 7.0,
    alpha: float = 1.702,
    glu_linear_offset: float = 1.0,
) -> Tensor:
    """Gated ``activation`` of ``inp + bias``."""
    return _forward(inp, bias, activation, (glu_interleave_size, limit, alpha, glu_linear_offset))


# 3. Fakes -------------------------------------------------------------------------------------


@activation_fwd.register_fake
def _activation_fwd_fake(inp, bias, activation):
    _check_op(inp, bias, activation, None)
    return inp.new_empty(inp.shape)


# The dispatcher leaves out the arguments that equal their defaults: the fake restates them.
@gated_activation_fwd.register_fake
def _gated_activation_fwd_fake(inp, bias, activation, k=0, limit=7.0, alpha=1.702, offset=1.0):
    _check_op(inp, bias, activation, (k, limit, alpha, offset))
    return inp.new_empty((*inp.shape[:-1], inp.shape[-1] // 2))


# 4. Backward ops ------------------------------------------------------------------------------
# Their implementations and fake serve both ops: ``rest`` is the gated op's ``(k, limit, alpha,
# offset)`` (nothing for the element-wise op), then ``need_dbias``.


def _backward_ref(grad, inp, bias, activation, *rest):
    """The derivatives written out, fp32 (fp64 stays fp64), rounded once."""
    *config, need_dbias = rest
    fn, g, x = _FUNCTION[activation], grad.to(acc_dtype(inp)), _with_bias(inp, bias)
    if not config:
        dx = g * _dact(x, fn, 0.0, 0.0)
    else:
        k, limit, alpha, offset = config
        a, lin = _split_glu(x, k)
        dlin = g * _act(a, fn, limit, alpha)
        if activation == "clamped_swiglu":
            dlin = torch.where((lin >= -limit) & (lin <= limit), dlin, 0.0)
            lin = lin.clamp(-limit, limit) + offset
        elif activation == "situglu":
            t = torch.tanh(lin / alpha)
            dlin = dlin * (1 - t * t)
            lin = alpha * t
        dx = _merge_glu(g * lin * _dact(a, fn, limit, alpha), dlin, k)
    # dbias: the column sums of the unrounded dx, or a fresh 0-element tensor when not needed.
    if not need_dbias or bias is None:
        return dx.to(inp.dtype), inp.new_empty(0)
    return dx.to(inp.dtype), dx.reshape(-1, dx.shape[-1]).sum(0).to(inp.dtype)


def _backward_impl(grad, inp, bias, activation, *rest):
    """Both backward ops' implementations: Triton (CUDA, not fp64) or the reference math."""
    if not runs_triton(inp):
        return _backward_ref(grad, inp, bias, activation, *rest)
    *config, need_dbias = rest
    dx, dbias = _kernels().activation_backward(
        grad, inp, bias, activation, *config, need_dbias=need_dbias
    )
    return dx, inp.new_empty(0) if dbias is None else dbias


def _backward_fake(grad, inp, bias, activation, *rest):
    dbias = inp.new_empty(bias.shape if rest[-1] and bias is not None else 0)
    return inp.new_empty(inp.shape), dbias


@op("activation_bwd")
def activation_bwd(
    grad: Tensor, inp: Tensor, bias: Tensor | None, activation: str, need_dbias: bool
) -> tuple[Tensor, Tensor]:
    """``(dinp, dbias)``; ``dbias`` is a 0-element tensor unless ``need_dbias``."""
    return _backward_impl(grad, inp, bias, activation, need_dbias)


@op("gated_activation_bwd")
def gated_activation_bwd(
    grad: Tensor,
    inp: Tensor,
    bias: Tensor | None,
    activation: str,
    glu_interleave_size: int,
    limit: float,
    alpha: float,
    glu_linear_offset: float,
    need_dbias: bool,
) -> tuple[Tensor, Tensor]:
    """``(dinp, dbias)`` of the gated activation; ``dbias`` is 0-element unless ``need_dbias``."""
    config = (glu_interleave_size, limit, alpha, glu_linear_offset)
    return _backward_impl(grad, inp, bias, activation, *config, need_dbias)


activation_bwd.register_fake(_backward_fake)
gated_activation_bwd.register_fake(_backward_fake)


def activation_forward(
    inp: Tensor,
    bias: Tensor | None,
    activation: str,
    glu_interleave_size: int = 0,
    limit: float = 7.0,
    alpha: float = 1.702,
    glu_linear_offset: float = 1.0,
) -> Tensor:
    """``activation(inp + bias)`` by the forward op's implementation for ``inp``'s device
    (element-wise or gated by name), for ops that apply an activation inside their own
    implementation."""
    config = (glu_interleave_size, limit, alpha, glu_linear_offset)
    return _forward(inp, bias, activation, config if activation in GATED_ACTIVATIONS else None)


def activation_backward(
    grad: Tensor,
    inp: Tensor,
    bias: Tensor | None,
    activation: str,
    glu_interleave_size: int = 0,
    limit: float = 7.0,
    alpha: float = 1.702,
    glu_linear_offset: float = 1.0,
    need_dbias: bool = False,
) -> tuple[Tensor, Tensor]:
    """``(dinp, dbias)`` of :func:`activation_forward` by the backward op's implementation
    (``dbias`` from the same pass; 0-element unless ``need_dbias`` and a bias)."""
    gated = activation in GATED_ACTIVATIONS
    config = (glu_interleave_size, limit, alpha, glu_linear_offset) if gated else ()
    return _backward_impl(grad, inp, bias, activation, *config, need_dbias)


# 5. setup_context + autograd ------------------------------------------------------------------


def _setup_context(ctx, inputs, output) -> None:
    inp, bias, *config = inputs
    ctx.save_for_backward(inp, bias)
    ctx.config = config  # activation name, then (gated) interleave size, limit, alpha, offset


def _backward(ctx, bwd, grad):
    need = ctx.needs_input_grad  # need[1] (dbias) is False without a bias
    grads = bwd(grad.contiguous(), *ctx.saved_tensors, *ctx.config, need[1])
    return tuple(g if n else None for g, n in zip_longest(grads, need))


# One op pair per family: forward, backward, reference.
_activation, _gated_activation = (
    differentiable(f, b, setup_context=_setup_context, backward=_backward, reference=r)
    for f, b, r in (
        (activation_fwd, activation_bwd, activation_ref),
        (gated_activation_fwd, gated_activation_bwd, gated_activation_ref),
    )
)


# Public functions -----------------------------------------------------------------------------


def _gated(
    inp: Tensor,
    bias: Tensor | None,
    activation: str,
    glu_interleave_size: int | None,
    limit: float = 7.0,
    alpha: float = 1.702,
    glu_linear_offset: float = 1.0,
    owner: str = "",
) -> Tensor:
    if not isinstance(inp, Tensor) or not (
        glu_interleave_size is None
        or (type(glu_interleave_size) is int and glu_interleave_size >= 0)
    ):
        owner = owner or f"te.{activation}"
        check_tensor(owner, "inp", inp)
        check_tensors(owner, bias=bias)
        if glu_interleave_size is not None:
            check_int(owner, 0, glu_interleave_size=glu_interleave_size)
    return _gated_activation(
        inp, bias, activation, glu_interleave_size or 0, limit, alpha, glu_linear_offset
    )


def _public(activation: str, doc: str) -> Callable[..., Tensor]:
    """The public function of an activation without parameters (``doc``: its math)."""

    def elementwise(inp: Tensor) -> Tensor:
        if not isinstance(inp, Tensor):
            check_tensor(f"te.{activation}", "inp", inp, min_dim=0)
        return _activation(inp, None, activation)

    def gated(inp: Tensor, glu_interleave_size: int | None = None) -> Tensor:
        return _gated(inp, None, activation, glu_interleave_size)

    fn = elementwise if activation in ACTIVATIONS else gated
    fn.__name__ = fn.__qualname__ = activation
    fn.__doc__ = doc
    return fn


gelu = _public("gelu", "GELU, tanh approximation.")
qgelu = _public("qgelu", "Quick GELU, ``x * sigmoid(1.702 x)``.")
relu = _public("relu", "ReLU, ``max(x, 0)``.")
srelu = _public("srelu", "Squared ReLU, ``relu(x) ** 2``.")
silu = _public("silu", "SiLU (swish), ``x * sigmoid(x)``.")
glu = _public("glu", "``sigmoid(a) * l`` of the last dim's halves (module docstring: layouts).")
geglu = _public("geglu", "``gelu(a) * l`` (tanh GELU).")
qgeglu = _public("qgeglu", "``qgelu(a) * l``.")
reglu = _public("reglu", "``relu(a) * l``.")
sreglu = _public("sreglu", "``relu(a)**2 * l``.")
swiglu = _public("swiglu", "``silu(a) * l``.")


def clamped_swiglu(
    inp: Tensor,
    limit: float = 7.0,
    alpha: float = 1.702,
    glu_linear_offset: float = 1.0,
    glu_interleave_size: int | None = None,
) -> Tensor:
    """GPT-OSS SwiGLU: ``c * sigmoid(alpha c) * (clamp(l, -limit, limit) + glu_linear_offset)``
    with ``c = min(a, limit)``."""
    check_gated_params("te.clamped_swiglu", limit, alpha, glu_linear_offset)
    return _gated(inp, None, "clamped_swiglu", glu_interleave_size, limit, alpha, glu_linear_offset)


def bias_activation(
    inp: Tensor,
    bias: Tensor | None,
    activation: str,
    glu_interleave_size: int | None = None,
    *,
    limit: float = 7.0,
    alpha: float = 1.702,
    glu_linear_offset: float = 1.0,
) -> Tensor:
    """Any activation of ``ACTIVATIONS`` or ``GATED_ACTIVATIONS`` applied to ``inp + bias`` in one
    fused pass; the backward returns ``dbias`` from the same pass. ``bias`` (or None) has
    ``inp``'s last dim and dtype; ``limit``/``alpha``/``glu_linear_offset`` are used by
    ``clamped_swiglu`` only (``situglu`` reads ``beta1``, ``beta2`` from ``limit``, ``alpha``
    and needs ``glu_linear_offset=0.0``). This is what LayerNormMLP calls after its FC1 GEMM."""
    check_gated_params("te.bias_activation", limit, alpha, glu_linear_offset)
    if not isinstance(inp, Tensor) or not (bias is None or isinstance(bias, Tensor)):
        check_tensor("te.bias_activation", "inp", inp)
        check_tensors("te.bias_activation", bias=bias)
    if bias is not None and bias.device != inp.device:
        check_same_device("te.bias_activation", "inp", inp, bias=bias)
    if activation in ACTIVATIONS and not glu_interleave_size:
        return _activation(inp, bias, activation)
    # Gated names; also element-wise ones given an interleave size and unknown names, which the
    # gated op rejects with a message naming the argument (in eager and at trace time).
    return _gated(
        inp, bias, activation, glu_interleave_size, limit, alpha, glu_linear_offset,
        "te.bias_activation")  # fmt: skip
