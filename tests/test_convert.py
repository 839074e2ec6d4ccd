"""te.convert.from_hf: a Hugging Face Llama / Mistral / Qwen2 as a TransformerLayer stack (random
weights from a small config, no download)."""

from __future__ import annotations

import pytest
import torch

import te_compile as te
from tests.utils import assert_close, compile_counted

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install 'te-compile[hf]')"
)

SMALL = {
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}


def _hf(kind: str, **extra):
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[kind]
    torch.manual_seed(0)
    config = config_cls(**SMALL, **extra)
    config._attn_implementation = "eager"
    model = model_cls(config).eval()
    with torch.no_grad():  # norms away from 1, so a misplaced norm weight shows
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.mark.parametrize(
    ("kind", "extra"),
    [
        ("llama", {}),
        ("llama", {"tie_word_embeddings": True}),
        ("mistral", {"sliding_window": None}),
        ("qwen2", {}),
    ],
)
def test_logits_match_the_hugging_face_model(kind, extra):
    hf = _hf(kind, **extra)
    ours = te.convert.from_hf(hf).eval()
    ids = torch.randint(0, SMALL["vocab_size"], (2, 12))
    with torch.no_grad():
        expected = hf(ids).logits
        actual = ours(ids)
    assert actual.shape == expected.shape
    assert_close(actual, expected.double(), torch.float32, roundings=64)


def test_bf16_logits_within_bf16_tolerance():
    hf = _hf("llama").to(torch.bfloat16)
    ours = te.convert.from_hf(hf).eval()
    ids = torch.randint(0, SMALL["vocab_size"], (2, 12))
    with torch.no_grad():
        expected = _hf("llama")(ids).logits.double()  # the fp32 model as the reference
        actual = ours(ids)
    assert actual.dtype is torch.bfloat16
    err = (actual.double() - expected).norm() / expected.norm()
    assert err < 2e-2, err


def test_converted_model_trains_compiled_without_breaks():
    ours = te.convert.from_hf(_hf("llama")).train()
    opt = torch.optim.SGD(ours.parameters(), lr=1e-2)

    def step(ids):
        logits = ours(ids[:, :-1])
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())

    compiled, counter = compile_counted(step)
    losses = []
    for _ in range(4):
        ids = torch.randint(0, SMALL["vocab_size"], (2, 17))
        loss = compiled(ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert counter.frame_count == 1
    assert all(torch.isfinite(torch.tensor(losses)))


def test_unsupported_models_are_refused():
    with pytest.raises(ValueError, match="model_type"):
        te.convert.from_hf(torch.nn.Linear(2, 2))
    hf = _hf("llama", rope_scaling={"rope_type": "linear", "factor": 2.0})
    with pytest.raises(ValueError, match="rope"):
        te.convert.from_hf(hf)
