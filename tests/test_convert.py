"""te.convert.from_hf: a Hugging Face Llama / Mistral / Qwen2 as a TransformerLayer stack (random
weights from a small config, no download): logits, RoPE scaling, tied embeddings, training
compiled, refusals."""

from __future__ import annotations

import re

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
# Llama 3.1's rule on the small model's head dim of 16: with an original context of 32 positions,
# of its 8 frequencies one is kept, one blended and six divided by the factor
# (tests/functional/test_rotary.py checks the frequencies themselves).
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
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


@pytest.mark.parametrize(
    ("kind", "extra"),
    [
        ("llama", {"rope_scaling": LLAMA3, "tie_word_embeddings": True}),  # Llama 3.2 1B / 3B
        ("llama", {"rope_scaling": LLAMA3, "rope_theta": 500000.0}),  # Llama 3.1 / 3.3
        ("qwen2", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
        ("mistral", {"rope_scaling": LLAMA3, "sliding_window": None}),
    ],
)
def test_rope_scaled_logits_match_in_float64(kind, extra):
    """The float64 models, over 40 positions (past the original context of 32). Both compute the
    rotary angles in fp32 whatever the model's dtype (transformers its cos and sin too), so
    fp32's tolerance bounds the comparison."""
    hf = _hf(kind, **extra).double()
    ours = te.convert.from_hf(hf).eval()
    ids = torch.randint(0, SMALL["vocab_size"], (2, 40))
    with torch.no_grad():
        expected = hf(ids).logits
        actual = ours(ids)
    assert actual.dtype is torch.float64
    assert_close(actual, expected, torch.float32)


def test_tied_embeddings_stay_one_parameter_through_training():
    hf = _hf("llama", tie_word_embeddings=True)
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    ours = te.convert.from_hf(hf, dtype=torch.float64).train()
    assert ours.lm_head.weight is ours.embed_tokens.weight
    names = [name for name, _ in ours.named_parameters()]
    assert "embed_tokens.weight" in names and "lm_head.weight" not in names
    before = ours.embed_tokens.weight.detach().clone()
    opt = torch.optim.SGD(ours.parameters(), lr=0.1)
    ids = torch.randint(0, SMALL["vocab_size"], (2, 9))
    logits = ours(ids[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
    opt.step()
    assert ours.lm_head.weight is ours.embed_tokens.weight
    assert not torch.equal(ours.embed_tokens.weight, before)


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


@pytest.mark.parametrize(
    ("rope_scaling", "match"),
    [
        ({"rope_type": "dynamic", "factor": 2.0}, r"\['rope_type'\] = 'dynamic' is not supported"),
        (
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
            r"\['rope_type'\] = 'yarn' is not supported",
        ),
        ({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5},
         "partial_rotary_factor must be 1.0, got 0.5"),
        ({**LLAMA3, "low_freq_factor": 4.0},
         "high_freq_factor must be greater than low_freq_factor"),
    ],
)  # fmt: skip
def test_unsupported_rope_is_refused_by_field_and_value(rope_scaling, match):
    hf = _hf("llama", rope_scaling=rope_scaling)
    with pytest.raises(ValueError, match=match) as info:
        te.convert.from_hf(hf)
    assert re.search(r"config\.rope_(parameters|scaling)", str(info.value))  # transformers 5 | 4
