r"""GLU weight layouts: convert an FC1 weight or bias between contiguous and interleaved halves.

A gated MLP's FC1 produces, for each token, an activation half :math:`a` and a linear half
:math:`l` of H columns each; the gated activation (``te_compile.functional.swiglu`` and the
others of ``te_compile.functional.activation``) computes :math:`f(a)\,l`. Output column ``j`` of
``x @ W.T + b`` is row ``j`` of ``W`` (and entry ``j`` of ``b``), so the order of the rows of
``W`` along its GLU dim is the column layout of the activation input:

* contiguous (``nn.Linear``, Hugging Face checkpoints): all activation rows, then all linear rows,
  ``[W_0 .. W_{H-1}, V_0 .. V_{H-1}]``;
* interleaved with ``k = interleave_size``: alternating blocks of ``k`` activation rows and ``k``
  linear rows, ``[W_0:k, V_0:k, W_k:2k, V_k:2k, ...]`` — the layout that the gated activations
  read with ``glu_interleave_size=k``, and that a fused grouped MLP's FC1 produces.

Example, H = 4 and k = 2 (rows of a ``[8, in]`` weight, or entries of an ``[8]`` bias)::

    contiguous   W0 W1 W2 W3 V0 V1 V2 V3
    interleaved  W0 W1 V0 V1 W2 W3 V2 V3

so ``swiglu(x @ interleave_glu_tensor(W, 2).T, glu_interleave_size=2)`` equals
``swiglu(x @ W.T)``. With ``k = H`` the two layouts are the same. ``dim`` selects the GLU dim:
0 for a weight ``[2H, in]`` or a bias ``[2H]``, 1 (or -2) for a grouped weight
``[num_experts, 2H, in]``, 1 (or -1) for a grouped bias ``[num_experts, 2H]``.

Both functions are a reshape, a transpose and one copy: plain torch ops, so autograd's backward is
the inverse permutation and torch.compile traces them in the graph. The checks read only static
shape information (ranks and sizes), so under torch.compile they raise at trace time.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["deinterleave_glu_tensor", "interleave_glu_tensor"]


def _check_args(fn: str, tensor: Tensor, interleave_size: int, dim: int) -> int:
    """``dim`` made non-negative, after checking the arguments; ValueError naming the argument."""
    if not isinstance(tensor, Tensor):
        raise TypeError(f"{fn}: tensor must be a torch.Tensor, got {type(tensor).__name__}")
    for name, value in (("interleave_size", interleave_size), ("dim", dim)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{fn}: {name} must be an int, got {type(value).__name__} {value!r}")
    if interleave_size <= 0:
        raise ValueError(f"{fn}: interleave_size must be positive, got {interleave_size}")
    rank = tensor.dim()
    if rank == 0:
        raise ValueError(
            f"{fn}: tensor must have at least 1 dimension (the GLU dim), got a 0-dim tensor"
        )
    if not -rank <= dim < rank:
        raise ValueError(
            f"{fn}: dim (={dim}) out of range for a {rank}-dim tensor of shape "
            f"{list(tensor.shape)} (expected {-rank} <= dim < {rank})"
        )
    d = dim % rank
    n = tensor.shape[d]
    if n % (2 * interleave_size):
        raise ValueError(
            f"{fn}: tensor.shape[{dim}] (={n}) must be divisible by 2 * interleave_size "
            f"(={2 * interleave_size}): the GLU dim holds 2H rows, H activation and H linear, "
            f"and interleave_size must divide H"
        )
    return d


def _swap_blocks(fn: str, tensor: Tensor, k: int, dim: int, interleave: bool) -> Tensor:
    """View the GLU dim as ``[2, H / k, k]`` (contiguous halves) or ``[H / k, 2, k]``
    (interleaved), swap the two outer factors, copy back to one dim."""
    d = _check_args(fn, tensor, k, dim)
    outer = (2, tensor.shape[d] // (2 * k))
    blocks = tensor.unflatten(d, (*(outer if interleave else outer[::-1]), k)).transpose(d, d + 1)
    # clone, not contiguous(): always a new tensor, also where the swap is a no-op (k = H).
    return blocks.clone(memory_format=torch.contiguous_format).view(tensor.shape)


def interleave_glu_tensor(tensor: Tensor, interleave_size: int, dim: int = 0) -> Tensor:
    """Contiguous halves ``[W_0 .. W_{H-1}, V_0 .. V_{H-1}]`` along ``dim`` to interleaved blocks
    ``[W_0:k, V_0:k, W_k:2k, V_k:2k, ...]`` with ``k = interleave_size`` (module docstring).

    ``tensor.shape[dim]`` (2H) must be divisible by ``2 * interleave_size``; other dims are kept.
    Returns a new contiguous tensor of the same shape, dtype and device."""
    return _swap_blocks("interleave_glu_tensor", tensor, interleave_size, dim, interleave=True)


def deinterleave_glu_tensor(tensor: Tensor, interleave_size: int, dim: int = 0) -> Tensor:
    """Inverse of :func:`interleave_glu_tensor`: interleaved blocks of ``k = interleave_size``
    along ``dim`` back to contiguous halves ``[W_0 .. W_{H-1}, V_0 .. V_{H-1}]``.

    Same requirements and result (a new contiguous tensor) as :func:`interleave_glu_tensor`."""
    return _swap_blocks("deinterleave_glu_tensor", tensor, interleave_size, dim, interleave=False)
