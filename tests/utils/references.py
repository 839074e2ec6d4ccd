"""References written apart from the library, for the op families whose library ``*_ref`` is
also the CPU implementation: norm, activation, quantize, quantize_mx, attention, fused_norm.

On the CPU a library ``*_ref`` in float64 checks the same code as the op in fp32, so a mistake in
the math would pass. The functions here restate each op's definition with another formulation
(``torch.nn.functional`` where it has the op, explicit loops over blocks and masks built element
by element elsewhere), from the docstrings of ``te_compile/functional`` and Transformer Engine's
conventions, not from the library's code. They take an op's own arguments and return its outputs
in the same order: high precision ops in float64 (differentiable, for the gradients), quantisers
bit for bit (their formats are exact definitions).

:data:`REFERENCES` maps each forward op of :data:`FAMILIES` to its reference;
``tests/test_registry.py`` checks that every such op has one and compares the op with it.
Shared pieces: dropout's keep mask is the library's Philox stream
(``functional.dropout_ops.dropout_mask``, an input of the definition, not math).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import torch
import torch.nn.functional as F

from te_compile.functional.dropout_ops import dropout_mask

FAMILIES = ("norm", "activation", "quantize", "quantize_mx", "attention", "fused_norm")

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FLT_MAX = torch.finfo(torch.float32).max
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitudes, in code order
MX_EMAX = {E4M3: 8, E5M2: 15}  # OCP emax_elem: exponent of the format's largest power of two


def _f64(t):
    return None if t is None else t.to(torch.float64)


def _gain(weight, zero_centered_gamma):
    return _f64(weight) + 1 if zero_centered_gamma else _f64(weight)


# Norms ------------------------------------------------------------------------------------------


def layernorm(inp, weight, bias=None, eps=1e-5, zero_centered_gamma=False):
    """``F.layer_norm`` in float64 (gain ``1 + w`` when zero-centred); ``mean`` and
    ``1 / sqrt(biased variance + eps)`` from ``torch.var``."""
    x = _f64(inp)
    out = F.layer_norm(x, x.shape[-1:], _gain(weight, zero_centered_gamma), _f64(bias), eps)
    return out, x.sum(-1) / x.shape[-1], 1 / torch.sqrt(torch.var(x, -1, correction=0) + eps)


def rmsnorm(inp, weight, eps=1e-5, zero_centered_gamma=False):
    """``x / sqrt(sum(x^2) / N + eps) * gain`` in float64 (gain ``1 + w`` when zero-centred)."""
    x = _f64(inp)
    rms = torch.sqrt(torch.einsum("...i,...i->...", x, x) / x.shape[-1] + eps)
    return x / rms[..., None] * _gain(weight, zero_centered_gamma), 1 / rms


def l2normalization(inp, eps=1e-6):
    """``x / sqrt(sum(x^2) + eps)`` in float64."""
    x = _f64(inp)
    norm = torch.sqrt(torch.einsum("...i,...i->...", x, x) + eps)
    return x / norm[..., None], 1 / norm


def branch_rmsnorm(inp, weight, eps=1e-5, zero_centered_gamma=False):
    """``(rmsnorm(x), x)``: the norm of :func:`rmsnorm` and the branch, the input itself."""
    return rmsnorm(inp, weight, eps, zero_centered_gamma)[0], _f64(inp)


# Activations --------------------------------------------------------------------------------


def _gelu(x):
    return F.gelu(x, approximate="tanh")  # Transformer Engine's GELU is the tanh form


def _qgelu(x):
    return x * torch.sigmoid(1.702 * x)


def _srelu(x):
    return F.relu(x) ** 2


ACTIVATION = {"gelu": _gelu, "qgelu": _qgelu, "relu": F.relu, "srelu": _srelu, "silu": F.silu}
# The function each gated activation applies to its activation half.
GATE = {"glu": torch.sigmoid, "geglu": _gelu, "qgeglu": _qgelu, "reglu": F.relu,
        "sreglu": _srelu, "swiglu": F.silu}  # fmt: skip


def _biased(inp, bias):
    return _f64(inp) if bias is None else _f64(inp) + _f64(bias)


def activation(inp, bias, activation):
    """``f(x + b)`` in float64, ``f`` from ``torch.nn.functional`` (gelu: tanh form)."""
    return ACTIVATION[activation](_biased(inp, bias))


def glu_halves(x, glu_interleave_size=0):
    """``(a, l)``: the activation and the linear half of ``x``'s last dim (2H), gathered by
    column index: contiguous halves, or alternating blocks ``[a_0:k, l_0:k, a_k:2k, ...]``."""
    h = x.shape[-1] // 2
    k = glu_interleave_size or max(h, 1)
    j = torch.arange(h, device=x.device)
    a_cols = (j // k) * 2 * k + j % k
    return x[..., a_cols], x[..., a_cols + k]


def gated_activation(inp, bias, activation, glu_interleave_size=0, limit=7.0, alpha=1.702,
                     glu_linear_offset=1.0):  # fmt: skip
    """``f(a) * l`` of ``x + b`` in float64; ``clamped_swiglu``: ``c sigmoid(alpha c)
    (clamp(l, -limit, limit) + offset)`` with ``c = min(a, limit)`` (GPT-OSS); ``situglu``:
    ``b1 tanh(a / b1) sigmoid(a) b2 tanh(l / b2)``, ``b1 = limit``, ``b2 = alpha``."""
    a, lin = glu_halves(_biased(inp, bias), glu_interleave_size)
    if activation == "clamped_swiglu":
        c = a.clamp(max=limit)
        return c / (1 + torch.exp(-alpha * c)) * (lin.clamp(-limit, limit) + glu_linear_offset)
    if activation == "situglu":  # beta1, beta2 in the limit, alpha slots
        return limit * torch.tanh(a / limit) * torch.sigmoid(a) * alpha * torch.tanh(lin / alpha)
    return GATE[activation](a) * lin


# Attention ----------------------------------------------------------------------------------


def _sequences(n_tokens, cu_seqlens, padding):
    """``(seq, pos, lengths)`` of the tokens of one batch entry: the sequence of each token
    (None for padding), its position in that sequence, and each sequence's length."""
    if cu_seqlens is not None:
        bounds = [int(c) for c in cu_seqlens]
        lengths = [b - a for a, b in itertools.pairwise(bounds)]
        seq, pos = [None] * n_tokens, [0] * n_tokens
        for s, (start, end) in enumerate(itertools.pairwise(bounds)):
            for i in range(start, min(end, n_tokens)):
                seq[i], pos[i] = s, i - start
        return seq, pos, lengths
    if padding is None:
        return [0] * n_tokens, list(range(n_tokens)), [n_tokens]
    real = [not bool(p) for p in padding]
    return [0 if r else None for r in real], list(range(n_tokens)), [sum(real)]


def _visibility(b, sq, skv, cu_q, cu_kv, q_padding, kv_padding, window, bottom_right):
    """``(visible [b, 1, sq, skv] bool, distance [b, 1, sq, skv])``, built pair by pair:
    query ``i`` sees key ``j`` of its own sequence with ``i + o - left <= j <= i + o + right``
    (positions in the sequence; ``o``: ``len_kv - len_q`` when ``bottom_right``, else 0);
    ``distance`` is ``|i + o - j|`` (ALiBi's)."""
    left, right = window
    visible = torch.zeros(b, 1, sq, skv, dtype=torch.bool)
    distance = torch.zeros(b, 1, sq, skv, dtype=torch.float64)
    for n in range(b):
        qs, qpos, qlen = _sequences(sq, cu_q, None if q_padding is None else q_padding[n])
        ks, kpos, klen = _sequences(
            skv, cu_q if cu_kv is None else cu_kv, None if kv_padding is None else kv_padding[n]
        )
        for i in range(sq):
            for j in range(skv):
                s = qs[i]
                offset = klen[s] - qlen[s] if (bottom_right and s is not None) else 0
                diag = qpos[i] + offset
                distance[n, 0, i, j] = abs(diag - kpos[j])
                if s is None or ks[j] != s:
                    continue
                if (left < 0 or kpos[j] >= diag - left) and (right < 0 or kpos[j] <= diag + right):
                    visible[n, 0, i, j] = True
    return visible, distance


def attention(query, key, value, bias, alibi_slopes, q_padding, kv_padding, mask, cu_seqlens_q,
              cu_seqlens_kv, rng_state, softmax_offset, scale, window_left, window_right,
              bottom_right, dropout_p, max_seqlen_q, max_seqlen_kv, sbhd):  # fmt: skip
    """``softmax(scale q k^T + bias - m |i + o - j|) v`` in float64 over the keys each query
    sees (masks built pair by pair), the softmax written out; GQA by repeating key/value heads;
    a query that sees no key gives zeros. ``softmax_offset`` (Transformer Engine's attention
    sink): one more key that every query sees, with logit ``softmax_offset[n]`` and a zero
    value. ``(out [b, sq, h, dv], [logsumexp])``, the logsumexp over the keys and the sink,
    ``+inf`` for a query that sees no key (the op's convention)."""
    q, k, v = _f64(query), _f64(key), _f64(value)
    b, sq, h, _ = q.shape
    skv, groups = k.shape[1], h // k.shape[2]
    k, v = k.repeat_interleave(groups, 2), v.repeat_interleave(groups, 2)
    scores = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    window = (window_left, window_right)
    visible, distance = _visibility(
        b, sq, skv, cu_seqlens_q, cu_seqlens_kv, q_padding, kv_padding, window, bottom_right
    )
    if bias is not None:
        scores = scores + _f64(bias)
    if alibi_slopes is not None:
        slopes = alibi_slopes.double().reshape(-1, h)[:, :, None, None]
        scores = scores - slopes * distance
    if mask is not None:
        visible = visible & ~mask.cpu()
    visible = visible.expand(b, h, sq, skv)
    sees = visible.any(-1, keepdim=True)
    if softmax_offset is not None:
        sink = _f64(softmax_offset).cpu().reshape(1, h, 1, 1).expand(b, h, sq, 1)
        scores = torch.cat([scores, sink], -1)
        visible = torch.cat([visible, torch.ones(b, h, sq, 1, dtype=torch.bool)], -1)
    seen = visible.any(-1, keepdim=True)
    top = scores.detach().masked_fill(~visible, -math.inf).amax(-1, keepdim=True)
    top = torch.where(seen, top, 0.0)
    weights = torch.exp((scores - top).masked_fill(~visible, -math.inf))
    total = weights.sum(-1, keepdim=True)
    norm = torch.where(seen, total, 1.0)
    probs = (weights / norm)[..., :skv]  # the sink's column has a zero value: dropped
    lse = torch.where(sees, top + torch.log(norm), math.inf).squeeze(-1)
    if dropout_p > 0:
        probs = probs * dropout_mask(rng_state, probs.shape, dropout_p) / (1 - dropout_p)
    return torch.einsum("bhij,bjhd->bihd", probs, v), [lse]


# FP8 per tensor and 1x128 / 128x128 blocks ----------------------------------------------------


def te_scale(amax: float, fp8_dtype, eps: float = 0.0, pow2: bool = False) -> float:
    """Transformer Engine's compute_scale_from_amax on Python floats: fp8_max / max(amax, eps),
    the quotient rounded once to fp32 (a double quotient of fp32 values rounds correctly); 1 for
    an amax of 0 or inf, FLT_MAX for an overflow, 2^floor(log2) with ``pow2``."""
    if amax < eps:
        amax = eps
    if math.isnan(amax):
        return math.nan
    if amax == 0 or math.isinf(amax):
        return 1.0
    scale = torch.tensor(torch.finfo(fp8_dtype).max / amax, dtype=torch.float32).item()
    if math.isinf(scale):
        scale = FLT_MAX
    if pow2:
        scale = 2.0 ** (math.frexp(scale)[1] - 1)
    return scale


def fp8_cast(x, scale: float, fp8_dtype):
    """``fp32(x) * scale``, clamped to the format's max, rounded by torch's fp8 conversion."""
    fmax = torch.finfo(fp8_dtype).max
    return (x.float() * scale).clamp(-fmax, fmax).to(fp8_dtype)


def fp32_reciprocal(scale: float):
    """``[1 / scale]`` fp32: the double quotient rounded once."""
    return torch.tensor([1.0 / scale], dtype=torch.float32)


def rows(x):
    """``[..., K]`` as fp32 ``[M, K]`` on the CPU."""
    return x.detach().cpu().reshape(math.prod(x.shape[:-1]), x.shape[-1]).float()


def amax_of(x2) -> float:
    return x2.abs().max().item() if x2.numel() else 0.0


def fp8_blocks(x2, fp8_dtype, block_rows, pow2):
    """``(data, scale_inv)`` for ``block_rows x 128`` blocks of ``[M, K]``, block by block; a
    block holding inf gets a NaN scale (it dequantises to NaN), not Transformer Engine's 1."""
    m, k = x2.shape
    data = torch.empty(m, k, dtype=fp8_dtype)
    scale_inv = torch.empty(-(-m // block_rows), -(-k // 128))
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            r, c = slice(i * block_rows, (i + 1) * block_rows), slice(j * 128, (j + 1) * 128)
            amax = amax_of(x2[r, c])
            scale = math.nan if math.isinf(amax) else te_scale(amax, fp8_dtype, pow2=pow2)
            data[r, c] = fp8_cast(x2[r, c], scale, fp8_dtype)
            scale_inv[i, j] = fp32_reciprocal(scale)
    return data, scale_inv


def _none(dtype):
    return torch.empty(0, dtype=dtype)


def quantize_tensorwise(x, scale, fp8_dtype, columnwise):
    """Delayed scaling: ``(data, data_t, amax)``, the given scale applied element by element."""
    x2 = rows(x)
    data = fp8_cast(x2, scale.item(), fp8_dtype)
    data_t = data.t().contiguous() if columnwise else _none(fp8_dtype)
    return data.view(x.shape), data_t, torch.tensor([amax_of(x2)])


def quantize_current(x, fp8_dtype, columnwise, amax_epsilon=0.0, power_2_scale=False):
    """Current scaling: ``(data, data_t, scale_inv, amax)``, the scale from x's own amax."""
    x2 = rows(x)
    scale = te_scale(amax_of(x2), fp8_dtype, amax_epsilon, power_2_scale)
    data = fp8_cast(x2, scale, fp8_dtype)
    data_t = data.t().contiguous() if columnwise else _none(fp8_dtype)
    return data.view(x.shape), data_t, fp32_reciprocal(scale), torch.tensor([amax_of(x2)])


def quantize_blockwise(x, fp8_dtype, block_rows, power_2_scale, columnwise):
    """``(data, scale_inv, data_t, scale_inv_t)``: :func:`fp8_blocks` of ``[M, K]`` and of its
    transpose (128x128 blocks of x^T are x's blocks transposed)."""
    x2 = rows(x)
    data, scale_inv = fp8_blocks(x2, fp8_dtype, block_rows, power_2_scale)
    data_t, scale_inv_t = _none(fp8_dtype), _none(torch.float32)
    if columnwise:
        data_t, scale_inv_t = fp8_blocks(x2.t(), fp8_dtype, block_rows, power_2_scale)
    return data.view(x.shape), scale_inv, data_t, scale_inv_t


def _saturate(codes, y, out_dtype):
    """fp32 ``y`` in ``out_dtype``, products of finite codes saturating at its max."""
    big = torch.finfo(out_dtype).max
    return torch.where(codes.isinf(), y, y.clamp(-big, big)).to(out_dtype)


def dequantize_tensorwise(data, scale_inv, fp8_dtype, out_dtype):
    """``fp32(code) * scale_inv`` in ``out_dtype``, saturating."""
    codes = data.cpu().view(fp8_dtype).float()
    return _saturate(codes, codes * scale_inv.item(), out_dtype)


def dequantize_blockwise(data, scale_inv, block_rows, fp8_dtype, out_dtype):
    """``fp32(code) * scale_inv`` of its ``block_rows x 128`` block, saturating."""
    codes = rows(data.cpu().view(fp8_dtype))
    factor = scale_inv.cpu().repeat_interleave(block_rows, 0).repeat_interleave(128, 1)
    y = codes * factor[: codes.shape[0], : codes.shape[1]]
    return _saturate(codes, y, out_dtype).view(data.shape)


# MXFP8 and NVFP4 --------------------------------------------------------------------------------


def _nearest(t, values, codes):
    """Code of the nearest of ``values`` to each ``|t|`` (numpy float64), ties to the even
    code; with only finite ``values`` this saturates too."""
    dist = np.abs(np.abs(t)[:, None] - values[None, :])
    tie = dist == dist.min(1, keepdims=True)
    return codes[(tie * (2 - (codes & 1))[None, :]).argmax(1)]


def fp8_table(fp8_dtype):
    """(values, codes) of the non-negative finite codes of an fp8 format, as numpy arrays."""
    codes = torch.arange(128, dtype=torch.uint8)
    values = codes.view(fp8_dtype).double()
    keep = values.isfinite()
    return values[keep].numpy(), codes[keep].numpy()


def _signed(t, mag, sign_bit):
    """Codes with the sign of ``t`` (numpy) in bit ``sign_bit``, as a torch uint8 tensor."""
    return torch.from_numpy((np.signbit(t).astype(np.uint8) << sign_bit) | mag)


def mxfp8_rows(x2, fp8_dtype):
    """MXFP8 of the rows of ``x2`` ``[M, K]``, block by block: (data bytes [M, K], E8M0 scale
    [M, ceil(K/32)]): ``X = floor(log2 amax) - emax`` (``math.frexp``), each code the nearest
    value of ``x / 2^X`` (ties even, saturating); a non-finite block: scale 255, codes 0x7F."""
    m, k = x2.shape
    values, codes = fp8_table(fp8_dtype)
    data = torch.zeros(m, k, dtype=torch.uint8)
    scale = torch.zeros(m, -(-k // 32), dtype=torch.uint8)
    for i in range(m):
        for j in range(scale.shape[1]):
            block = x2[i, 32 * j : 32 * j + 32].double().numpy()
            amax = float(np.abs(block).max())
            if not math.isfinite(amax):
                scale[i, j], data[i, 32 * j : 32 * j + 32] = 255, 0x7F
                continue
            floor_log2 = math.frexp(amax)[1] - 1  # amax = m * 2**e, 0.5 <= m < 1
            b = 127 if amax == 0 else min(max(floor_log2 - MX_EMAX[fp8_dtype] + 127, 0), 254)
            t = block / 2.0 ** (b - 127)
            scale[i, j] = b
            data[i, 32 * j : 32 * j + 32] = _signed(t, _nearest(t, values, codes), 7)
    return data, scale


def mxfp8_tiles(x2, fp8_dtype):
    """MXFP8 with one E8M0 scale per 32x32 tile of ``x2`` ``[M, K]`` (finite values), as the
    float64 values it stands for: per tile ``X = floor(log2 amax) - emax``, each element the
    nearest code of ``x / 2^X`` (ties even, saturating) times ``2^X``."""
    m, k = x2.shape
    values, codes = fp8_table(fp8_dtype)
    out = torch.zeros(m, k, dtype=torch.float64)
    for i in range(0, m, 32):
        for j in range(0, k, 32):
            tile = x2[i : i + 32, j : j + 32].double().numpy()
            amax = float(np.abs(tile).max())
            floor_log2 = math.frexp(amax)[1] - 1
            b = 127 if amax == 0 else min(max(floor_log2 - MX_EMAX[fp8_dtype] + 127, 0), 254)
            t = (tile / 2.0 ** (b - 127)).reshape(-1)
            code = _signed(t, _nearest(t, values, codes), 7)
            deq = code.view(fp8_dtype).double() * 2.0 ** (b - 127)
            out[i : i + 32, j : j + 32] = deq.view(tile.shape)
    return out


def nvfp4_global(amax):
    """NVFP4's global encode scale ``min(448 * 6 / amax, FLT_MAX)`` in numpy fp32; 1 for an
    amax of 0, inf or NaN."""
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        amax = np.float32(amax)
        if amax == 0 or not np.isfinite(amax):
            return np.float32(1.0)
        return min(np.float32(2688.0) / amax, np.finfo(np.float32).max)


def _nvfp4_block(block, g):
    """One NVFP4 block (numpy fp32, any shape; its amax finite) under global scale ``g``, in
    Transformer Engine's order of fp32 operations: (E4M3 scale code, its value, E2M1 magnitude
    codes of ``block * encode scale``, that product in float64 for the signs)."""
    e4m3_values, e4m3_codes = fp8_table(E4M3)
    flt_max = np.finfo(np.float32).max
    with np.errstate(over="ignore", divide="ignore"):
        s_exact = min(np.abs(block).max() * (g * np.float32(1 / 6)), np.float32(448.0))
        s_code = _nearest(np.array([s_exact], dtype=np.float64), e4m3_values, e4m3_codes)
        s = np.float32(e4m3_values[e4m3_codes == s_code][0])
        enc = min(np.float32(1) / (s * (np.float32(1) / g)), flt_max) if s else np.float32(0)
        v = (block * enc).astype(np.float64)
    mag = _nearest(v.reshape(-1), np.array(E2M1), np.arange(8, dtype=np.uint8)).reshape(v.shape)
    return int(s_code[0]), s, mag, v


def nvfp4_rows(x2, g):
    """NVFP4 of the rows of ``x2`` ``[M, K]`` with global scale ``g`` (np.float32), block by
    block (:func:`_nvfp4_block`): (packed bytes [M, K/2], E4M3 scale bytes [M, ceil(K/16)])."""
    m, k = x2.shape
    codes = torch.zeros(m, k, dtype=torch.uint8)
    scale = torch.zeros(m, -(-k // 16), dtype=torch.uint8)
    for i in range(m):
        for j in range(scale.shape[1]):
            block = x2[i, 16 * j : 16 * j + 16].float().numpy()
            if not np.isfinite(np.abs(block).max()):
                scale[i, j] = 0x7F  # NaN; codes stay 0
                continue
            scale[i, j], _, mag, v = _nvfp4_block(block, g)
            codes[i, 16 * j : 16 * j + 16] = _signed(v, mag, 3)
    return codes[:, 0::2] | (codes[:, 1::2] << 4), scale


def nvfp4_dequantized(x2, tile_rows=1):
    """The values NVFP4 gives ``x2`` ``[M, K]`` (float64): its global scale from the tensor's
    amax, one E4M3 scale per block of 1 x 16 (``tile_rows=1``) or 16 x 16 (``tile_rows=16``,
    the 2-D weight tiles) elements from the block's amax (:func:`_nvfp4_block`), decoded as
    ``code * scale / global``; no Hadamard transform, round to nearest."""
    x = x2.float().numpy()
    g = nvfp4_global(float(np.abs(x).max()) if x.size else 0.0)
    out = np.zeros(x.shape, dtype=np.float64)
    e2m1 = np.array(E2M1)
    for i in range(0, x.shape[0], tile_rows):
        for j in range(0, x.shape[1], 16):
            _, s, mag, v = _nvfp4_block(x[i : i + tile_rows, j : j + 16], g)
            out[i : i + tile_rows, j : j + 16] = np.where(np.signbit(v), -e2m1[mag], e2m1[mag]) * (
                s / g
            )
    return torch.from_numpy(out)


def quantize_mxfp8(x, fp8_dtype, rowwise, columnwise):
    """``(data, scale, data_t, scale_t)``: :func:`mxfp8_rows` of ``[M, K]`` and of x^T."""
    x2 = rows(x)
    data, scale = _none(fp8_dtype), _none(torch.uint8)
    data_t, scale_t = _none(fp8_dtype), _none(torch.uint8)
    if rowwise:
        data, scale = mxfp8_rows(x2, fp8_dtype)
        data = data.view(fp8_dtype).view(x.shape)
    if columnwise:
        data_t, scale_t = mxfp8_rows(x2.t(), fp8_dtype)
        data_t = data_t.view(fp8_dtype)
    return data, scale, data_t, scale_t


def dequantize_mxfp8(data, scale, fp8_dtype, out_dtype):
    """``code * 2^(s - 127)`` per 32-element block (E8M0 255: NaN), exact, in ``out_dtype``."""
    k = data.shape[-1]
    codes = data.cpu().view(fp8_dtype).reshape(-1, k).double()
    factor = torch.tensor([[math.nan if s == 255 else 2.0 ** (s - 127) for s in row]
                           for row in scale.cpu().tolist()], dtype=torch.float64)  # fmt: skip
    factor = factor.reshape(codes.shape[0], -1).repeat_interleave(32, 1)[:, :k]
    return (codes * factor).float().to(out_dtype).view(data.shape)


def quantize_nvfp4(x, global_amax, rowwise, columnwise):
    """``(data, scale, global_scale, data_t, scale_t)``: :func:`nvfp4_rows` of ``[M, K]`` and of
    x^T with the global scale of x's amax (or ``global_amax``)."""
    x2 = rows(x)
    amax = amax_of(x2) if global_amax is None else global_amax.item()
    g = nvfp4_global(amax)
    e4m3 = torch.float8_e4m3fn
    data, scale = _none(torch.uint8), _none(e4m3)
    data_t, scale_t = _none(torch.uint8), _none(e4m3)
    if rowwise:
        data, scale = nvfp4_rows(x2, g)
        data, scale = data.view(*x.shape[:-1], x.shape[-1] // 2), scale.view(e4m3)
    if columnwise:
        data_t, scale_t = nvfp4_rows(x2.t(), g)
        scale_t = scale_t.view(e4m3)
    return data, scale, torch.tensor(float(g), dtype=torch.float32), data_t, scale_t


def dequantize_nvfp4(data, scale, global_scale, out_dtype):
    """``e2m1(code) * scale`` (exact) divided by the global scale once in fp32, per 16-element
    block; the even element in the low nibble."""
    packed = data.cpu().reshape(-1, data.shape[-1]).long()
    k = 2 * packed.shape[1]
    nibbles = torch.stack([packed & 15, packed >> 4], -1).reshape(-1, k)
    e2m1 = torch.tensor(E2M1, dtype=torch.float64)[nibbles & 7] * (1 - 2 * (nibbles >> 3))
    s = scale.cpu().view(torch.float8_e4m3fn).double().repeat_interleave(16, 1)[:, :k]
    out = (e2m1 * s).float() / global_scale.cpu().float()
    return out.to(out_dtype).view(*data.shape[:-1], k)


# The registry's map -----------------------------------------------------------------------------

REFERENCES = {
    "te::layernorm_fwd": layernorm,
    "te::rmsnorm_fwd": rmsnorm,
    "te::l2normalization_fwd": l2normalization,
    "te::branch_rmsnorm_fwd": branch_rmsnorm,
    "te::activation_fwd": activation,
    "te::gated_activation_fwd": gated_activation,
    "te::attention_fwd": attention,
    "te::quantize_tensorwise": quantize_tensorwise,
    "te::quantize_current": quantize_current,
    "te::quantize_blockwise": quantize_blockwise,
    "te::dequantize_tensorwise": dequantize_tensorwise,
    "te::dequantize_blockwise": dequantize_blockwise,
    "te::quantize_mxfp8": quantize_mxfp8,
    "te::dequantize_mxfp8": dequantize_mxfp8,
    "te::quantize_nvfp4": quantize_nvfp4,
    "te::dequantize_nvfp4": dequantize_nvfp4,
}
