"""te.convert.from_hf / to_hf: a Hugging Face Llama / Mistral / Qwen2 as a TransformerLayer stack
(random weights from a small config, no download): logits, RoPE scaling, tied embeddings, training
compiled, a Hugging Face loop's arguments (padded batches, positions, labels), the way back,
refusals."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

import te_compile as te
from te_compile.convert import _default_dtype as default_dtype
from tests.utils import assert_close, behaviour_backend, compile_counted

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
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}


def _hf(kind: str, dtype: torch.dtype = torch.float32, **extra):
    """The small model, built as ``from_pretrained(dtype=dtype)`` builds one: parameters in
    ``dtype``, the rotary frequencies float32 (``model.to(dtype)`` would round them)."""
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[kind]
    torch.manual_seed(0)
    config = config_cls(**SMALL, **extra)
    config._attn_implementation = "eager"
    with default_dtype(dtype):
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
        ("qwen2", {"rope_scaling": YARN}),  # Qwen2.5's long-context config
        ("llama", {"rope_scaling": {**YARN, "beta_fast": 8, "attention_factor": 1.3}}),
        ("llama", {"rope_scaling": {**YARN, "mscale": 2.0, "mscale_all_dim": 1.0,
                                    "truncate": False}}),
    ],
)  # fmt: skip
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
    reference = _hf("llama")  # the fp32 model
    hf = _hf("llama", torch.bfloat16)
    # Its weights, rounded: random init draws different numbers per dtype on some torch builds.
    hf.load_state_dict(reference.state_dict())
    ours = te.convert.from_hf(hf).eval()
    ids = torch.randint(0, SMALL["vocab_size"], (2, 12))
    with torch.no_grad():
        expected = reference(ids).logits.double()
        actual = ours(ids)
    assert actual.dtype is torch.bfloat16
    err = (actual.double() - expected).norm() / expected.norm()
    assert err < 2e-2, err


def test_rotary_frequencies_stay_float32_both_ways():
    """``model.to(torch.bfloat16)`` rounds a transformers model's rotary ``inv_freq`` to bf16
    (angles off by up to 2^-9 of the position): from_hf says so, and to_hf builds its model as
    from_pretrained does, with float32 frequencies, equal to those of the model built in bf16."""
    built = _hf("llama", torch.bfloat16)
    assert built.model.rotary_emb.inv_freq.dtype is torch.float32
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours = te.convert.from_hf(built)  # float32 frequencies: no warning
    with pytest.warns(UserWarning, match=r"rotary frequencies \(model\.rotary_emb\.inv_freq\) "
                      r"are torch\.bfloat16"):  # fmt: skip
        te.convert.from_hf(_hf("llama").to(torch.bfloat16))
    back = te.convert.to_hf(ours)
    assert torch.get_default_dtype() is torch.float32
    assert back.model.embed_tokens.weight.dtype is torch.bfloat16
    assert torch.equal(back.model.rotary_emb.inv_freq, built.model.rotary_emb.inv_freq)
    ids = torch.randint(0, SMALL["vocab_size"], (2, 12))
    with torch.no_grad():
        assert torch.equal(back.eval()(ids).logits, built(ids).logits)


def test_converted_model_trains_compiled_without_breaks():
    ours = te.convert.from_hf(_hf("llama")).train()
    opt = torch.optim.SGD(ours.parameters(), lr=1e-2)

    def step(ids):
        logits = ours(ids[:, :-1])
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())

    compiled, counter = compile_counted(step, backend=behaviour_backend())
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


# A Hugging Face loop's batch: a left-padded row, a right-padded row and a full one.
MASK = torch.ones(3, 11, dtype=torch.long)
MASK[0, :3] = 0
MASK[1, 7:] = 0
KEEP = MASK.bool()


def _hf64(kind: str, **extra):
    """The float64 model with transformers' sdpa attention: its eager attention gives a row that
    sees no key (a left-padded row's padding) NaN in float64, which the next layer spreads over
    the row."""
    hf = _hf(kind, **extra).double()
    hf.config._attn_implementation = "sdpa"
    return hf


PADDED_MODELS = [
    ("llama", {}),
    ("llama", {"tie_word_embeddings": True, "rope_scaling": LLAMA3}),
    ("mistral", {"sliding_window": 4}),
    ("qwen2", {}),
]


@pytest.mark.parametrize(("kind", "extra"), PADDED_MODELS)
def test_padded_batch_logits_and_loss_match(kind, extra):
    """Left and right padding: the logits at the unpadded tokens, and the loss of labels that
    ignore the padding. transformers computes the rotary angles in fp32 and the loss in fp32,
    so fp32's tolerance bounds the comparison."""
    hf = _hf64(kind, **extra)
    ours = te.convert.from_hf(hf).eval()
    ids = torch.randint(0, SMALL["vocab_size"], MASK.shape)
    labels = ids.masked_fill(~KEEP, -100)
    with torch.no_grad():
        expected = hf(ids, attention_mask=MASK, labels=labels)
        actual = ours(input_ids=ids, attention_mask=MASK, labels=labels)
    assert isinstance(actual, te.convert.CausalLMOutput)
    assert actual.logits.isfinite().all()  # the padding's rows too: they feed the next layer
    assert_close(actual.logits[KEEP], expected.logits[KEEP], torch.float32)
    assert_close(actual.loss, expected.loss.double(), torch.float32)
    with torch.no_grad():  # a bool mask reads as transformers' (True = attend)
        assert torch.equal(ours(ids, attention_mask=KEEP), actual.logits)


def test_position_ids_match_per_row_and_shared():
    """``[b, s]`` runs row by row, ``[1, s]`` serves the batch. A shift of every position of a
    row changes nothing (RoPE sees differences, and a left-padded batch's ``cumsum(mask) - 1``
    is one), so the positions here are stretched, by a factor of each row's own. The mask is
    given: without it transformers would read positions that do not step by one as packed
    sequences."""
    hf = _hf64("llama", rope_scaling=LLAMA3)
    ours = te.convert.from_hf(hf).eval()
    ids = torch.randint(0, SMALL["vocab_size"], MASK.shape)
    per_row = (MASK.cumsum(-1) - 1).masked_fill(~KEEP, 1) * torch.tensor([[1], [2], [3]])
    shared = 3 * torch.arange(MASK.shape[1])[None] + 5
    with torch.no_grad():
        for positions, mask in ((per_row, MASK), (shared, torch.ones_like(MASK))):
            expected = hf(ids, attention_mask=mask, position_ids=positions).logits
            actual = ours(ids, attention_mask=mask, position_ids=positions)
            keep = mask.bool()
            assert_close(actual[keep], expected[keep], torch.float32)
        # positions 0 .. s - 1 are the default
        assert torch.equal(ours(ids, position_ids=torch.arange(11)[None]), ours(ids))


def test_training_step_compiles_without_breaks_and_saves_back():
    """A Hugging Face loop's step, ``model(input_ids=, attention_mask=, labels=).loss`` then
    ``backward``, compiled with ``fullgraph=True`` (and with per-row ``position_ids``, the layers
    row by row); the trained model back in transformers (``to_hf``) gives its logits."""
    hf = _hf64("qwen2")
    ours = te.convert.from_hf(hf).train()
    opt = torch.optim.SGD(ours.parameters(), lr=1e-2)

    def step(ids, mask, labels, positions=None):
        return ours(input_ids=ids, attention_mask=mask, position_ids=positions, labels=labels).loss

    compiled, counter = compile_counted(step, backend="aot_eager")
    ids = torch.randint(0, SMALL["vocab_size"], MASK.shape)
    per_row = (MASK.cumsum(-1) - 1).masked_fill(~KEEP, 1)
    for positions in (None, None, per_row):
        loss = compiled(ids, MASK, ids.masked_fill(~KEEP, -100), positions)
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert counter.frame_count == 2  # one graph each way, no breaks
    ours.eval()
    with torch.no_grad():  # Qwen2's biases our layers add are frozen at zero: it goes back
        back = te.convert.to_hf(ours, _hf64("qwen2"))
        expected = back(ids, attention_mask=MASK).logits
        actual = ours(ids, attention_mask=MASK)
    assert_close(actual[KEEP], expected[KEEP], torch.float32)


@pytest.mark.parametrize(
    ("kind", "extra"),
    [("llama", {}), ("llama", {"tie_word_embeddings": True}), ("mistral", {}), ("qwen2", {})],
)
def test_round_trip_gives_the_same_weights_and_logits(kind, extra):
    hf = _hf(kind, **extra)
    ours = te.convert.from_hf(hf)
    assert ours.config is hf.config
    back = te.convert.to_hf(ours)  # built from ours.config
    assert type(back) is type(hf)
    original, returned = hf.state_dict(), back.state_dict()
    assert original.keys() == returned.keys()
    for name, value in original.items():
        assert torch.equal(returned[name], value), name
    tied = extra.get("tie_word_embeddings", False)
    assert (back.lm_head.weight is back.model.embed_tokens.weight) == tied
    ids = torch.randint(0, SMALL["vocab_size"], (2, 12))
    with torch.no_grad():
        assert torch.equal(back.eval()(ids).logits, hf(ids).logits)


def test_trained_model_saves_as_a_hugging_face_checkpoint(tmp_path):
    """Trained, mapped back, written with ``save_pretrained`` and read with
    ``AutoModelForCausalLM.from_pretrained``: the checkpoint gives the trained model's logits."""
    ours = te.convert.from_hf(_hf64("llama", tie_word_embeddings=True)).train()
    opt = torch.optim.SGD(ours.parameters(), lr=0.1)
    ids = torch.randint(0, SMALL["vocab_size"], MASK.shape)
    ours(ids, attention_mask=MASK, labels=ids.masked_fill(~KEEP, -100)).loss.backward()
    opt.step()
    te.convert.to_hf(ours).save_pretrained(tmp_path)
    auto = transformers.AutoModelForCausalLM
    loaded = auto.from_pretrained(tmp_path, dtype=torch.float64).eval()
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    with torch.no_grad():
        assert torch.equal(loaded.model.embed_tokens.weight, ours.embed_tokens.weight)
        assert_close(ours.eval()(ids), loaded(ids).logits, torch.float32)


def test_hugging_face_trainer_trains_the_converted_model(tmp_path):
    """``transformers.Trainer`` (it needs ``accelerate``) on padded batches: it calls
    ``model(**batch)`` and reads the loss as ``outputs[0]`` of the tuple ``CausalLM`` returns."""
    pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")
    ours = te.convert.from_hf(_hf("llama")).train()
    ids = torch.randint(0, SMALL["vocab_size"], (8, 11))
    mask = MASK.repeat(3, 1)[:8]

    def collate(rows):
        batch_ids, batch_mask = map(torch.stack, zip(*rows, strict=True))
        labels = batch_ids.masked_fill(batch_mask == 0, -100)
        return {"input_ids": batch_ids, "attention_mask": batch_mask, "labels": labels}

    args = transformers.TrainingArguments(
        tmp_path, per_device_train_batch_size=4, max_steps=2, report_to=[], use_cpu=True,
        save_strategy="no",
    )  # fmt: skip
    data = list(zip(ids, mask, strict=True))
    trainer = transformers.Trainer(model=ours, args=args, train_dataset=data, data_collator=collate)
    result = trainer.train()
    assert result.global_step == 2 and torch.isfinite(torch.tensor(result.training_loss))


def test_to_hf_refusals_name_the_argument():
    direct = te.convert.CausalLM(96, 64, 96, 1, 4, 2, 16)
    assert direct.config is None
    with pytest.raises(ValueError, match=r"model\.config is None .* pass hf_model"):
        te.convert.to_hf(direct)
    with pytest.raises(TypeError, match="hf_model must be None or a transformers causal LM"):
        te.convert.to_hf(direct, hf_model="llama")
    ours = te.convert.from_hf(_hf("qwen2"))
    with torch.no_grad():
        ours.layers[1].layernorm_mlp.fc2_bias.add_(1.0)
    with pytest.raises(ValueError, match=r"layers\.1\.layernorm_mlp\.fc2_bias is not zero"):
        te.convert.to_hf(ours)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"attention_mask": MASK[:, :-1]}, r"attention_mask must be \[3, 11\], got shape \[3, 10"),
        ({"attention_mask": MASK[:, None, None]}, r"attention_mask must be \[3, 11\]"),
        ({"attention_mask": MASK.double()}, "attention_mask must be a tensor of dtype"),
        ({"position_ids": MASK[:2]}, r"position_ids must be \[3 or 1, 11\], got shape \[2, 11\]"),
        ({"labels": MASK[:, 1:]}, r"labels must be \[3, 11\]"),
        ({"labels": MASK.float()}, "labels must be a tensor of dtype"),
        ({"return_dict": 1}, "return_dict must be a bool"),
    ],
)  # fmt: skip
def test_forward_refusals_name_the_argument(kwargs, match):
    ours = te.convert.from_hf(_hf("llama"))
    with pytest.raises(ValueError, match=match):
        ours(torch.zeros(MASK.shape, dtype=torch.long), **kwargs)
