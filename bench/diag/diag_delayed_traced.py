"""DelayedScaling's GEMM ops traced through by Inductor on CUDA: what breaks, where.

On CUDA the ``te::linear_*`` / ``te::mlp_*`` calls under DelayedScaling are kept whole
(``functional.gemm.delayed_on_cuda``): traced through, Inductor once handed ``_scaled_mm`` a
scale 8 bytes into a buffer (``CUBLAS_STATUS_NOT_SUPPORTED``). This runs compiled training
steps with that rule switched off (``--traced``, the default) or on (``--kept``), and for each
case reports:

* every ``_scaled_mm`` call of the compiled code whose tensors are not 16-byte aligned (the
  extern kernel wrapped: its arguments as Inductor passes them);
* the generated code of the first delayed step (autocast inside the compiled region): its
  ``_scaled_mm`` calls, buffer reuses (``# reuse``) and reinterpreted views;
* outputs, input gradients and the delayed-scaling state against eager, step by step;
* the error, if a step raises.

    python -m bench.diag.diag_delayed_traced            # CUDA
    python -m bench.diag.diag_delayed_traced --kept
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import traceback
from pathlib import Path
from unittest import mock

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from torch._inductor.graph import GraphLowering
from torch._inductor.select_algorithm import extern_kernels

import te_compile as te
from te_compile.quantization import DelayedScaling, autocast

GEMM_OPS = ("linear_fwd", "linear_bwd", "mlp_fwd", "mlp_bwd")
CASES = {  # name: (module factory, tokens)
    "linear_64x48_t32": (
        lambda: te.Linear(64, 48, params_dtype=torch.bfloat16, device=DEVICE[0]),
        32,
    ),
    "linear_4096x1024_t8192": (
        lambda: te.Linear(4096, 1024, params_dtype=torch.bfloat16, device=DEVICE[0]),
        8192,
    ),
    "mlp_1024x4096_t8192": (
        lambda: te.LayerNormMLP(
            1024, 4096, activation="swiglu", params_dtype=torch.bfloat16, device=DEVICE[0]
        ),
        8192,
    ),
}
DEVICE = ["cuda"]  # --device
MISALIGNED: list[tuple] = []
DTYPES: list[tuple] = []  # (a.dtype, b.dtype, a.stride, b.stride) of each _scaled_mm call


def _checked_scaled_mm(original):
    def scaled_mm(*args, **kwargs):
        for i, t in enumerate(args[:4]):
            if isinstance(t, torch.Tensor) and t.data_ptr() % 16:
                MISALIGNED.append((("a", "b", "scale_a", "scale_b")[i], t.data_ptr() % 16,
                                   tuple(t.shape), t.dtype))  # fmt: skip
        if len(args) >= 2:  # the operands' formats (E5M2 x E5M2 has no cuBLAS kernel)
            DTYPES.append((args[0].dtype, args[1].dtype, tuple(args[0].stride()),
                           tuple(args[1].stride())))  # fmt: skip
        return original(*args, **kwargs)

    return scaled_mm


def _state(model: torch.nn.Module) -> list[torch.Tensor]:
    return [b.clone() for n, b in model.named_buffers() if n.endswith(("scale", "amax_history"))]


def run_case(name: str, show_code: bool, inside: bool) -> None:
    make, tokens = CASES[name]
    torch.manual_seed(0)
    eager, compiled_model = make(), make()
    compiled_model.load_state_dict(eager.state_dict())
    hidden = eager.weight.shape[1] if hasattr(eager, "weight") else 1024
    recipe = DelayedScaling()

    def step_eager(x):
        with autocast(recipe=recipe):
            return eager(x)

    if inside:

        def body(x):
            with autocast(recipe=recipe):
                return compiled_model(x)

        step_compiled = torch.compile(body)
    else:
        inner = torch.compile(compiled_model)

        def step_compiled(x):
            with autocast(recipe=recipe):
                return inner(x)

    MISALIGNED.clear()
    DTYPES.clear()
    for i in range(4):
        g = torch.Generator(device=DEVICE[0]).manual_seed(i)
        x0 = torch.randn(tokens, hidden, device=DEVICE[0], dtype=torch.bfloat16, generator=g)
        xe, xc = x0.clone().requires_grad_(), x0.clone().requires_grad_()
        ye = step_eager(xe)
        ye.float().square().mean().backward()
        codes: list[str] = []
        # Step 1 is the first delayed step (step 0 calibrates with current scaling): the
        # recompile whose code matters; kept even when the step raises.
        capture = mock.patch.object(GraphLowering, "save_output_code", codes.append)
        try:
            with capture if show_code and i == 1 else contextlib.nullcontext():
                yc = step_compiled(xc)
                yc.float().square().mean().backward()
            if DEVICE[0] == "cuda":
                torch.cuda.synchronize()
        except Exception as e:  # a diagnostic: report the failure and go on
            print(f"  {name} step {i}: {type(e).__name__}: {str(e)[:400]}")
            print(f"    misaligned _scaled_mm args before the error: {MISALIGNED[:8]}")
            print(f"    the last _scaled_mm calls (a, b dtypes and strides): {DTYPES[-4:]}")
            traceback.print_exc(limit=3)
            return
        finally:
            for code in codes:
                for line in code.splitlines():
                    if "_scaled_mm" in line or "# reuse" in line or "reinterpret_tensor(" in line:
                        print("    code:", line.strip()[:240])
        out_err = ((yc.float() - ye.float()).norm() / ye.float().norm()).item()
        dx_err = ((xc.grad.float() - xe.grad.float()).norm() / xe.grad.float().norm()).item()
        state_same = all(
            torch.equal(a, b) for a, b in zip(_state(eager), _state(compiled_model), strict=True)
        )
        bad = MISALIGNED[:4]
        print(f"  {name} step {i}: rel. err out {out_err:.2e} dx {dx_err:.2e}, "
              f"state bit-equal {state_same}, misaligned _scaled_mm args {bad}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kept", action="store_true", help="keep the delayed calls whole")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of the script")
    where = ("inside", "outside")
    parser.add_argument("--placements", nargs="+", choices=where, default=list(where),
                        help="autocast entered inside or outside the compiled region")  # fmt: skip
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES))
    args = parser.parse_args()
    DEVICE[0] = args.device
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("diag_delayed_traced: needs CUDA (--device cpu: a smoke run)")
    if not args.kept:
        for name in GEMM_OPS:
            family = "mlp" if name.startswith("mlp") else "linear"
            getattr(sys.modules[f"te_compile.functional.{family}_ops"], name).kept_whole = None
    extern_kernels._scaled_mm = _checked_scaled_mm(torch._scaled_mm)
    print("delayed GEMM ops", "kept whole" if args.kept else "traced through")
    for name in args.cases:
        for inside in (p == "inside" for p in args.placements):
            print(f"{name}, autocast {'inside' if inside else 'outside'} the compiled region")
            run_case(name, show_code=inside, inside=inside)


if __name__ == "__main__":
    main()
