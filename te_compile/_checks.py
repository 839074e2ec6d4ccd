"""Checks of public scalar arguments, shared by every layer (modules, te.ops, functional,
quantization): each raises ValueError naming the owner, the argument, the constraint and the
value. They read Python scalars only, never tensor data, so the same check runs in eager and
while ``torch.compile`` traces the calling Python (comparisons only: a float that dynamo traces
as a ``SymFloat`` compares, where ``math.isfinite`` would not trace).

A NaN fails every comparison, so each constraint is written as the comparisons that hold for a
valid value (``0 < v < inf``), never as the negation of an invalid one (``v <= 0``)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

_REAL = (int, float, torch.SymInt, torch.SymFloat)

# The dtypes the ops take: floating tensors (float64: the references' and the tests'), the inputs
# of a quantisation, the FP8 formats, and integer index tensors.
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
HIGH_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
INDEX_DTYPES = (torch.int32, torch.int64)


def shown(value: object) -> str:
    """``repr(value)`` for an error message, a tensor shown by its shape and dtype: its data is
    not what the message is about, and torch 2.11's dynamo cannot trace ``repr`` of a tensor
    (the compiled caller would get dynamo's error instead of ours)."""
    if isinstance(value, torch.Tensor):
        return f"a Tensor of shape {list(value.shape)} and dtype {value.dtype}"
    return repr(value)


def check_bool(owner: str, **flags: object) -> None:
    """Each flag is ``True`` or ``False``: a truthy string or a tensor would switch a mode on
    without saying so."""
    for name, value in flags.items():
        if value is not True and value is not False:
            raise ValueError(f"{owner}: {name} must be a bool (True or False), got {shown(value)}")


def passed_once(check: Callable[[tuple], None]) -> Callable[[tuple], None]:
    """``check`` of an op's argument tuple, skipped for arguments like some that passed it
    before. A family's checks read the tensors' shapes, dtypes and devices and the values of the
    other arguments, so a key of those stands for the arguments (4096 kept at most); an eager
    call with the same shapes then pays a key instead of the checks. A failure is not kept: bad
    arguments raise on every call. A symbolic shape (unhashable) and dynamo's trace are checked
    every time."""
    passed: set[tuple] = set()

    def meta(v: object) -> object:
        if isinstance(v, torch.Tensor):
            return v.shape, v.dtype, v.device
        return tuple(map(meta, v)) if isinstance(v, list) else (type(v), v)  # True is not 1

    @functools.wraps(check)
    def run(args: tuple) -> None:
        if torch.compiler.is_compiling():  # dynamo would guard on the set: traced, checked
            return check(args)
        key = tuple(map(meta, args))
        try:
            if key in passed:
                return
        except TypeError:  # a SymInt in a shape, or an unhashable value: its checks name it
            return check(args)
        check(args)
        if len(passed) >= 4096:
            passed.clear()
        passed.add(key)

    return run


def _real(value: object) -> bool:
    return isinstance(value, _REAL) and not isinstance(value, bool)


def check_positive_finite(owner: str, **values: float) -> None:
    """Each value is a real number with ``0 < v < inf`` (eps, limits, slopes)."""
    for name, value in values.items():
        if not (_real(value) and 0 < value < math.inf):
            raise ValueError(
                f"{owner}: {name} must be a positive float (finite, > 0), got {shown(value)}"
            )


def check_finite(owner: str, **values: float) -> None:
    """Each value is a real number with ``-inf < v < inf`` (offsets, output scales)."""
    for name, value in values.items():
        if not (_real(value) and -math.inf < value < math.inf):
            raise ValueError(f"{owner}: {name} must be a float (finite), got {shown(value)}")


def check_int(owner: str, minimum: int = 1, **values: object) -> None:
    """Each value is an int (not a bool) ``>= minimum`` (sizes: ``minimum=1``; offsets: 0)."""
    for name, value in values.items():
        if not (isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool)):
            raise TypeError(f"{owner}: {name} must be an int >= {minimum}, got {shown(value)}")
        if not value >= minimum:
            raise ValueError(f"{owner}: {name} must be an int >= {minimum}, got {shown(value)}")


def check_tensor(
    owner: str, name: str, value: object, *, floating: bool = True, min_dim: int = 1
) -> None:
    """``value`` is a tensor (floating-point where ``floating``) with at least ``min_dim`` dims.
    Reads metadata only, so it runs the same in eager and while tracing."""
    if not isinstance(value, torch.Tensor):
        got = "None" if value is None else type(value).__name__
        raise TypeError(f"{owner}: {name} must be a torch.Tensor, got {got}")
    if floating and not value.is_floating_point():
        raise ValueError(f"{owner}: {name} must be a floating-point tensor, got {value.dtype}")
    if value.dim() < min_dim:
        raise ValueError(
            f"{owner}: {name} must have at least {min_dim} dim(s), got shape {list(value.shape)}"
        )


def check_tensors(owner: str, **tensors: object) -> None:
    """:func:`check_tensor` (floating, >= 1 dim) on each value that is not None (the optional
    tensors: a bias, a main_grad)."""
    for name, value in tensors.items():
        if value is not None:
            check_tensor(owner, name, value)


def check_required(owner: str, **tensors: object) -> None:
    """:func:`check_tensor` (floating, >= 1 dim) on each value, None refused: the tensors an
    argument list has no None default for (an input, a weight)."""
    for name, value in tensors.items():
        check_tensor(owner, name, value)


def check_same_device(owner: str, ref_name: str, ref: torch.Tensor, **tensors: object) -> None:
    """Each tensor that is not None is on ``ref``'s device (a weight on another device than the
    input would be read there, or silently give a result on the meta device). Reads
    ``.device`` only: no sync, the same in eager and while tracing."""
    for name, value in tensors.items():
        if value is not None and value.device != ref.device:
            raise ValueError(
                f"{owner}: {ref_name} and {name} must be on one device, got {ref_name} on "
                f"{ref.device} and {name} on {value.device}" + _device_hint(ref, value)
            )


def _device_hint(a: torch.Tensor, b: torch.Tensor) -> str:
    """Where one tensor is on CUDA and the other on the CPU: most likely a module built for one
    device (:func:`default_device`) and fed an input on the other."""
    if {a.device.type, b.device.type} != {"cuda", "cpu"}:
        return ""
    return (
        " (a module built without device= is on CUDA where one is present, unless torch's "
        "default device was set; move the module with .cuda() / .cpu(), or the input to the "
        "module's device)"
    )


def check_dtype(owner: str, name: str, value: object, *, floating: bool = True) -> None:
    """``value`` is a ``torch.dtype`` (floating-point where ``floating``)."""
    if not isinstance(value, torch.dtype):
        raise TypeError(f"{owner}: {name} must be a torch.dtype, got {shown(value)}")
    if floating and not value.is_floating_point:
        raise ValueError(f"{owner}: {name} must be a floating dtype, got {value}")


def check_device(owner: str, name: str, value: object) -> None:
    """``value`` is None, a ``torch.device``, a device string or index that torch parses."""
    if value is None or isinstance(value, torch.device):
        return
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise TypeError(
            f"{owner}: {name} must be a torch.device or a device string, got {shown(value)}"
        )
    try:
        torch.device(value)
    except RuntimeError as error:
        raise ValueError(f"{owner}: {name} is not a device, got {shown(value)} ({error})") from None


def default_device(owner: str, device: object) -> object:
    """A module's ``device`` argument, checked (:func:`check_device`); None becomes Transformer
    Engine's default, ``"cuda"``, where a CUDA device is present and torch's default device is
    not set (``torch.set_default_device``, or a ``with torch.device(...)`` block such as a
    meta-device initialisation: None is returned and that device applies); without CUDA, None
    (torch's default device, the CPU)."""
    check_device(owner, "device", device)
    return TE_DEFAULT_DEVICE if device is None and cuda_is_default() else device


TE_DEFAULT_DEVICE = "cuda"


def cuda_is_default() -> bool:
    """Whether a module built with ``device=None`` goes to CUDA (:func:`default_device`)."""
    if not torch.cuda.is_available():
        return False
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._device import DeviceContext

    held = getattr(getattr(torch, "_GLOBAL_DEVICE_CONTEXT", None), "device_context", None)
    modes = _get_current_function_mode_stack()
    return held is None and not any(isinstance(m, DeviceContext) for m in modes)


def check_callable(owner: str, **values: object) -> None:
    """Each value is None or callable (initialisers, hooks)."""
    for name, value in values.items():
        if value is not None and not callable(value):
            raise TypeError(f"{owner}: {name} must be callable or None, got {shown(value)}")


def check_choice(owner: str, name: str, value: object, choices: tuple) -> None:
    """``value`` is one of ``choices`` (compared by equality, with its type: ``1`` is not
    ``True``)."""
    if not any(type(value) is type(c) and value == c for c in choices):
        raise ValueError(f"{owner}: {name} must be one of {choices}, got {shown(value)}")
