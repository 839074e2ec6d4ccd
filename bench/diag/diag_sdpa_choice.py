"""Which fused kernel SDPA's dispatcher picks (``torch._fused_sdp_choice``) for the attention
inputs of ``bench_block --arch layer`` in the layouts they reach the attention op: ``bshd`` (a
plain PyTorch model's transposed projections), ``sbhd`` (TransformerLayer's default), and
``sbhd`` with ``v`` a slice of the fused QKV projection's output (what the layer passes: RoPE
makes q and k new tensors, v stays a view). On real and on fake CUDA tensors (what the op's
fake sees under ``torch.compile``), and why cuDNN is not picked where it is not
(``can_use_cudnn_attention(debug=True)``'s warnings). Then the kernels a small GQA + RoPE
``te.TransformerLayer``'s attention op plans, eager and compiled.

    python -m bench.diag.diag_sdpa_choice      # CUDA
"""

from __future__ import annotations

import sys
import warnings

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.backends.cuda import SDPAParams, can_use_cudnn_attention
from torch.nn.attention import SDPBackend

B, S, H, HK, D = 2, 2048, 32, 8, 128


def _inputs(layout: str) -> tuple[torch.Tensor, ...]:
    """q, k, v as ``[b, h, s, d]`` views."""
    kw = {"device": "cuda", "dtype": torch.bfloat16}
    if layout == "bshd":
        q, k, v = (torch.randn(B, S, n, D, **kw) for n in (H, HK, HK))
    else:
        q, k, v = (torch.randn(S, B, n, D, **kw).transpose(0, 1) for n in (H, HK, HK))
        if layout == "sbhd, v a view":
            qkv = torch.randn(S, B, (H + 2 * HK) * D, **kw)
            v = qkv[..., (H + HK) * D :].view(S, B, HK, D).transpose(0, 1)
    return tuple(x.transpose(1, 2) for x in (q, k, v))


def main() -> int:
    names = {b.value: name for name, b in SDPBackend.__members__.items()}
    print(f"{torch.cuda.get_device_name()} · torch {torch.__version__} · cuDNN "
          f"{torch.backends.cudnn.version()}")  # fmt: skip
    for layout in ("bshd", "sbhd", "sbhd, v a view"):
        q, k, v = _inputs(layout)
        real = torch._fused_sdp_choice(q, k, v, None, 0.0, True, enable_gqa=True)
        with FakeTensorMode() as mode:
            fq, fk, fv = (mode.from_tensor(x) for x in (q, k, v))
            fake = torch._fused_sdp_choice(fq, fk, fv, None, 0.0, True, enable_gqa=True)
        strides = [tuple(x.stride()) for x in (q, k, v)]
        print(f"{layout}: real {names[real]}, fake {names[fake]}; strides {strides}")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ok = can_use_cudnn_attention(SDPAParams(q, k, v, None, 0.0, True, True), True)
        print(f"  can_use_cudnn_attention: {ok}; " + " | ".join(str(w.message) for w in caught))
    _layer_plans()
    return 0


def _layer_plans() -> None:
    import importlib

    import te_compile as te

    attention = importlib.import_module("te_compile.functional.attention")
    seen: list[str] = []
    plan = attention._plan

    def recording(a):
        p = plan(a)
        seen.append(p.kind)
        return p

    attention._plan = recording
    layer = te.TransformerLayer(
        1024, 4096, 8, num_gqa_groups=2, hidden_dropout=0.0, attention_dropout=0.0,
        normalization="RMSNorm", activation="swiglu", params_dtype=torch.bfloat16, device="cuda",
    )  # fmt: skip
    x = torch.randn(512, 2, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    freqs = te.RotaryPositionEmbedding(128, device="cuda")(512)
    layer(x, rotary_pos_emb=freqs).sum().backward()
    print(f"layer eager: {seen}")
    seen.clear()
    torch.compile(layer, fullgraph=True)(x, rotary_pos_emb=freqs).sum().backward()
    print(f"layer compiled (trace time and run): {seen}")


if __name__ == "__main__":
    sys.exit(main())
