"""Instructions per element of the FP8 quantisation kernels, from their SASS for sm90, compiled
on any machine (no GPU needed: Triton's compiler and the ``ptxas`` / ``cuobjdump`` its NVIDIA
backend ships). Not a timing: a guide for kernels whose time is bound by instruction issue.

An H100 issues ~0.93e12 warp instructions a second (132 SMs x 4 schedulers x 1.755 GHz), so a
kernel of ``n`` instructions an element over ``E`` elements needs at least ``E * n / 32 / 0.93e12``
seconds whatever its bytes: for the MLP benchmark's ``[16384, 16384]`` activation, 9 us per
instruction an element; the same tensor's bytes (read 2, write 1 + 1 an element) take ~340 us.

    python -m bench.diag.sass_quantize            # prints a table; CPU is fine
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def compile_sm90(fn, types: dict, consts: dict, num_warps: int = 4):
    """``fn`` specialised with ``consts`` and compiled for sm90 (``.asm["ptx"]``, ``["cubin"]``)."""
    sig = {p: "constexpr" if p in consts else types[p] for p in fn.arg_names}
    # Pointer and integer arguments divisible by 16, as Triton's launcher specialises them.
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, p in enumerate(fn.arg_names)
        if p not in consts and not types[p].startswith("fp")
    }
    return triton.compile(
        ASTSource(fn, sig, constexprs=dict(consts), attrs=attrs),
        target=GPUTarget("cuda", 90, 128),
        options={"num_warps": num_warps},
    )


def sass_counts(
    fn, types: dict, consts: dict, num_warps: int = 4
) -> tuple[int, collections.Counter]:
    """(instructions, opcode counts) of ``fn`` specialised with ``consts`` for sm90."""
    kernel = compile_sm90(fn, types, consts, num_warps)
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        text = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
    lines = [ln for ln in text.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", ln)]
    ops = collections.Counter(
        re.sub(r"^\s+/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?", "", ln).split()[0].split(".")[0]
        for ln in lines
    )
    return len(lines), ops


def main() -> int:
    os.environ.pop("TRITON_INTERPRET", None)
    from te_compile.kernels import act_quantize as AQ
    from te_compile.kernels import quantize as Q

    act_types = dict(
        Z="*bf16", B="*bf16", G="*bf16", MEAN="*fp32", RSIG="*fp32", SCALE="*fp32",
        AMAX_BITS="*i32", AMAX_SLOT="i32", DATA="*u8", DATA_T="*u8", SCALE_INV="*fp32",
        PART="*fp32", M="i32",
        M_OUT="i32", N="i32", fp8_max="fp32", eps="fp32",
    )  # fmt: skip
    cast_types = dict(
        X="*bf16", SCALE="*fp32", AMAX_BITS="*i32", AMAX_SLOT="i32", DATA="*u8", DATA_T="*u8",
        SCALE_INV="*fp32", M="i32", K="i32", fp8_max="fp32", eps="fp32",
    )  # fmt: skip
    e4m3 = dict(E4M3=True, MBITS=3, BIAS=7)
    e5m2 = dict(E4M3=False, MBITS=2, BIAS=15)
    act = dict(FN=0, GATED=False, HAS_BIAS=True, ROUND=1, SOFTWARE=False, GUARD=False, EVEN=True)
    rows = []
    for bm, bn in ((64, 64), (64, 128), (128, 64)):
        tile = dict(BLOCK_M=bm, BLOCK_N=bn)
        cases = [
            ("act_amax gelu fwd (current, pass 1)", AQ._act_amax_kernel,
             dict(act, BWD=False, DBIAS=False, **tile)),
            ("act_cast gelu fwd current (pass 2)", AQ._act_cast_kernel,
             dict(act, BWD=False, DBIAS=False, FROM_AMAX=True, COLUMNWISE=True, **e4m3, **tile)),
            ("act_cast gelu fwd delayed", AQ._act_cast_kernel,
             dict(act, BWD=False, DBIAS=False, FROM_AMAX=False, COLUMNWISE=True, **e4m3, **tile)),
            ("act_amax gelu bwd + dbias (current, pass 1)", AQ._act_amax_kernel,
             dict(act, BWD=True, DBIAS=True, **tile)),
            ("act_cast gelu bwd current (pass 2)", AQ._act_cast_kernel,
             dict(act, BWD=True, DBIAS=True, FROM_AMAX=True, COLUMNWISE=True, **e5m2, **tile)),
            ("act_cast gelu bwd delayed + dbias", AQ._act_cast_kernel,
             dict(act, BWD=True, DBIAS=True, FROM_AMAX=False, COLUMNWISE=True, **e5m2, **tile)),
        ]  # fmt: skip
        types = act_types
        cases.append(
            ("cast (quantize_tensorwise)", Q._cast_kernel,
             dict(SOFTWARE=False, GUARD=False, FROM_AMAX=False, POW2=False, COLUMNWISE=True, **e4m3,
                  BLOCK_M=bm, BLOCK_K=bn))
        )  # fmt: skip
        for name, fn, consts in cases:
            t = cast_types if fn is Q._cast_kernel else types
            consts = {k: v for k, v in consts.items() if k in fn.arg_names}
            n, ops = sass_counts(fn, t, consts)
            per = n / (bm * bn / 128)
            top = ", ".join(f"{k} {v}" for k, v in ops.most_common(5))
            rows.append(f"| {name} | {bm}x{bn} | {n} | {per:.1f} | {top} |")
    print(
        f"triton {triton.__version__}, sm90, 4 warps; per element = SASS / (tile / 128 threads)\n"
    )
    print("| kernel | tile | SASS instructions | per element | top opcodes |")
    print("| --- | --- | ---: | ---: | --- |")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
