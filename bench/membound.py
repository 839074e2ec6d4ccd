"""Shared pieces of the memory-bound benchmarks (norms, activations): the copy-bandwidth
yardstick and forward / backward competitors built from one function per competitor.

A memory-bound kernel is judged by the fraction of the *measured* copy bandwidth it reaches
(BENCHMARKS.md): ``copy_bandwidth`` times ``dst.copy_(src)`` on a buffer as large as the case's
traffic, with the same timer, in the same run. A case's ``nbytes`` is the minimum traffic of the
operation (every input read once, every output written once); ``percent_of_copy`` turns a row's
GB/s into that fraction.

Forward rows time ``fn(*inputs)`` with inputs that require grad (the training forward, which
saves what its backward needs). Backward rows run the forward once, outside the timed region,
and time ``out.backward(grad, retain_graph=True)``; the inputs' ``.grad`` are set to None
before every call (outside the timed region), so no accumulation kernel is timed. Repeating a
compiled backward needs ``torch._functorch.config.donated_buffer = False`` (set on import of this
module): buffer donation lets a compiled backward reuse saved tensors' memory, which saves memory,
not time, and forbids ``retain_graph``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch._functorch.config

from bench import harness

torch._functorch.config.donated_buffer = False

__all__ = [
    "backward_competitor",
    "compare",
    "copy_bandwidth",
    "forward_competitor",
    "percent_of_copy",
]


def copy_bandwidth(device: torch.device, nbytes: int, timing: dict) -> float:
    """GB/s of ``dst.copy_(src)`` moving ``nbytes`` (read + write) with the harness's timer."""
    n = max(1, nbytes // 2)
    src = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    t = harness.time_fn(lambda: dst.copy_(src), device=device, **timing)
    return 2 * n / (t.median_ms * 1e-3) / 1e9


def percent_of_copy(result: harness.CaseResult, copy_gbps: float) -> str:
    """A note: each row's GB/s as a percentage of the measured copy bandwidth."""
    parts = [f"{r.name} {100 * r.gbps / copy_gbps:.0f}%" for r in result.rows if r.gbps]
    return f"% of copy bandwidth ({copy_gbps:.0f} GB/s): " + ", ".join(parts)


def _leaves(inputs: Sequence[object]) -> tuple[torch.Tensor, ...]:
    return tuple(t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad)


def forward_competitor(
    fn: Callable[..., torch.Tensor], inputs: Sequence[object], baseline: str | None = None
) -> harness.Competitor:
    """Times ``fn(*inputs)`` (grad mode on, inputs requiring grad)."""
    return harness.Competitor(fn=lambda: fn(*inputs), baseline=baseline)


def backward_competitor(
    fn: Callable[..., torch.Tensor],
    inputs: Sequence[object],
    grad: torch.Tensor,
    baseline: str | None = None,
) -> harness.Competitor:
    """Times ``fn(*inputs).backward(grad)``'s backward alone (the forward runs once, here)."""
    out = fn(*inputs)
    if out.shape != grad.shape:
        raise ValueError(f"backward_competitor: output {tuple(out.shape)} vs grad {grad.shape}")

    def step() -> None:
        out.backward(grad, retain_graph=True)

    return harness.Competitor(fn=step, grad_to_none=_leaves(inputs), baseline=baseline)


def compare(impls: dict[str, tuple[Callable[..., torch.Tensor], Sequence[torch.Tensor]]],
            grad: torch.Tensor) -> str:  # fmt: skip
    """A note: max relative difference (max |a - r| / max |r|) of the output and of the input
    gradients to the first implementation's; each value is ``impls[name] = (fn, inputs)``. Where
    a competitor takes its inputs split differently (Liger's SwiGLU takes the two halves of a
    gated input as two tensors), its gradients are compared concatenated along the last dim.
    Also the first (compiling) call of each implementation."""
    results = {}
    for name, (fn, inputs) in impls.items():
        leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
        out = fn(*leaves)
        out.backward(grad)
        results[name] = (out.detach(), [t.grad for t in leaves if t.requires_grad])
    ref_name, (ref_out, ref_grads) = next(iter(results.items()))
    parts = []
    for name, (out, grads) in results.items():
        if name == ref_name:
            continue
        pairs = [(out, ref_out)]
        if len(grads) == len(ref_grads):
            pairs += list(zip(grads, ref_grads, strict=True))
        else:
            pairs.append((torch.cat(grads, -1), torch.cat(ref_grads, -1)))
        errs = [
            (a.float() - r.float()).abs().max() / r.float().abs().max().clamp_min(1e-30)
            for a, r in pairs
        ]
        parts.append(f"{name} " + "/".join(f"{e.item():.1e}" for e in errs))
    return f"max rel. diff vs {ref_name} (out, then input grads): " + "; ".join(parts)
