"""``te_compile.GroupedMLP``: the experts of a mixture-of-experts layer as one module.

``forward(inp, m_splits)``: ``inp`` is ``[sum(m_splits), hidden_size]``, the tokens already
permuted so that each expert's rows are consecutive (``m_splits[e]`` rows for expert ``e``):

.. math::
    y_e = \\mathrm{act}(x_e W^{(1)\\top}_e + b^{(1)}_e)\\, W^{(2)\\top}_e + b^{(2)}_e

as grouped FC1 (``fc1``, a :class:`~te_compile.GroupedLinear` with ``2 * ffn_hidden_size``
outputs for gated activations) -> the activation op -> grouped FC2 (``fc2``). With a device
``m_splits`` nothing syncs with the host and a compiled step does not recompile when the
routing changes. ``forward(inp, m_splits, is_first_microbatch=None)``: passed to both
GroupedLinears (kept FP8 weights under an FP8 autocast, :class:`~te_compile.GroupedLinear`).

GLU layout: by default FC1's outputs are ``[activation half | linear half]`` per expert, as in
Transformer Engine's dense modules. ``glu_interleave_size=k`` stores FC1's rows in blocks of
``k`` activation rows then ``k`` linear rows (the layout grouped kernels that fuse the activation
into the GEMM epilogue want); the activation op reads that layout directly.

Moving a checkpoint between the two layouts, with the GLU utilities (dim 1 of the grouped FC1
weight ``[num_experts, 2 * ffn, hidden]`` and of its bias ``[num_experts, 2 * ffn]`` is the GLU
dim; for the default parameter layout apply them per expert, ``fc1.weight{i}`` with ``dim=0``)::

    state = contiguous_mlp.state_dict()                      # glu_interleave_size=None
    state["fc1.weight"] = te.interleave_glu_tensor(state["fc1.weight"], k, dim=1)
    interleaved_mlp.load_state_dict(state)                   # glu_interleave_size=k

    state = interleaved_mlp.state_dict()
    state["fc1.weight"] = te.deinterleave_glu_tensor(state["fc1.weight"], k, dim=1)
    contiguous_mlp.load_state_dict(state)

(and the same for ``"fc1.bias"`` when ``bias=True``); :func:`convert_glu_layout` does exactly
this for a whole state_dict.

Tensor parallelism (expert tensor parallelism): with a ``tp_group`` (or ``tp_size > 1``) FC1 is
column-parallel and FC2 row-parallel, each rank holding ``ffn_hidden_size / tp_size`` of every
expert's intermediate features; the output is all-reduced over the group. For gated
activations each rank holds its shard of both halves of FC1 (``partition_stride`` 2 in the
contiguous layout; the interleaved layout shards contiguously, and needs
``ffn_hidden_size / tp_size`` to be a multiple of ``glu_interleave_size``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from te_compile import functional as F
from te_compile._checks import check_int
from te_compile.functional.activation import GATED_ACTIVATIONS, MODULE_ACTIVATIONS
from te_compile.functional.glu_layout import deinterleave_glu_tensor, interleave_glu_tensor
from te_compile.functional.grouped_gemm import checked_splits
from te_compile.modules._common import check_bool, check_choice, check_positive
from te_compile.modules.grouped_linear import GroupedLinear
from te_compile.quantization.gemm import check_first_microbatch

__all__ = ["GroupedMLP", "convert_glu_layout"]


class GroupedMLP(nn.Module):
    """Expert MLPs: grouped FC1 -> activation -> grouped FC2.

    Args:
        num_experts: number of experts (groups).
        hidden_size: input and output features.
        ffn_hidden_size: intermediate features (per half, for gated activations).
        activation: any name in ``te.functional.GATED_ACTIVATIONS`` or ``ACTIVATIONS``.
        glu_interleave_size: FC1's GLU layout (gated activations only; None: contiguous halves).
        bias: learn per-expert biases in FC1 and FC2.
        single_grouped_parameter: FC1/FC2 each hold one ``[num_experts, out, in]`` weight.
        params_dtype, device: of the parameters.
        tp_group, tp_size: expert tensor parallelism (see the module docstring);
            ``sequence_parallel=True`` raises, as in :class:`~te_compile.GroupedLinear`.

    Built inside ``te_compile.quantized_model_init``, FC1 and FC2 keep FP8 weights (as
    :class:`~te_compile.GroupedLinear`).
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        ffn_hidden_size: int,
        *,
        activation: str = "swiglu",
        glu_interleave_size: int | None = None,
        bias: bool = False,
        single_grouped_parameter: bool = True,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        sequence_parallel: bool = False,
        tp_group: object = None,
        tp_size: int | None = None,
    ) -> None:
        super().__init__()
        owner = "GroupedMLP"
        check_positive(
            owner,
            num_experts=num_experts,
            hidden_size=hidden_size,
            ffn_hidden_size=ffn_hidden_size,
        )
        check_choice(owner, "activation", activation, MODULE_ACTIVATIONS)
        check_bool(
            owner, bias=bias, single_grouped_parameter=single_grouped_parameter,
            sequence_parallel=sequence_parallel,
        )  # fmt: skip
        if sequence_parallel is True:
            raise ValueError(
                f"{owner}: sequence_parallel=True is not supported (tokens grouped by expert "
                "cannot be gathered along dim 0); shard the tokens in the MoE token dispatcher"
            )
        gated = activation in GATED_ACTIVATIONS
        if glu_interleave_size is not None:
            if not gated:
                raise ValueError(
                    f"GroupedMLP: glu_interleave_size applies to gated activations "
                    f"({', '.join(GATED_ACTIVATIONS)}), not to {activation!r}"
                )
            if (
                isinstance(glu_interleave_size, bool)
                or not isinstance(glu_interleave_size, int)
                or glu_interleave_size <= 0
                or ffn_hidden_size % glu_interleave_size
            ):
                raise ValueError(
                    f"GroupedMLP: glu_interleave_size must be a positive int dividing "
                    f"ffn_hidden_size ({ffn_hidden_size}), got {glu_interleave_size!r}"
                )
        self.num_experts, self.hidden_size, self.ffn_hidden_size = (
            num_experts,
            hidden_size,
            ffn_hidden_size,
        )
        self.activation = activation
        self.glu_interleave_size = glu_interleave_size
        kw = {
            "bias": bias,
            "single_grouped_parameter": single_grouped_parameter,
            "params_dtype": params_dtype,
            "device": device,
        }
        if tp_size is not None:
            check_int("GroupedMLP", 1, tp_size=tp_size)
        parallel = tp_group is not None or (tp_size or 1) > 1
        tp_kw = {"tp_group": tp_group, "tp_size": tp_size}
        fc1_out = 2 * ffn_hidden_size if gated else ffn_hidden_size
        self.fc1 = GroupedLinear(
            num_experts, hidden_size, fc1_out, parallel_mode="column" if parallel else None,
            **kw, **tp_kw,
        )  # fmt: skip
        self.fc2 = GroupedLinear(
            num_experts, ffn_hidden_size, hidden_size, parallel_mode="row" if parallel else None,
            **kw, **tp_kw,
        )  # fmt: skip
        tp = self.fc1.tp
        if glu_interleave_size is not None and (ffn_hidden_size // tp.size) % glu_interleave_size:
            raise ValueError(
                f"GroupedMLP: ffn_hidden_size / tp_size ({ffn_hidden_size} / {tp.size}) must be "
                f"a multiple of glu_interleave_size ({glu_interleave_size}): each rank holds "
                "whole interleaved blocks"
            )
        if gated and glu_interleave_size is None and tp.mode is not None:
            self.fc1.set_partition_stride(2)

    def set_tensor_parallel_group(self, tp_group: object) -> None:
        """Set the group of a module built with ``tp_size > 1`` and no ``tp_group``."""
        self.fc1.set_tensor_parallel_group(tp_group)
        self.fc2.set_tensor_parallel_group(tp_group)

    def forward(
        self,
        inp: Tensor,
        m_splits: Tensor | Sequence[int],
        is_first_microbatch: bool | None = None,
    ) -> Tensor:
        if not isinstance(inp, Tensor):
            raise TypeError(f"GroupedMLP: inp must be a torch.Tensor, got {type(inp).__name__}")
        if is_first_microbatch is not None:
            check_first_microbatch("GroupedMLP", is_first_microbatch)
        # A list becomes a tensor once, not twice; its sum is checked here (free on the host).
        rows = math.prod(inp.shape[:-1]) if inp.dim() >= 2 else None
        splits = checked_splits("GroupedMLP", m_splits, rows, "inp's rows")
        h = self.fc1(inp, splits, is_first_microbatch)
        h = F.bias_activation(h, None, self.activation, self.glu_interleave_size)
        return self.fc2(h, splits, is_first_microbatch)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
            f"ffn_hidden_size={self.ffn_hidden_size}, activation={self.activation}, "
            f"glu_interleave_size={self.glu_interleave_size}"
        )


def convert_glu_layout(
    state_dict: dict[str, Tensor],
    interleave_size: int,
    *,
    to_interleaved: bool,
    prefix: str = "",
) -> dict[str, Tensor]:
    """A copy of a GroupedMLP ``state_dict`` with FC1's GLU rows moved between the contiguous
    and the interleaved layout (``to_interleaved=False``: back). Handles both parameter layouts:
    ``fc1.weight``/``fc1.bias`` (dim 1 is the GLU dim) and ``fc1.weight{i}``/``fc1.bias{i}``
    (dim 0). Other entries are passed through."""
    convert = interleave_glu_tensor if to_interleaved else deinterleave_glu_tensor
    out = dict(state_dict)
    for key, value in state_dict.items():
        if not key.startswith(prefix + "fc1."):
            continue
        name = key[len(prefix) + 4 :]
        if name in ("weight", "bias"):
            out[key] = convert(value, interleave_size, dim=1)
        elif name.removeprefix("weight").isdigit() or name.removeprefix("bias").isdigit():
            out[key] = convert(value, interleave_size, dim=0)
    return out
