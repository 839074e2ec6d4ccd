"""``te_compile.RotaryPositionEmbedding``: the frequency table of rotary position embeddings.

Transformer Engine's module of the same name: ``forward(max_seq_len, offset=0)`` returns
``freqs [max_seq_len, 1, 1, d2]`` (fp32) for :func:`te_compile.apply_rotary_pos_emb`, with
``d2 = int(dim * rotary_percent)`` and frequencies
:math:`\\theta_i = \\mathrm{rotary\\_base}^{-2i/d_2}`. ``inv_freq`` is a buffer in the
``state_dict``, as in Transformer Engine; it is read in fp32 even after ``module.to(bf16)``
(which rounds it). ``device=None`` means torch's current default device.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from te_compile._checks import check_device
from te_compile.functional.rotary import rotary_frequencies

__all__ = ["RotaryPositionEmbedding"]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class RotaryPositionEmbedding(nn.Module):
    """Rotary position embedding frequencies (Su et al., arXiv:2104.09864).

    ``dim``: the head dim the embedding is for; ``rotary_percent``: the fraction of it rotated
    (``d2 = int(dim * rotary_percent)``, which must be even). ``seq_len_interpolation_factor``
    and ``pretrained_max_position_embeddings``: position interpolation, applied when both are
    given (see :func:`te_compile.functional.rotary.rotary_frequencies`). ``interleaved``: the
    ``[f_0, f_0, f_1, f_1, ...]`` layout of ``apply_rotary_pos_emb(..., interleaved=True)``."""

    inv_freq: Tensor

    def __init__(
        self,
        dim: int,
        rotary_percent: float = 1.0,
        seq_len_interpolation_factor: float | None = None,
        pretrained_max_position_embeddings: int | None = None,
        rotary_base: float = 10000.0,
        interleaved: bool = False,
        *,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        check_device("RotaryPositionEmbedding", "device", device)
        factor, pretrained = seq_len_interpolation_factor, pretrained_max_position_embeddings
        for name, value, ok, expected in (
            ("dim", dim, _is_int(dim) and dim > 0, "a positive int"),
            ("rotary_percent", rotary_percent,
             _is_number(rotary_percent) and 0 < rotary_percent <= 1, "a float in (0, 1]"),
            ("seq_len_interpolation_factor", factor,
             factor is None or (_is_number(factor) and 0 < factor < math.inf),
             "None or a positive number (finite)"),
            ("pretrained_max_position_embeddings", pretrained,
             pretrained is None or (_is_int(pretrained) and pretrained > 0),
             "None or a positive int"),
            ("rotary_base", rotary_base, _is_number(rotary_base) and 0 < rotary_base < math.inf,
             "a positive number (finite)"),
            ("interleaved", interleaved, isinstance(interleaved, bool), "a bool"),
        ):  # fmt: skip
            if not ok:
                raise ValueError(
                    f"RotaryPositionEmbedding: {name} must be {expected}, got {value!r}"
                )
        rotary_dim = int(dim * rotary_percent) if rotary_percent < 1.0 else dim
        if rotary_dim < 2 or rotary_dim % 2:
            raise ValueError(
                f"RotaryPositionEmbedding: int(dim * rotary_percent) must be an even number >= 2 "
                f"(channels rotated in pairs), got {rotary_dim} from dim={dim}, "
                f"rotary_percent={rotary_percent}"
            )
        self.dim = rotary_dim
        self.rotary_percent = rotary_percent
        self.seq_len_interpolation_factor = factor
        self.pretrained_max_position_embeddings = pretrained
        self.rotary_base = rotary_base
        self.interleaved = interleaved
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim
        self.register_buffer("inv_freq", 1.0 / (rotary_base**exponents))

    def forward(self, max_seq_len: int, offset: int = 0) -> Tensor:
        """``freqs [max_seq_len, 1, 1, d2]`` (fp32) for positions ``offset ..``."""
        return rotary_frequencies(
            self.inv_freq,
            max_seq_len,
            offset,
            interleaved=self.interleaved,
            seq_len_interpolation_factor=self.seq_len_interpolation_factor,
            pretrained_max_position_embeddings=self.pretrained_max_position_embeddings,
        )

    def extra_repr(self) -> str:
        return (
            f"{self.dim}, rotary_base={self.rotary_base}, interleaved={self.interleaved}, "
            f"seq_len_interpolation_factor={self.seq_len_interpolation_factor}"
        )
