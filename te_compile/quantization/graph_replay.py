"""What a graphed callable does when called: ``make_graphed_callables``' replay side.

:class:`CallSpec` checks every call against the samples, :class:`CapturedGraphs` holds the two
CUDA graphs and their static tensors, :func:`make_replay` makes the graphed function and
:func:`graphed_forward` a graphed module's forward; ``quantization.graph`` builds all of them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["CallSpec", "CapturedGraphs", "graphed_forward", "make_replay", "tensor_outputs"]

_NAME = "make_graphed_callables"


class CallSpec:
    """One callable's sample inputs: the flattened tensor leaves, the static (non-tensor) leaves
    of the keyword arguments, and the structure every call must repeat."""

    def __init__(self, index: int, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        self.index = index
        self.args = tuple(args)
        self.kwargs = dict(kwargs)
        leaves, self.args_spec = tree_flatten(self.args)
        for leaf in leaves:
            if not isinstance(leaf, Tensor):
                raise TypeError(
                    f"{_NAME}: sample_args must hold tensors only; sample_args[{index}] holds "
                    f"{type(leaf).__name__} {leaf!r} (pass other values in sample_kwargs)"
                )
        kw_leaves, self.kwargs_spec = tree_flatten(list(self.kwargs.values()))
        self.statics = [(i, v) for i, v in enumerate(kw_leaves) if not isinstance(v, Tensor)]
        self.tensors = tuple(leaves) + tuple(v for v in kw_leaves if isinstance(v, Tensor))

    def check_devices(self) -> None:
        for t in self.tensors:
            if t.device.type != "cuda":
                raise ValueError(
                    f"{_NAME}: sample_args / sample_kwargs of callable {self.index} must be CUDA "
                    f"tensors, got one on {t.device}"
                )

    def flatten_call(self, args: tuple, kwargs: dict[str, Any], grad: bool) -> tuple[Tensor, ...]:
        """The tensor leaves of a call, checked against the samples (ValueError/TypeError)."""
        where = f"graphed callable {self.index}"
        if set(kwargs) != set(self.kwargs):
            raise TypeError(
                f"{where}: keyword arguments must be those of sample_kwargs "
                f"{sorted(self.kwargs)}, got {sorted(kwargs)}"
            )
        leaves, spec = tree_flatten(tuple(args))
        if spec != self.args_spec:
            raise ValueError(
                f"{where}: positional arguments must have sample_args' structure "
                f"({self.args_spec}), got {spec}"
            )
        kw_leaves, kw_spec = tree_flatten([kwargs[k] for k in self.kwargs])
        if kw_spec != self.kwargs_spec:
            raise ValueError(
                f"{where}: keyword arguments must have sample_kwargs' structure "
                f"({self.kwargs_spec}), got {kw_spec}"
            )
        for i, value in self.statics:
            if type(kw_leaves[i]) is not type(value) or kw_leaves[i] != value:
                raise ValueError(
                    f"{where}: a non-tensor keyword argument must equal its sample_kwargs value "
                    f"{value!r} (it is part of the captured graph), got {kw_leaves[i]!r}"
                )
        tensors = tuple(leaves) + tuple(v for v in kw_leaves if isinstance(v, Tensor))
        for k, (new, old) in enumerate(zip(tensors, self.tensors, strict=True)):
            if not isinstance(new, Tensor):
                raise TypeError(f"{where}: input {k} must be a tensor, got {type(new).__name__}")
            if new.shape != old.shape or new.dtype != old.dtype or new.device != old.device:
                raise ValueError(
                    f"{where}: input {k} must match its sample (shape {tuple(old.shape)}, "
                    f"{old.dtype}, {old.device}) for the graph to replay, got "
                    f"{tuple(new.shape)}, {new.dtype}, {new.device}"
                )
            if grad and new.requires_grad != old.requires_grad:
                raise ValueError(
                    f"{where}: input {k} must have its sample's requires_grad "
                    f"({old.requires_grad}): the backward graph was captured for it, got "
                    f"{new.requires_grad}"
                )
        return tensors


class CapturedGraphs:
    """The graphs of one forward pass and their static tensors: ``surface`` (the samples, then
    the module's parameters) and ``outputs``, what the forward graph reads and writes;
    ``grad_outputs`` / ``grad_inputs`` the backward graph's (None where nothing requires grad);
    ``generation`` counts forward replays (is a backward's forward still there?)."""

    def __init__(
        self, spec: CallSpec, params: tuple[Tensor, ...], training: bool, fwd: Any, bwd: Any
    ) -> None:
        self.spec = spec
        self.params = params
        self.param_state = tuple((p.data_ptr(), p.requires_grad) for p in params)  # at capture
        self.training = training
        self.surface = spec.tensors + params
        self.fwd = fwd  # torch.cuda.CUDAGraph: replay()
        self.bwd = bwd  # the same, or None: captured in eval mode, or no gradient to compute
        self.outputs: tuple[Tensor, ...] = ()
        self.out_spec = None
        self.out_requires_grad: tuple[bool, ...] = ()
        self.grad_outputs: tuple[Tensor | None, ...] = ()
        self.grad_inputs: tuple[Tensor | None, ...] = ()
        self.clone_param_grads = True
        self.generation = 0

    def grad_targets(self) -> tuple[list[Tensor], list[Tensor]]:
        outs = [o for o in self.outputs if o.requires_grad]
        ins = [t for t in self.surface if t.requires_grad]
        return outs, ins

    def replay_forward(self, inputs: Sequence[Tensor]) -> tuple[Tensor, ...]:
        for static, new in zip(self.spec.tensors, inputs, strict=False):
            if static.data_ptr() != new.data_ptr():
                static.copy_(new)
        self.fwd.replay()
        self.generation += 1
        return tuple(o.detach() for o in self.outputs)

    def replay_backward(self, generation: int, grads: Sequence[Tensor | None]) -> tuple:
        if generation != self.generation:
            raise RuntimeError(
                f"graphed callable {self.spec.index}: backward of an earlier call after the "
                "forward graph was replayed again: the tensors that backward needs were "
                "overwritten. Run each call's backward before the next call"
            )
        for static, grad in zip(self.grad_outputs, grads, strict=True):
            if static is not None and grad is not None and static.data_ptr() != grad.data_ptr():
                static.copy_(grad)
            elif static is not None and grad is None:
                static.zero_()
        if self.bwd is not None:
            self.bwd.replay()
        n_user, clone = len(self.spec.tensors), self.clone_param_grads  # params' grads: copies
        return tuple(
            None if g is None else g.detach().clone() if k >= n_user and clone else g.detach()
            for k, g in enumerate(self.grad_inputs)
        )


class _Replay(torch.autograd.Function):
    """Forward: copy the inputs in and replay the forward graph; backward: the backward graph."""

    @staticmethod
    def forward(ctx, graphs: CapturedGraphs, *inputs: Tensor) -> tuple[Tensor, ...]:
        outs = graphs.replay_forward(inputs)
        ctx.graphs = graphs
        ctx.generation = graphs.generation
        frozen = [o for o, rg in zip(outs, graphs.out_requires_grad, strict=True) if not rg]
        ctx.mark_non_differentiable(*frozen)
        return outs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads: Tensor) -> tuple:
        return (None, *ctx.graphs.replay_backward(ctx.generation, grads))


def make_replay(graphs: CapturedGraphs) -> Callable:
    """The graphed function: check the call against the samples and the parameters' storage,
    then replay (through :class:`_Replay` when captured with autograd)."""

    @torch.compiler.disable
    def graphed(*args: Any, **kwargs: Any) -> Any:
        grad = torch.is_grad_enabled() and graphs.training
        inputs = graphs.spec.flatten_call(args, kwargs, grad)
        for p, (ptr, rg) in zip(graphs.params, graphs.param_state, strict=True):
            if p.data_ptr() != ptr:
                raise RuntimeError(
                    f"graphed callable {graphs.spec.index}: a parameter's storage changed since "
                    "capture (the graphs read the old one); update parameters in place "
                    "(optimizer.step, p.copy_), not by assigning new tensors"
                )
            if grad and p.requires_grad != rg:
                raise RuntimeError(
                    f"graphed callable {graphs.spec.index}: a parameter's requires_grad changed "
                    f"since capture ({rg} -> {p.requires_grad}): the backward graph computes the "
                    "gradients of the parameters that required grad then; graph the module again"
                )
        if graphs.training:
            outs = _Replay.apply(graphs, *inputs, *graphs.params)
        else:
            outs = graphs.replay_forward(inputs)
        return tree_unflatten(list(outs), graphs.out_spec)

    return graphed


def graphed_forward(module: nn.Module, training: bool, replay: Callable) -> Callable:
    """A graphed module's forward: ``replay`` in the training mode the graphs were captured in,
    the module's own forward in the other mode."""
    eager_forward = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        if module.training == training:
            return replay(*args, **kwargs)
        return eager_forward(*args, **kwargs)

    forward._te_graphed = True
    return forward


def tensor_outputs(result: Any, spec: CallSpec) -> tuple[list[Tensor], Any]:
    """The flattened outputs of a callable and their structure; TypeError for a non-tensor."""
    outs, out_spec = tree_flatten(result)
    for o in outs:
        if not isinstance(o, Tensor):
            raise TypeError(
                f"{_NAME}: callable {spec.index} must return tensors (or nested tuples, lists or "
                f"dicts of them), got {type(o).__name__}"
            )
    return outs, out_spec
