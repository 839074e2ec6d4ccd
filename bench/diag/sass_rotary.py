"""Instructions per element of the RoPE kernel (``te_compile/kernels/rotary.py``) from its SASS
for sm90, compiled on any machine (no GPU needed; ``sass_quantize.sass_counts``). Not a timing: a
guide to whether the kernel can be memory-bound.

An H100 / H200 issues ~0.93e12 warp instructions a second, so ``n`` instructions an element over
``E`` elements need at least ``E * n / 32 / 0.93e12`` seconds; for the benchmark's query tensor
(``4096 x 2 x 32 x 128`` bf16, 33.5M elements, read and written once: ~40 us of copy at
3.3 TB/s) that is ~1.1 us per instruction an element, so the kernel stays memory-bound below
~35 instructions an element. The trigonometry is the expensive part (libdevice's ``sinf`` /
``cosf`` with full range reduction, inlined): the column "range reductions" counts the
multiplications by 2/pi, one per angle evaluated.

    python -m bench.diag.sass_rotary            # prints a table; CPU is fine
"""

from __future__ import annotations

import os
import sys

from bench.diag.sass_quantize import compile_sm90, sass_counts

TYPES = dict(
    X="*bf16", OUT="*bf16", FREQS="*fp32", CU="*i32", n_rows="i32", n_inner="i32", n_heads="i32",
    sx_outer="i64", sx_inner="i64", sx_head="i64", so_outer="i64", so_inner="i64",
    so_head="i64", freqs_rows="i32", freqs_stride="i32", pairs="i32", d2="i32", d="i32",
    seq_len="i32", n_seqs="i32", cp_size="i32", cp_rank="i32", rot_chunks="i32",
)  # fmt: skip


def main() -> int:
    os.environ.pop("TRITON_INTERPRET", None)
    from te_compile.kernels import rotary as R

    fmts = {"sbhd": R.SBHD.value, "thd": R.THD.value}
    rows = []
    for heads in (32, 8):
        cfg = R.launch_config(heads, 64, 0)
        per_thread = 2 * cfg.block_t * cfg.block_h * cfg.block_p / (32 * cfg.num_warps)
        for fmt, interleaved, backward in (
            ("sbhd", False, False),
            ("sbhd", False, True),
            ("thd", False, False),
            ("sbhd", True, False),
        ):
            consts = dict(
                FORMAT=fmts[fmt], INTERLEAVED=interleaved, BACKWARD=backward, BF16=False,
                BLOCK_T=cfg.block_t, BLOCK_H=cfg.block_h, BLOCK_P=cfg.block_p,
                BLOCK_C=cfg.block_c,
            )  # fmt: skip
            n, ops = sass_counts(R._rotary_kernel, TYPES, consts, num_warps=cfg.num_warps)
            name = f"{fmt}{' interleaved' if interleaved else ''} {'bwd' if backward else 'fwd'}"
            tile = f"{cfg.block_t}x{cfg.block_h}x{cfg.block_p}"
            top = ", ".join(f"{k} {v}" for k, v in ops.most_common(4))
            rows.append(
                f"| {name} | {heads} | {tile} | {n} | {n / per_thread:.1f} | "
                f"{_range_reductions(R, consts, cfg)} | {top} |"
            )
    print("sm90; per element = SASS instructions / elements a thread owns in one program\n")
    print(
        "| case | heads | tile (rows x heads x pairs) | SASS | per element | "
        "range reductions / thread | top opcodes |"
    )
    print("| --- | ---: | --- | ---: | ---: | ---: | --- |")
    print("\n".join(rows))
    return 0


def _range_reductions(R, consts: dict, cfg) -> int:
    """Multiplications by 2/pi (0f3F22F983) in the kernel's PTX: one per angle evaluated."""
    kernel = compile_sm90(R._rotary_kernel, TYPES, consts, num_warps=cfg.num_warps)
    return kernel.asm["ptx"].count("0f3F22F983")


if __name__ == "__main__":
    sys.exit(main())
