"""The eager Triton launcher (``te_compile.kernels.EagerLauncher``): a call goes through
Triton the first time its key is seen and straight to the compiled kernel after that, with the
arguments in the kernel's parameter order; a key never maps a call to a kernel compiled for
other argument properties. The logic runs on the CPU against a stand-in for Triton's kernel
objects; on CUDA the real kernels' results are compared bit for bit across both paths."""

from __future__ import annotations

import pytest
import torch

from te_compile.kernels import EagerLauncher, launch, next_pow2
from tests.utils import assert_bits_equal, requires_cuda


def _params(X, Y, n, eps, BLOCK=16, FLAG=False):
    """Parameters of the stand-in kernel."""


class _Compiled:
    """A compiled kernel: ``[grid](*every_argument)`` records the launch."""

    packed_metadata = b""

    def __init__(self, launches):
        self.launches = launches

    def __getitem__(self, grid):
        return lambda *args: self.launches.append(("direct", grid, args))


class _Kernel:
    """A JIT function: ``[grid](*args, **kwargs)`` records the call through Triton and returns
    a new compiled kernel (``compiled=False``: None, as the interpreter does; else the class
    of the compiled kernel)."""

    fn = staticmethod(_params)

    def __init__(self, compiled=True):
        self.launches = []
        self.returns_compiled = compiled

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.launches.append(("triton", grid, args, kwargs))
            made = _Compiled if self.returns_compiled is True else self.returns_compiled
            return made(self.launches) if made else None

        return run


def _x(offset=0):
    return torch.zeros(16)[offset:]


def test_second_call_with_a_key_launches_the_compiled_kernel_with_every_argument():
    k = _Kernel()
    x, y = _x(), _x()
    launch(k, (3, 2))(x, y, 64, 0.5, BLOCK=32, num_warps=4)
    launch(k, (3, 2))(x, y, 64, 0.25, BLOCK=32, num_warps=4)
    assert [entry[0] for entry in k.launches] == ["triton", "direct"]
    # The grid padded to three dimensions; the defaults filled in; num_warps is no parameter.
    assert k.launches[1] == ("direct", (3, 2, 1), (x, y, 64, 0.25, 32, False))


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda a, kw: ((_x(1), *a[1:]), kw), id="misaligned-tensor"),
        pytest.param(lambda a, kw: ((a[0].double(), *a[1:]), kw), id="dtype"),
        pytest.param(lambda a, kw: ((*a[:2], 65, a[3]), kw), id="int-value"),
        pytest.param(lambda a, kw: (a, {**kw, "BLOCK": 64}), id="constexpr"),
        pytest.param(lambda a, kw: (a, {**kw, "num_warps": 8}), id="launch-option"),
        pytest.param(lambda a, kw: (a, {**kw, "FLAG": True}), id="default-given"),
    ],
)
def test_a_call_that_triton_could_specialise_differently_goes_through_triton(change):
    k = _Kernel()
    args, kwargs = (_x(), _x(), 64, 0.5), {"BLOCK": 32, "num_warps": 4}
    launch(k, (1,))(*args, **kwargs)
    args2, kwargs2 = change(args, kwargs)
    launch(k, (1,))(*args2, **kwargs2)
    launch(k, (1,))(*args2, **kwargs2)
    assert [entry[0] for entry in k.launches] == ["triton", "triton", "direct"]


def test_no_compiled_kernel_keeps_every_call_on_triton():
    """Triton's interpreter returns no compiled kernel: no call is launched directly."""
    k = _Kernel(compiled=False)
    for _ in range(3):
        launch(k, (1,))(_x(), _x(), 64, 0.5)
    assert [entry[0] for entry in k.launches] == ["triton"] * 3


@pytest.mark.parametrize(
    "grid, arg",
    [
        pytest.param(lambda meta: (1,), 64, id="callable-grid"),
        pytest.param((1,), [64], id="unhashable-argument"),
    ],
)
def test_a_call_without_a_key_goes_through_triton(grid, arg):
    k = _Kernel()
    for _ in range(2):
        launch(k, grid)(_x(), _x(), arg, 0.5)
    assert [entry[0] for entry in k.launches] == ["triton"] * 2


def test_the_table_starts_over_past_its_size(monkeypatch):
    k = _Kernel()
    monkeypatch.setattr(EagerLauncher, "MAX_KEYS", 2)
    for n in (1, 2, 3, 1):
        launch(k, (1,))(_x(), _x(), n, 0.5)
    # n=3 found the table full and emptied it, so n=1 goes through Triton again.
    assert [entry[0] for entry in k.launches] == ["triton"] * 4


class _Launchable(_Compiled):
    """A compiled kernel of a Triton whose C launcher ``run`` takes the grid, the stream, the
    function handle, the packed metadata, the launch metadata and the hooks, then the arguments."""

    function = "cu-function"

    def run(self, *args):
        self.launches.append(("run", args))


def test_a_compiled_kernel_with_a_c_launcher_is_launched_through_it(monkeypatch):
    """Triton's own runner is skipped: the call goes to ``run`` with the arguments the runner
    would pass, on the current stream; while a launch hook is set the runner launches."""
    knobs = pytest.importorskip("triton.knobs")
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: 1000 + d, raising=False)
    k = _Kernel(compiled=_Launchable)
    x, y = _x(), _x()
    launch(k, (3, 2))(x, y, 64, 0.5, BLOCK=32)
    launch(k, (3, 2))(x, y, 64, 0.25, BLOCK=32)
    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    device = torch._C._cuda_getDevice() if torch.cuda.is_initialized() else -1
    head = (3, 2, 1, 1000 + device, "cu-function", b"", None, enter, leave)
    assert k.launches[0][0] == "triton"
    assert k.launches[1:] == [("run", (*head, x, y, 64, 0.25, 32, False))]
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda metadata: None)
    launch(k, (3, 2))(x, y, 64, 0.125, BLOCK=32)
    assert k.launches[-1] == ("direct", (3, 2, 1), (x, y, 64, 0.125, 32, False))


@requires_cuda
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "misaligned"])
def test_cuda_direct_launches_give_triton_launches_bits(offset):
    """The per-tensor FP8 cast (amax pass + cast kernel) and the norm kernel: the calls that
    go straight to the compiled kernels give the bits of the first call, which went through
    Triton, also for an input that is not 16-byte aligned (a key of its own)."""
    quantize = pytest.importorskip("te_compile.kernels.quantize")
    import te_compile  # noqa: F401 (registers the ops)

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(300, 257, device="cuda", generator=g, dtype=torch.bfloat16)
    x = x.flatten()[offset : offset + 250 * 256].view(250, 256)
    first = quantize.quantize_current(x, torch.float8_e4m3fn, True)
    launcher = EagerLauncher.of(quantize._cast_kernel)
    keys = len(launcher.compiled)
    for _ in range(3):
        again = quantize.quantize_current(x, torch.float8_e4m3fn, True)
        for a, b in zip(again, first, strict=True):
            assert_bits_equal(a, b)
    assert len(launcher.compiled) == keys >= 1
    # this Triton's kernels launch through their C launcher
    assert all(fire is not None for _, fire in launcher.compiled.values())
    w = torch.randn(256, device="cuda", generator=g, dtype=torch.bfloat16)
    y1 = torch.ops.te.rmsnorm_fwd(x, w, 1e-5, False)
    y2 = torch.ops.te.rmsnorm_fwd(x, w, 1e-5, False)
    for a, b in zip(y2, y1, strict=True):
        assert_bits_equal(a, b)


def test_next_pow2_is_tritons_next_power_of_2():
    """The host-side block-size helper gives Triton's values (0 for 0, the least power of 2 >= n
    otherwise), for small sizes and past 2**31."""
    import triton

    for n in [*range(0, 1100), 2**20 - 1, 2**20, 2**20 + 1, 2**31 + 5, 3 * 2**40]:
        assert next_pow2(n) == triton.next_power_of_2(n), n
