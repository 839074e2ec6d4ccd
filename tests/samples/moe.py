"""Sample inputs of the MoE permutation ops (``te_compile/functional/moe.py``)."""

from __future__ import annotations

import torch
from torch import Tensor

from te_compile.functional.moe import make_row_id_map
from tests.samples import SampleInput


def _routing(tokens: int, k: int, experts: int, device) -> tuple[Tensor, Tensor]:
    """Top-``k`` distinct experts per token (int32 indices) and the same routing as a mask."""
    index = torch.rand(tokens, experts, device=device).topk(k, dim=1).indices.to(torch.int32)
    mask = torch.zeros(tokens, experts, dtype=torch.bool, device=device)
    return index, mask.scatter_(1, index.long(), True)


def _permute_samples(device: torch.device):
    tokens, experts, hidden = 7, 4, 6
    inp = torch.randn(tokens, hidden, device=device, requires_grad=True)
    index, mask = _routing(tokens, 2, experts, device)
    n = tokens * 2
    yield SampleInput((inp, mask, None, n, "mask"))
    probs = torch.rand(tokens, experts, device=device) * mask
    probs[0, index[0, 0]] = 0.0  # a padding slot
    yield SampleInput((inp, mask.int(), probs, n, "mask"))
    yield SampleInput((inp.detach().bfloat16().requires_grad_(), index, None, n, "index"))
    yield SampleInput((inp, index.long(), None, n - 3, "index"))  # the last 3 rows dropped


def _unpermute_samples(device: torch.device):
    tokens, experts, hidden = 7, 4, 6
    index, mask = _routing(tokens, 2, experts, device)
    mask_map = make_row_id_map(mask, tokens * 2, "mask")
    index_map = make_row_id_map(index, tokens * 2 - 3, "index")  # 3 rows dropped

    def rows(n, dtype=torch.float32):
        return torch.randn(n, hidden, device=device, dtype=dtype, requires_grad=True)

    def probs(shape):
        return torch.rand(*shape, device=device, requires_grad=True)

    yield SampleInput((rows(tokens * 2), mask_map, None))
    yield SampleInput((rows(tokens * 2), mask_map, probs((tokens, experts))))
    yield SampleInput((rows(tokens * 2 - 3, torch.bfloat16), index_map, probs((tokens, 2))))
    yield SampleInput((rows(tokens * 2 - 3), index_map, None))


def _sort_samples(device: torch.device):
    def ints(*values):
        return torch.tensor(values, dtype=torch.int32, device=device)

    inp = torch.randn(10, 5, device=device, requires_grad=True)
    yield SampleInput((inp, ints(3, 0, 4, 3), ints(2, 0, 3, 1), None))
    probs = torch.rand(10, device=device)
    yield SampleInput((inp.detach().half().requires_grad_(), ints(4, 6), ints(1, 0), probs))
    yield SampleInput((inp, ints(2, 5).long(), ints(1, 0).long(), None))  # 3 rows past the chunks
