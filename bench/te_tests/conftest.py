"""conftest for Transformer Engine's PyTorch tests run against te_compile on the CPU.

``bench/te_tests/run.py`` copies this file beside the extracted (and device-patched) TE test
files. It is our code, not TE's: it stands in for what the tests take from TE's library and
the CUDA runtime around the work (see ``bench/te_tests/README.md``):

- CPU stand-ins for the CUDA calls around the work (``torch.cuda.synchronize``,
  ``get_rng_state`` / ``set_rng_state``, ``max_memory_allocated``, compute capability (9, 0));
- every ``is_*_available`` answering True (te_compile runs every recipe on the CPU);
  ``FP8GlobalStateManager.reset`` a no-op;
- the test-side helpers TE's tests import from the library (``DType``, ``QuantizerRole``,
  ``init_method_normal``, ...), written here from their documented behaviour;
- TE's quantizer classes as far as the tests use them to make representable test data:
  ``Float8Quantizer(...)(x)`` and friends give ``x`` quantised and dequantised by
  ``te_compile.quantize`` / ``dequantize`` (a plain tensor; any other use of a quantizer
  raises ``ShimMissing``);
- an alarm per test (``TE_SHIM_TIMEOUT`` seconds, default 120) and a deterministic sample: a
  test runs when ``crc32(node id) % TE_SAMPLE_STRIDE == 0``.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
import signal
import sys
import zlib

_SHIM = os.environ.get("TE_SHIM_PATH")
if _SHIM and _SHIM not in sys.path:
    sys.path.insert(0, _SHIM)

import pytest  # noqa: E402
import torch  # noqa: E402
import transformer_engine  # noqa: E402  (importing the shim installs the mapping)
from transformer_engine import STANDINS, ShimMissing, _StubMeta  # noqa: E402

import te_compile  # noqa: E402
from te_compile.common import recipe as _recipe  # noqa: E402


class ShimTimeout(Exception):
    """A test ran past the per-test alarm (a limit of this machine, not a result)."""


# --------------------------------------------------------------------------------------------
# CUDA calls around the work
# --------------------------------------------------------------------------------------------

_CAPABILITY = (9, 0)
torch.cuda.synchronize = lambda *a, **k: None
torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
torch.cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
torch.cuda.manual_seed = lambda seed: None
torch.cuda.manual_seed_all = lambda seed: None
torch.cuda.max_memory_allocated = lambda *a, **k: 0
torch.cuda.memory_allocated = lambda *a, **k: 0
torch.cuda.reset_peak_memory_stats = lambda *a, **k: None
torch.cuda.empty_cache = lambda *a, **k: None
torch.cuda.get_device_capability = lambda *a, **k: _CAPABILITY
torch.cuda.current_device = lambda: 0


# --------------------------------------------------------------------------------------------
# availability: every recipe runs on the CPU in te_compile
# --------------------------------------------------------------------------------------------


def _available(return_reason: bool = False):
    return (True, "") if return_reason else True


for _name in (
    "is_fp8_available",
    "is_mxfp8_available",
    "is_fp8_block_scaling_available",
    "is_nvfp4_available",
    "is_bf16_available",
    "is_non_tn_fp8_gemm_supported",
):
    STANDINS[_name] = _available
STANDINS["get_device_compute_capability"] = lambda: _CAPABILITY


class FP8GlobalStateManager(metaclass=_StubMeta):
    """TE's global FP8 state: only ``reset`` (a no-op here); everything else ShimMissing."""

    _shim_stub = True
    _shim_name = "FP8GlobalStateManager"

    @staticmethod
    def reset():
        return None


STANDINS["FP8GlobalStateManager"] = FP8GlobalStateManager


# --------------------------------------------------------------------------------------------
# test-side helpers
# --------------------------------------------------------------------------------------------


class DType(enum.IntEnum):
    """TE's tensor dtype enum (``transformer_engine_torch.DType``)."""

    kByte = 0
    kInt16 = 1
    kInt32 = 2
    kInt64 = 3
    kFloat32 = 4
    kFloat16 = 5
    kBFloat16 = 6
    kFloat8E4M3 = 7
    kFloat8E5M2 = 8
    kFloat8E8M0 = 9
    kFloat4E2M1 = 10


STANDINS["DType"] = DType
STANDINS["TE_DType"] = {
    torch.uint8: DType.kByte,
    torch.int16: DType.kInt16,
    torch.int32: DType.kInt32,
    torch.int64: DType.kInt64,
    torch.float32: DType.kFloat32,
    torch.float16: DType.kFloat16,
    torch.bfloat16: DType.kBFloat16,
    torch.float8_e4m3fn: DType.kFloat8E4M3,
    torch.float8_e5m2: DType.kFloat8E5M2,
}


@dataclasses.dataclass(frozen=True)
class QuantizerRole:
    """Which tensor a quantizer is for (module type, tensor type, module name)."""

    module_type: str = ""
    tensor_type: str = ""
    name: str = ""


STANDINS["QuantizerRole"] = QuantizerRole


def init_method_normal(sigma: float):
    """An initialiser drawing from N(0, sigma)."""
    return lambda tensor: torch.nn.init.normal_(tensor, mean=0.0, std=sigma)


def scaled_init_method_normal(sigma: float, num_layers: int):
    """An initialiser drawing from N(0, sigma / sqrt(2 num_layers))."""
    return init_method_normal(sigma / math.sqrt(2.0 * num_layers))


def attention_mask_func(attention_scores: torch.Tensor, attention_mask: torch.Tensor):
    """Masked positions of the scores set to -10000, in place."""
    return attention_scores.masked_fill_(attention_mask, -10000.0)


def check_set_window_size(attn_mask_type: str, window_size=None):
    """The sliding window a mask type implies: (-1, 0) for causal masks, (-1, -1) otherwise,
    unless one is given."""
    if window_size is None:
        return (-1, 0) if "causal" in attn_mask_type else (-1, -1)
    return tuple(window_size)


_DUMMY_WGRADS: dict = {}


def get_dummy_wgrad(shape, dtype, zero: bool = False):
    """A cached placeholder tensor of ``shape`` and ``dtype`` (zeroed when asked)."""
    key = (*shape, dtype)
    if key not in _DUMMY_WGRADS:
        _DUMMY_WGRADS[key] = torch.empty(shape, dtype=dtype, requires_grad=False)
    if zero:
        _DUMMY_WGRADS[key].zero_()
    return _DUMMY_WGRADS[key]


def get_fp8_torch_dtype(fp8_recipe, fprop_tensor: bool = True):
    """E4M3 for E4M3 recipes and HYBRID's forward tensors, else E5M2."""
    fmt = fp8_recipe.fp8_format
    if fmt == _recipe.Format.E4M3 or (fmt == _recipe.Format.HYBRID and fprop_tensor):
        return torch.float8_e4m3fn
    return torch.float8_e5m2


for _f in (
    init_method_normal,
    scaled_init_method_normal,
    attention_mask_func,
    check_set_window_size,
    get_dummy_wgrad,
    get_fp8_torch_dtype,
):
    STANDINS[_f.__name__] = _f


# --------------------------------------------------------------------------------------------
# quantizers: quantise and dequantise through te_compile (plain tensors come back)
# --------------------------------------------------------------------------------------------


class _QuantizerStandIn:
    """A TE quantizer as far as a test calls it on a tensor: the tensor quantised and
    dequantised by te_compile. Any other attribute raises ShimMissing."""

    def __init__(self, *args, **kwargs):
        self.args = args
        self.kwargs = kwargs

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise ShimMissing(f"shim: {type(self).__name__}.{attr} is a TE internal te_compile lacks")

    def _fp8_format(self):
        dtype = self.kwargs.get("fp8_dtype", self.args[2] if len(self.args) > 2 else None)
        return _recipe.Format.E5M2 if dtype == DType.kFloat8E5M2 else _recipe.Format.E4M3

    def _recipe_role(self):  # (recipe, role, scale)
        raise NotImplementedError

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        recipe, role, scale = self._recipe_role()
        q = te_compile.quantize(tensor, recipe, role=role, scale=scale)
        return te_compile.dequantize(q, tensor.dtype)


def _per_tensor_role(fmt):
    # te_compile's FP8 recipes take E5M2 for gradients under HYBRID
    if fmt == _recipe.Format.E5M2:
        return _recipe.Format.HYBRID, "grad_output"
    return _recipe.Format.E4M3, "input"


class Float8Quantizer(_QuantizerStandIn):
    """Delayed scaling: the given scale."""

    def _recipe_role(self):
        scale = self.kwargs.get("scale", self.args[0] if self.args else None)
        fmt, role = _per_tensor_role(self._fp8_format())
        scale = None if scale is None else scale.reshape(()).float().cpu()
        return _recipe.DelayedScaling(fp8_format=fmt), role, scale


class Float8CurrentScalingQuantizer(_QuantizerStandIn):
    def _fp8_format(self):
        dtype = self.kwargs.get("fp8_dtype", self.args[0] if self.args else None)
        return _recipe.Format.E5M2 if dtype == DType.kFloat8E5M2 else _recipe.Format.E4M3

    def _recipe_role(self):
        fmt, role = _per_tensor_role(self._fp8_format())
        return _recipe.Float8CurrentScaling(fp8_format=fmt), role, None


class MXFP8Quantizer(Float8CurrentScalingQuantizer):
    def _recipe_role(self):
        fmt, role = _per_tensor_role(self._fp8_format())
        return _recipe.MXFP8BlockScaling(fp8_format=fmt), role, None


class Float8BlockQuantizer(Float8CurrentScalingQuantizer):
    def _recipe_role(self):
        fmt, role = _per_tensor_role(self._fp8_format())
        if self.kwargs.get("block_scaling_dim", 2) == 2:
            role = "weight"
        return _recipe.Float8BlockScaling(fp8_format=fmt), role, None


class NVFP4Quantizer(_QuantizerStandIn):
    def _recipe_role(self):
        kw = self.kwargs
        two_d = kw.get("with_2d_quantization", False)
        fields = {"disable_2d_quantization": not two_d}
        if kw.get("nvfp4_use_4over6", False):
            fields["nvfp4_4over6"] = "all"
            fields["nvfp4_4over6_e4m3_use_256"] = (
                "all" if kw.get("nvfp4_e4m3_max", 448) == 256 else "none"
            )
        return _recipe.NVFP4BlockScaling(**fields), ("weight" if two_d else "input"), None


for _cls in (
    Float8Quantizer,
    Float8CurrentScalingQuantizer,
    MXFP8Quantizer,
    Float8BlockQuantizer,
    NVFP4Quantizer,
):
    STANDINS[_cls.__name__] = _cls


class _LazyFailure:
    """Stands in a parameter list for an object whose construction raised: the error is
    raised again when a test uses it (so collection goes on)."""

    def __init__(self, label: str, error: Exception):
        self._label = label
        self._error = error

    def __repr__(self):
        return self._label

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        # te_compile's error (the shim only deferred it): run.py classifies it as te_compile's
        raise type(self._error)(f"{self._error} (kept by shim_build)") from self._error


def shim_build(label: str, factory, *args, **kwargs):
    """``factory(*args, **kwargs)``, or a placeholder that raises its error when used."""
    try:
        return factory(*args, **kwargs)
    except (TypeError, ValueError) as exc:
        return _LazyFailure(label, exc)


# --------------------------------------------------------------------------------------------
# per-test alarm and deterministic sample
# --------------------------------------------------------------------------------------------

_TIMEOUT = int(os.environ.get("TE_SHIM_TIMEOUT", "120"))
_STRIDE = max(1, int(os.environ.get("TE_SAMPLE_STRIDE", "1")))


def _alarm(signum, frame):
    raise ShimTimeout(f"shim: test ran past the per-test alarm ({_TIMEOUT} s)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if _TIMEOUT > 0:
        old = signal.signal(signal.SIGALRM, _alarm)
        signal.alarm(_TIMEOUT)
    try:
        yield
    finally:
        if _TIMEOUT > 0:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)


@pytest.hookimpl(hookwrapper=True)
def pytest_collection(session):
    transformer_engine.COLLECTING = True
    try:
        yield
    finally:
        transformer_engine.COLLECTING = False


@pytest.hookimpl(trylast=True)  # after -k / -m deselection: "collected" counts what remains
def pytest_collection_modifyitems(session, config, items):
    collected = len(items)
    if _STRIDE > 1:
        keep, drop = [], []
        for item in items:
            (keep if zlib.crc32(item.nodeid.encode()) % _STRIDE == 0 else drop).append(item)
        if drop:
            config.hook.pytest_deselected(items=drop)
        items[:] = keep
    counts = os.environ.get("TE_SHIM_COUNTS")
    if counts:
        with open(counts, "w") as f:
            json.dump({"collected": collected, "sampled": len(items), "stride": _STRIDE}, f)
