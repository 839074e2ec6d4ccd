"""Sample inputs of ``te::attention_fwd`` (``te_compile/functional/attention.py``)."""

from __future__ import annotations

import torch

from tests.samples import SampleInput, sample_tensor


def _samples(device: torch.device):
    """Small odd shapes covering each mask family, GQA and MQA, cross attention, bias, ALiBi,
    padding, sliding windows, packed ``thd``, sink softmaxes and (CPU only) dropout."""

    t = sample_tensor(device)

    def call(q, k, v, window, bottom_right=True, sbhd=False, p=0.0, **tensors):
        names = ("bias", "slopes", "q_pad", "kv_pad", "mask", "cu_q", "cu_kv", "rng", "sink")
        extra = tuple(tensors.get(name) for name in names)
        scale = q.shape[-1] ** -0.5
        return SampleInput(
            (q, k, v, *extra, scale, *window, bottom_right, p, q.shape[1], k.shape[1], sbhd)
        )

    def padding(s, lengths):
        return torch.arange(s, device=device)[None] >= torch.tensor(lengths, device=device)[:, None]

    bf16 = torch.bfloat16
    # causal top-left, GQA 4:2, results laid out sbhd
    yield call(t(2, 5, 4, 8), t(2, 5, 2, 8), t(2, 5, 2, 8), (-1, 0), False, sbhd=True)
    # causal bottom-right, cross attention with sq < skv, MQA, bf16
    yield call(t(2, 3, 4, 8, dtype=bf16), t(2, 6, 1, 8, dtype=bf16), t(2, 6, 1, 8, dtype=bf16),
               (-1, 0))  # fmt: skip
    # no mask, post-scale bias with a gradient, v's head dim != q's
    yield call(t(1, 4, 2, 6), t(1, 6, 2, 6), t(1, 6, 2, 10), (-1, -1), bias=t(1, 2, 4, 6))
    # padding, sliding window, per-batch ALiBi; diagonal bottom-right per sequence
    slopes = torch.tensor([[0.5, 0.25], [0.125, 1.0]], device=device)
    yield call(t(2, 6, 2, 8), t(2, 7, 2, 8), t(2, 7, 2, 8), (2, 1), slopes=slopes,
               q_pad=padding(6, [4, 6]), kv_pad=padding(7, [7, 3]))  # fmt: skip
    # arbitrary mask per head, with a row that sees no key
    mask = torch.rand(2, 3, 5, 4, device=device) < 0.4
    mask[0, 1, 2] = True
    yield call(t(2, 5, 3, 8), t(2, 4, 3, 8), t(2, 4, 3, 8), (-1, -1), mask=mask)
    # packed thd: uneven sequences, two padding tokens at the end, padding_causal, GQA
    cu = torch.tensor([0, 3, 4, 8], dtype=torch.int32, device=device)
    yield call(t(1, 10, 4, 8), t(1, 10, 2, 8), t(1, 10, 2, 8), (-1, 0), False, cu_q=cu)
    # learnable sink (its gradient), padding with padded queries, GQA, cross attention
    sink = torch.tensor([0.5, -1.0, 2.0, 0.0], device=device, requires_grad=True)
    yield call(t(2, 5, 4, 8), t(2, 6, 2, 8), t(2, 6, 2, 8), (-1, 0), sink=sink,
               q_pad=padding(5, [3, 5]), kv_pad=padding(6, [6, 2]))  # fmt: skip
    # off-by-one sink (zero logits), an arbitrary mask with a row that sees no key, bf16
    mask = torch.rand(1, 2, 4, 5, device=device) < 0.3
    mask[0, 0, 1] = True
    yield call(t(1, 4, 2, 8, dtype=bf16), t(1, 5, 2, 8, dtype=bf16), t(1, 5, 2, 8, dtype=bf16),
               (-1, -1), mask=mask, sink=torch.zeros(2, device=device))  # fmt: skip
    if device.type == "cpu":  # CUDA's kernels draw their own Philox state (attention_cuda)
        rng = torch.tensor([1234, 5], dtype=torch.int64, device=device)
        yield call(t(2, 5, 2, 8), t(2, 5, 2, 8), t(2, 5, 2, 8), (-1, 0), False, p=0.25, rng=rng)
        sink = torch.tensor([1.0, -0.5], device=device, requires_grad=True)
        yield call(t(2, 5, 2, 8), t(2, 5, 2, 8), t(2, 5, 2, 8), (-1, 0), False, p=0.25, rng=rng,
                   sink=sink)  # fmt: skip
