"""Device code only: Triton kernels and their launch wrappers (no torch.library here).

The submodules (``kernels.quantize``, ``kernels.norm``, ...) import Triton: a caller imports one
only where it launches a kernel (CUDA tensors, or the Triton interpreter in tests), never on a
CPU path, because Triton is not a dependency of the package. This file imports no Triton: it
holds what the kernels and the CPU implementations share (launch helpers, device constants,
the E5M2-to-E4M3 recoding table).
"""

from __future__ import annotations

import copy
import functools
import importlib
import os
from typing import Any, ClassVar

import torch


@functools.cache
def submodule(name: str) -> Any:
    """The kernel submodule ``name`` (``"norm"``, ``"quantize"``, ...), imported at the first
    call: the functional ops ask for it where they launch a kernel, as it imports Triton."""
    return importlib.import_module(f"{__name__}.{name}")


def runs_triton(t: torch.Tensor) -> bool:
    """Whether the functional ops launch this package's Triton kernels on ``t``'s data: a CUDA
    tensor, but not fp64 (fp64 runs the reference math, on every device)."""
    return t.is_cuda and t.dtype is not torch.float64


@functools.lru_cache(maxsize=32)
def programs_per_sm(device: torch.device, per_sm: int, off_cuda: int = 4) -> int:
    """``per_sm`` programs for every SM of ``device``'s GPU: the size of a launch of programs
    that each walk many row tiles. Off CUDA (the Triton interpreter) a fixed ``off_cuda``, so
    that tests exercise programs owning several tiles."""
    if device.type == "cuda":
        return per_sm * torch.cuda.get_device_properties(device).multi_processor_count
    return off_cuda


@functools.lru_cache(maxsize=64)
def _host_constant(values: tuple, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
    tensor = torch.tensor(values, dtype=dtype)
    return tensor.pin_memory() if pinned else tensor


def device_constant(values: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a tensor on ``device`` (not to be written to). On CUDA: a pinned host copy
    made once and an asynchronous copy per call. A device tensor cached across calls would, when
    first made inside a CUDA graph's warm-up (``torch.compile(mode="reduce-overhead")``), live in
    the graph's memory pool untracked, which its CUDA graphs refuse; a copy from pageable memory
    would make the host wait for the GPU. The copy from pinned memory does neither and is
    captured into the graph."""
    # Dynamo tracing a module's code, or AOTAutograd an op's: a constant of the compiled graph,
    # made when it is compiled (``is_compiling`` first: dynamo cannot trace ``tracing``'s call).
    if torch.compiler.is_compiling() or tracing():
        return torch.tensor(values, dtype=dtype, device=device)
    if device.type != "cuda":
        return _host_constant(values, dtype, False)
    return _host_constant(values, dtype, True).to(device, non_blocking=True)


@functools.cache
def memoize_write_analysis() -> None:
    """Make torch's analysis of which arguments a user Triton kernel writes run once per kernel
    and argument signature for our kernels, instead of once per launch and compile stage.

    For every ``wrap_triton`` launch torch compiles the kernel to TTIR and walks it to find the
    tensors it writes (``torch._higher_order_ops.triton_kernel_wrap``'s
    ``identify_accessed_tensors``, ``identify_mutated_tensors`` before torch 2.12), in
    functionalization, in Inductor's lowering and in its IR node: on the 2-core dev machine
    about 25 ms each, 103 times for one FP8 decoder layer of ``bench_block``'s smoke stack
    (3.2 s of its 16.7 s compile), and as many again for every further layer. The answer
    depends only on the TTIR, that is on the kernel, which arguments are tensors (of which class
    and dtype), the constexprs' values and how Triton specialises the other integers (1, a
    multiple of 16, 32 or 64 bits), so it is kept per such key. Other kernels, symbolic
    arguments and TMA descriptors go through torch's function as they are. Installed at the
    first traced launch (:func:`launch`); a torch without either function keeps its own."""
    try:
        import sympy
        from torch._higher_order_ops import triton_kernel_wrap as wrap
        from triton.runtime.autotuner import Autotuner
    except ImportError:
        return
    ours = {id(k): {p.name for p in k.params if p.is_constexpr} for k in all_kernels()}
    plain = (bool, str, type(None), torch.dtype)

    def key_of(kernel: Any, kwargs: dict[str, Any], tma: Any) -> tuple | None:
        configs = ()
        if isinstance(kernel, Autotuner):  # a launch's options: torch wraps the kernel in one
            configs = tuple((tuple(sorted(c.kwargs.items())), c.num_warps, c.num_stages)
                            for c in kernel.configs)  # fmt: skip
            kernel = kernel.fn
        constexprs = ours.get(id(kernel))
        if constexprs is None or tma:
            return None
        parts: list[tuple] = [configs]
        for name, value in sorted(kwargs.items()):
            if isinstance(value, (int, sympy.Integer)) and not isinstance(value, bool):
                value = int(value)
                if name not in constexprs:  # as Triton specialises it: the TTIR's only input
                    value = (value == 1, value % 16 == 0, -(2**31) <= value < 2**31)
                parts.append((name, "int", value))
            elif isinstance(value, float):
                parts.append((name, "float", value if name in constexprs else None))
            elif isinstance(value, plain):
                parts.append((name, type(value).__name__, value))
            elif isinstance(value, torch.Tensor) or hasattr(value, "get_dtype"):  # Inductor IR
                dtype = value.dtype if isinstance(value, torch.Tensor) else value.get_dtype()
                parts.append((name, type(value).__name__, dtype))
            else:  # a SymInt, a constexpr object: analysed every time
                return None
        return id(kernel), tuple(parts)

    for name in ("identify_accessed_tensors", "identify_mutated_tensors"):
        analyse = getattr(wrap, name, None)
        if analyse is None or getattr(analyse, "te_memoized", False):
            continue
        memo: dict[tuple, Any] = {}

        @functools.wraps(analyse)
        def memoized(kernel, kwargs, *rest, _analyse=analyse, _memo=memo, **named):
            tma = rest[0] if rest else named.get("tma_descriptor_metadata")
            key = key_of(kernel, kwargs, tma)
            try:
                hit = key is not None and key in _memo
            except TypeError:  # an unhashable config value
                key = None
            if key is None:
                return _analyse(kernel, kwargs, *rest, **named)
            if not hit:
                _memo[key] = _analyse(kernel, kwargs, *rest, **named)
            return copy.deepcopy(_memo[key])  # callers may extend the sets they get

        memoized.te_memoized = True
        setattr(wrap, name, memoized)


# Torch's option, read by Inductor's compile workers from their environment only (they are started
# at the first compile with the process's environment, and never see a config set afterwards).
STATIC_LAUNCH_ENV = "TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS"


def set_static_launch(enabled: bool) -> None:
    """Whether Inductor launches user-defined Triton kernels, ours among them, with its static CUDA
    launcher (torch's ``static_launch_user_defined_triton_kernels``), as it launches its own:
    less host time per launch in a compiled step, and a shorter first compile (``docs/
    op_mechanism.md``). On from ``import te_compile`` unless the environment names the option;
    off, Triton's own launcher runs them (torch's default). A kernel the static launcher cannot
    take still runs on Triton's. Takes effect for compile workers started after the call: call
    it before the process's first ``torch.compile``. Where the variable was set when torch's
    Inductor config was imported, this process's own config keeps that value (torch gives the
    variable precedence); the workers follow the call."""
    if enabled is not True and enabled is not False:
        raise ValueError(f"set_static_launch: enabled must be a bool, got {enabled!r}")
    os.environ[STATIC_LAUNCH_ENV] = "1" if enabled else "0"
    from torch._inductor import config

    if hasattr(config, "static_launch_user_defined_triton_kernels"):
        config.static_launch_user_defined_triton_kernels = enabled


def static_launch_enabled() -> bool:
    """Whether compile workers started now launch our kernels statically
    (:func:`set_static_launch`)."""
    return os.environ.get(STATIC_LAUNCH_ENV) == "1"


def launch(kernel: Any, grid: Any) -> Any:
    """``kernel[grid]``, the launcher every kernel call of this package goes through.

    Under a dispatch mode — AOTAutograd tracing a te op's implementation for Inductor above
    all — the kernel is handed to ``torch.library.wrap_triton``, which records the launch in the
    graph (Inductor then launches the kernel itself; no Python runs per call). With no mode the
    kernel is launched by :class:`EagerLauncher`: the HOP that ``wrap_triton`` dispatches to
    costs host time that eager calls should not pay, and so does most of Triton's own per-call
    work."""
    if tracing():
        memoize_write_analysis()
        return torch.library.wrap_triton(kernel)[grid]
    if torch.compiler.is_compiling():  # dynamo tracing a launch: its own Triton support
        return kernel[grid]
    launcher = EagerLauncher.of(kernel)
    return lambda *args, **kwargs: launcher(grid, *args, **kwargs)


def dense(t: torch.Tensor) -> torch.Tensor:
    """``t.contiguous()`` without the torch call where ``t`` is contiguous already (the common
    case): each torch call costs an eager launch wrapper host time, a no-op one too."""
    return t if t.is_contiguous() else t.contiguous()


def next_pow2(n: int) -> int:
    """The least power of 2 >= ``n`` (0 for 0), as ``triton.next_power_of_2``, which is a Triton
    constexpr function now: it unwraps its arguments on every host call, which costs an eager
    launch ~1.5 us. A SymInt goes to Triton's."""
    if type(n) is not int:
        import triton

        return triton.next_power_of_2(n)
    return 1 << (n - 1).bit_length() if n > 0 else 0


def cdiv(n: Any, d: int) -> Any:
    """``ceil(n / d)`` for a launch's host code (ints or SymInts): ``triton.cdiv`` without its
    per-call constexpr unwrapping, which costs host time on every eager launch."""
    return (n + d - 1) // d


class EagerLauncher:
    """The eager launch of one Triton kernel, with the compiled kernel looked up by a key of our
    own instead of Triton's per-call specialisation (``JITFunction.run`` binds every argument,
    specialises it, builds a cache key from the options and checks the kernel's globals on each
    call: tens of microseconds of host time per launch, several launches per FP8 GEMM).

    The key holds every argument as Triton tells kernels apart, or finer: a tensor by its dtype
    and whether its data is 16-byte aligned (the only tensor properties Triton specialises on),
    an int or bool by its value (Triton specialises ints on divisibility by 16 and on their
    width; the exact value is finer, so a key never maps to a kernel compiled for other
    values), a float by its type, any other value (constexprs, ``num_warps``) by itself, and
    the current CUDA device. The first call with a key goes through Triton (``kernel[grid]``), which
    compiles or finds the kernel and launches it; the compiled kernel it returns launches every
    later call with that key directly (``CompiledKernel[grid]``, all arguments in the kernel's
    parameter order, defaults filled in). Where Triton returns no compiled kernel (its CPU
    interpreter) or a call cannot be keyed (an unhashable argument, a callable grid), the call
    goes through Triton as it is."""

    _launchers: ClassVar[dict[Any, EagerLauncher]] = {}
    MAX_KEYS = 1024  # compiled kernels kept per kernel; past it the table starts over

    def __init__(self, kernel: Any) -> None:
        import inspect

        self.kernel = kernel
        fn = getattr(kernel, "fn", None)
        params = inspect.signature(fn).parameters.values() if fn is not None else ()
        self.names = [p.name for p in params]
        empty = inspect.Parameter.empty
        self.defaults = {p.name: p.default for p in params if p.default is not empty}
        # key -> (the compiled kernel, its direct_run or None): one look-up per launch
        self.compiled: dict[tuple, tuple[Any, Any]] = {}
        self.direct = fn is not None  # False once Triton returned no compiled kernel

    @classmethod
    def of(cls, kernel: Any) -> EagerLauncher:
        launcher = cls._launchers.get(kernel)
        if launcher is None:
            launcher = cls._launchers[kernel] = cls(kernel)
        return launcher

    def __call__(self, grid: Any, *args: Any, **kwargs: Any) -> Any:
        key = self._key(grid, args, kwargs) if self.direct else None
        known = None
        if key is not None:
            try:
                known = self.compiled.get(key)
            except TypeError:  # an unhashable argument: no key
                key = None
        if known is not None:
            compiled, fire = known
            if fire is None:
                compiled[(*grid, 1, 1)[:3]](*self._bound(args, kwargs))
            else:
                fire((*grid, 1, 1)[:3], key[0], self._bound(args, kwargs))
            return compiled
        compiled = self.kernel[grid](*args, **kwargs)
        if key is None:
            return compiled
        if hasattr(compiled, "result"):  # Triton's asynchronous compile: the finished kernel
            compiled = compiled.result()
        if compiled is None or not hasattr(compiled, "packed_metadata"):
            self.direct = False  # the interpreter (or a Triton without compiled kernels)
        else:
            if len(self.compiled) >= self.MAX_KEYS:
                self.compiled.clear()
            self.compiled[key] = (compiled, direct_run(compiled))
        return compiled

    @staticmethod
    def _key(grid: Any, args: tuple, kwargs: dict) -> tuple | None:
        if type(grid) is not tuple or len(grid) > 3:
            return None
        # Triton loads a compiled kernel per device: the current one, as Triton's own launch.
        key = [torch._C._cuda_getDevice() if torch.cuda.is_initialized() else -1]
        append = key.append
        for value in (*args, *kwargs.values()):
            kind = type(value)
            # The exact types first (the common case), then their subclasses (a Parameter, an
            # IntEnum): the same key parts either way.
            if kind is int or kind is bool:
                append((kind, value))
            elif kind is float:
                append(float)
            elif isinstance(value, torch.Tensor):
                append((value.dtype, value.data_ptr() % 16 == 0))
            elif isinstance(value, int):  # bool is an int
                append((kind, value))
            elif isinstance(value, float):
                append(float)
            else:
                append(value)
        append(tuple(kwargs))
        return tuple(key)

    def _bound(self, args: tuple, kwargs: dict) -> list:
        """Every parameter's value in the kernel's order: ``args``, then ``kwargs`` by name,
        then defaults (launch options such as ``num_warps`` are not parameters)."""
        bound = list(args)
        for name in self.names[len(args) :]:
            bound.append(kwargs[name] if name in kwargs else self.defaults[name])
        return bound


def direct_run(compiled: Any) -> Any:
    """``fire(grid, device, args)``: launch Triton's compiled kernel ``compiled`` on a 3-D
    ``grid`` and ``device``'s current stream through its C launcher (``compiled.run``) with the
    arguments Triton's own runner passes, without that runner's per-call Python (a closure, the
    stream look-up, the launch metadata). While a launch hook is set (a profiler's), whose
    metadata the runner builds, the runner launches. None where ``compiled`` is not a kernel of
    a Triton with this launch signature (``triton.knobs``, ``run`` / ``function`` /
    ``packed_metadata``)."""
    try:
        from triton import knobs
    except ImportError:
        return None
    parts = [getattr(compiled, name, None) for name in ("run", "function", "packed_metadata")]
    stream_of = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if None in (*parts, stream_of) or not hasattr(knobs, "runtime"):
        return None
    run, function, packed = parts
    runtime = knobs.runtime

    def fire(grid: tuple, device: int, args: list) -> None:
        enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
        if _hooked(enter) or _hooked(leave):
            compiled[grid](*args)
        else:
            run(*grid, stream_of(device), function, packed, None, enter, leave, *args)

    return fire


def _hooked(hook: Any) -> bool:
    """Whether a Triton launch hook is set: a function, or a chain of them (``HookChain``, newer
    Tritons) that is not empty."""
    return hook is not None and bool(getattr(hook, "calls", True))


def bf16_bits(t: torch.Tensor) -> bool:
    """Whether a kernel takes ``t`` (bf16) as int16 bits, widened and rounded to nearest even by
    hand (``quantize_mx._load_x`` / ``_store_out``): under Triton's interpreter (CPU tensors)
    only, whose own bf16 conversion flushes subnormals to zero. On the GPU a bf16 tensor goes to
    the kernel as it is: Triton's conversions there widen exactly and round to nearest even, as
    the by-hand code does, and a dtype view is no view Inductor hands to a kernel in place: under
    ``torch.compile`` it would copy the input before the kernel and the output after it."""
    return t.dtype == torch.bfloat16 and t.device.type != "cuda"


def kernel_arg(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a kernel loads or stores it: an int16 view where :func:`bf16_bits`, else ``t``."""
    return t.view(torch.int16) if bf16_bits(t) else t


def size_hint(n: int | torch.SymInt) -> int:
    """``n`` as an int to choose a launch configuration by (tile sizes, programs per launch).
    A symbolic size (``torch.compile`` with dynamic shapes tracing a te op's implementation)
    gives the example size it was traced with and installs no guard, so that new sizes reuse
    the compiled graph: what is chosen with it must change only speed, never results."""
    if isinstance(n, torch.SymInt):
        hint = n.node.hint
        return int(hint) if hint is not None else 8192
    return n


def tracing() -> bool:
    """True under a dispatch mode (AOTAutograd's functional tracing, fake tensors, ...): the
    tensors may have no data, so nothing may read a data pointer, call a C++ kernel, or cache a
    tensor made now."""
    return torch._C._len_torch_dispatch_stack() > 0


def aligned16(t: torch.Tensor) -> bool:
    """``t``'s data starts on a 16-byte boundary. While tracing, judged from the storage offset
    (the compiler's buffers are aligned)."""
    if tracing():
        return t.storage_offset() * t.element_size() % 16 == 0
    return t.data_ptr() % 16 == 0


def all_kernels() -> list[Any]:
    """Every Triton kernel defined in ``te_compile.kernels``: the sources AOTAutograd's cache key
    must cover for a traced-through op, with ``fingerprint``'s, which carries the digest of
    te_compile's Python sources into that key."""
    import importlib
    import pkgutil

    from triton.runtime.jit import KernelInterface

    from te_compile.kernels.fingerprint import digest_sources

    digest_sources()  # the kernel ``fingerprint._te_compile_source`` names it
    found: list[Any] = []
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        found.extend(v for v in vars(module).values() if isinstance(v, KernelInterface))
    return found


def e5m2_to_e4m3_table(device: torch.device) -> torch.Tensor:
    """The E4M3 code of each E5M2 value times ``2**-7`` (round to nearest even), as a uint8
    ``[256]`` table indexed by the E5M2 code. ``2**-7`` maps E5M2's largest finite value,
    57344, onto E4M3's, 448, and E5M2's 2 mantissa bits fit E4M3's 3, so every E5M2 value of
    magnitude 1 or more is exact; smaller ones land on E4M3's subnormal grid (steps of
    ``2**-9`` after the shift, i.e. 0.25 before it); inf and NaN become NaN."""
    return device_constant(_e5m2_to_e4m3_codes(), torch.uint8, device)


@functools.cache
def _e5m2_to_e4m3_codes() -> tuple[int, ...]:
    # Real tensors, also when first asked while a graph is traced (fake tensors would give
    # data-dependent symbols for the codes).
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        return _codes_table()


def _codes_table() -> tuple[int, ...]:
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    e5m2 = codes.view(torch.float8_e5m2).float()
    table = (e5m2 * 2.0**-7).to(torch.float8_e4m3fn).view(torch.uint8)
    # Spelled out: torch's conversion saturates inf to 448 (CPU, torch 2.13).
    nan = (codes & 0x80) | 0x7F
    return tuple(torch.where(torch.isfinite(e5m2), table, nan).tolist())
