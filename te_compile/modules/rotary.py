"""``te_compile.RotaryPositionEmbedding``: the frequency table of rotary position embeddings.

Transformer Engine's module of the same name: ``forward(max_seq_len, offset=0)`` returns
``freqs [max_seq_len, 1, 1, d2]`` (fp32) for :func:`te_compile.apply_rotary_pos_emb`, with
``d2 = int(dim * rotary_percent)`` and frequencies
:math:`\\theta_i = \\mathrm{rotary\\_base}^{-2i/d_2}`. ``inv_freq`` is a buffer in the
``state_dict``, as in Transformer Engine; it is read in fp32 even after ``module.to(bf16)``
(which rounds it). ``device=None``: as in ``Linear`` ("cuda" where present, unless torch's
default device is set).

``rope_scaling`` (a :class:`RopeScaling`, not in Transformer Engine) rescales the frequencies of
checkpoints trained for a longer context than their base RoPE was, with the rules of Hugging
Face configs' ``rope_type``; the frequencies are computed once, in fp32, into ``inv_freq``:

- ``"linear"`` (position interpolation): :math:`\\theta_i / s` for the ``factor`` :math:`s`. This
  is Transformer Engine's ``seq_len_interpolation_factor`` folded into the frequencies, without
  its switch to ``max_seq_len / pretrained_max_position_embeddings`` past the interpolated
  length, which Hugging Face's ``"linear"`` does not make.
- ``"llama3"`` (Llama 3.1 and later): with :math:`L` the ``original_max_position_embeddings``,
  :math:`r_i = L\\theta_i / 2\\pi` the turns frequency :math:`i` makes over that context and
  :math:`a, b` the ``low_freq_factor`` and ``high_freq_factor``, the weight
  :math:`w_i = \\mathrm{clamp}((r_i - a) / (b - a), 0, 1)` keeps fast frequencies
  (:math:`r_i \\ge b`), divides slow ones (:math:`r_i \\le a`) by the ``factor`` :math:`s` and
  blends between: :math:`(1 - w_i)\\,\\theta_i / s + w_i\\,\\theta_i`.
- ``"yarn"`` (YaRN, arXiv:2309.00071; Qwen2.5's long-context configs): the same blend with the
  weight a ramp over the frequency's index instead of its turns, between the indices where
  frequencies make ``beta_fast`` (32) and ``beta_slow`` (1) turns over
  ``original_max_position_embeddings`` (rounded outwards unless ``truncate`` is False), as
  ``transformers`` computes it; and an ``attention_factor`` (default
  :math:`0.1 \\ln s + 1`, or the ratio of ``mscale`` and ``mscale_all_dim``'s) by which
  ``transformers`` multiplies cos and sin, that is every attention logit by its square:
  :attr:`RopeScaling.logit_scale`, which this module leaves to the attention (the converted
  model of ``te.convert`` folds it into each layer's softmax scale).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from te_compile._checks import (
    check_choice,
    check_int,
    check_positive_finite,
    default_device,
    shown,
)
from te_compile.functional.rotary import rotary_frequencies

__all__ = ["RopeScaling", "RotaryPositionEmbedding"]


@dataclass(frozen=True)
class RopeScaling:
    """How :class:`RotaryPositionEmbedding` rescales its frequencies (the module docstring gives
    the math); the fields are those of a Hugging Face config's ``rope_parameters`` /
    ``rope_scaling``. ``rope_type``: ``"linear"`` (``factor`` only), ``"llama3"`` (``factor``
    and the three llama3 numbers; Llama 3.1's are ``factor=8``, ``low_freq_factor=1``,
    ``high_freq_factor=4``, ``original_max_position_embeddings=8192``) or ``"yarn"``
    (``factor``, ``original_max_position_embeddings`` and optionally ``beta_fast``,
    ``beta_slow``, ``mscale``, ``mscale_all_dim``, ``attention_factor``, ``truncate``)."""

    rope_type: str
    factor: float
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool | None = None

    def __post_init__(self) -> None:
        owner = "RopeScaling"
        check_choice(owner, "rope_type", self.rope_type, ("linear", "llama3", "yarn"))
        check_positive_finite(owner, factor=self.factor)
        allowed = {"linear": (), "llama3": _LLAMA3_FIELDS, "yarn": YARN_FIELDS}[self.rope_type]
        for name in dict.fromkeys((*_LLAMA3_FIELDS, *YARN_FIELDS)):
            if name not in allowed and getattr(self, name) is not None:
                kind = "llama3" if name in _LLAMA3_FIELDS else "yarn"
                raise ValueError(
                    f"{owner}: {name} is a field of rope_type={kind!r}, got "
                    f"{shown(getattr(self, name))} with rope_type={self.rope_type!r}"
                )
        if self.rope_type == "linear":
            return
        if self.rope_type == "llama3":
            check_positive_finite(
                owner, low_freq_factor=self.low_freq_factor, high_freq_factor=self.high_freq_factor
            )
        check_int(owner, original_max_position_embeddings=self.original_max_position_embeddings)
        if self.rope_type == "yarn":
            given = {n: getattr(self, n) for n in _YARN_NUMBERS if getattr(self, n) is not None}
            check_positive_finite(owner, **given)
            if not (self.truncate is None or isinstance(self.truncate, bool)):
                raise ValueError(
                    f"{owner}: truncate must be a bool or None, got {shown(self.truncate)}"
                )
            return
        if not self.low_freq_factor < self.high_freq_factor:
            raise ValueError(
                f"{owner}: high_freq_factor must be greater than low_freq_factor (the blend "
                f"between them divides by the difference), got high_freq_factor="
                f"{self.high_freq_factor!r} and low_freq_factor={self.low_freq_factor!r}"
            )

    @property
    def logit_scale(self) -> float:
        """What the scaling multiplies every attention logit by: YaRN's attention factor
        squared (``transformers`` multiplies cos and sin by it), else 1."""
        if self.rope_type != "yarn":
            return 1.0
        factor = self.attention_factor
        if factor is None:

            def m(scale: float) -> float:
                return 1.0 if self.factor <= 1 else 0.1 * scale * math.log(self.factor) + 1.0

            both = self.mscale and self.mscale_all_dim
            factor = m(self.mscale) / m(self.mscale_all_dim) if both else m(1.0)
        return float(factor) ** 2

    def scale(self, inv_freq: Tensor, base: float) -> Tensor:
        """The rescaled frequencies, in ``inv_freq``'s dtype (``base``: the RoPE base they were
        made with)."""
        if self.rope_type == "linear":
            return inv_freq / self.factor
        if self.rope_type == "yarn":
            return self._yarn(inv_freq, base)
        low, high = self.low_freq_factor, self.high_freq_factor
        turns = self.original_max_position_embeddings * inv_freq / (2 * math.pi)
        weight = ((turns - low) / (high - low)).clamp(0.0, 1.0)
        return (1 - weight) * inv_freq / self.factor + weight * inv_freq

    def _yarn(self, inv_freq: Tensor, base: float) -> Tensor:
        dim, length = 2 * inv_freq.numel(), self.original_max_position_embeddings

        def index(turns: float) -> float:  # the pair index whose frequency makes ``turns``
            return dim * math.log(length / (turns * 2 * math.pi)) / (2 * math.log(base))

        low, high = index(self.beta_fast or 32.0), index(self.beta_slow or 1.0)
        if self.truncate is not False:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        high = high + 0.001 if low == high else high
        i = torch.arange(inv_freq.numel(), dtype=torch.float32, device=inv_freq.device)
        keep = 1 - ((i - low) / (high - low)).clamp(0.0, 1.0)  # 1: the original frequency
        return (inv_freq / self.factor * (1 - keep) + inv_freq * keep).to(inv_freq.dtype)


_YARN_NUMBERS = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor")
# yarn's fields past ``factor`` (``te.convert`` reads them from a config by these names)
YARN_FIELDS = ("original_max_position_embeddings", *_YARN_NUMBERS, "truncate")
_LLAMA3_FIELDS = ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


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
    ``[f_0, f_0, f_1, f_1, ...]`` layout of ``apply_rotary_pos_emb(..., interleaved=True)``.
    ``rope_scaling``: a :class:`RopeScaling` applied to the frequencies (None: none)."""

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
        rope_scaling: RopeScaling | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        device = default_device("RotaryPositionEmbedding", device)
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
            ("rope_scaling", rope_scaling,
             rope_scaling is None or isinstance(rope_scaling, RopeScaling),
             "None or a te_compile.RopeScaling"),
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
        self.rope_scaling = rope_scaling
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim
        inv_freq = 1.0 / (rotary_base**exponents)
        if rope_scaling is not None:
            inv_freq = rope_scaling.scale(inv_freq, rotary_base)
        self.register_buffer("inv_freq", inv_freq)

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
        scaling = "" if self.rope_scaling is None else f", rope_scaling={self.rope_scaling}"
        return (
            f"{self.dim}, rotary_base={self.rotary_base}, interleaved={self.interleaved}, "
            f"seq_len_interpolation_factor={self.seq_len_interpolation_factor}{scaling}"
        )
