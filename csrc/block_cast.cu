// Float8BlockScaling casts in CUDA, both layouts from one read of the input:
//
// te_cuda::act_cast_1x128 — GELU or SwiGLU (or its gradient, or the input itself) cast to FP8
// in 1x128 blocks.
// te_cuda::cast_128x128 — a bf16 matrix (a weight) cast in 128x128 blocks and its transpose
// (same blocks, same scales), as kernels/quantize.py's _block_kernel with BLOCK_ROWS=128.
//
// The fused activation + Float8BlockScaling cast of te::mlp_fp8 (kernels/act_quantize.py,
// act_quantize_block) needs, from h = gelu(z + b) (forward) or dz = dh * gelu'(z + b)
// (backward), a rowwise copy in 1x128 blocks along the features and a transposed copy in 1x128
// blocks along the tokens. In Triton the one-tile form of that kernel (a 128x128 tile reduced
// along both axes) ran at ~1.7 TB/s on the H100 and the default reads the input twice (one
// pass per layout). Here one CTA owns a 128x128 tile: a row pass (16-byte loads, half a warp a
// row) computes the values, casts each row's block and keeps the rounded values in shared
// memory; a column pass casts each column's block from there (32-bit stores of four tokens'
// codes). The input is read once.
//
// The arithmetic is the Triton kernels', operation for operation, so the bytes are identical
// (tests/kernels/test_act_cast_cuda.py checks that on the GPU):
//   a = z + b (fp32); gelu: s = rcp.approx(1 + ex2.approx(a * fma(K1, a*a, K0))), h = a * s;
//   gelu': p = a * fma(C1, a*a, C0), d = fma(p, fma(-s, s, s), s), dz = dh * d;
//   the value rounded to bf16 (RNE); block amax = integer max of |x| bits (NaN propagates);
//   scale = fp8_max / amax correctly rounded (1 for amax 0, NaN for inf or NaN, FLT_MAX for an
//   overflow, optionally truncated to a power of two); code = cvt.rn.satfinite(x * scale);
//   scale_inv = 1 / scale correctly rounded. The bias gradient partial sums are of the unrounded
//   dz, per 128-row tile (summed in another order than Triton's: equal to rounding).
//
//   swiglu (z = [a | l], contiguous halves): s = rcp.approx(1 + ex2.approx(a * -log2 e)),
//   h = (a * s) * l; backward dl = dh * (a * s), da = (dh * l) * fma(a, fma(-s, s, s), s), one
//   CTA per 128x128 tile of dz (an activation-half tile or a linear-half tile of the same rows,
//   the dh and z tiles under it read once each; the linear-half CTA does not read l).
//
// Scope: bf16 input, whole 128x128 tiles (M and N multiples of 128, no padding rows). Other
// cases stay on the Triton kernels. Registered in its own namespace: it is a kernel called by
// te:: ops' CUDA implementations, not an op of the library.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <torch/library.h>

#include <cstdint>

namespace {

constexpr int kTile = 128;
constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kRowsPerWarp = kTile / kWarps;  // 16
// The tile in shared memory as bf16 pairs (32-bit words), 64 words a row, word w of row r at
// r * 64 + (w ^ ((r / 4) % 32)): the column pass, where lane l reads rows 4l .. 4l + 3 of one
// word column, hits 32 different banks (and each lane can store its four rows' codes as one
// 32-bit word); the row pass's writes stay within their row.
constexpr int kWordsPerRow = kTile / 2;

__device__ __forceinline__ int tile_word(int r, int w) {
  return r * kWordsPerRow + (w ^ ((r >> 2) & 31));
}

// The Triton kernels' constants, folded in double and rounded to fp32 (kernels/activation.py).
constexpr float kK0 = static_cast<float>(-1.5957691216057308 * 1.4426950408889634);
constexpr float kK1 = static_cast<float>(-1.5957691216057308 * 1.4426950408889634 * 0.044715);
constexpr float kC0 = static_cast<float>(1.5957691216057308);
constexpr float kC1 = static_cast<float>(1.5957691216057308 * 0.134145);

__device__ __forceinline__ float ex2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float rcp_approx(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// sigmoid(2u) of gelu's tanh form, as kernels/activation.py's _gelu_sigmoid.
__device__ __forceinline__ float gelu_sigmoid(float a, float aa) {
  return rcp_approx(__fadd_rn(1.0f, ex2_approx(__fmul_rn(a, __fmaf_rn(kK1, aa, kK0)))));
}

// What a kernel casts: gelu(z + b), its gradient dh * gelu'(z + b), swiglu of z + b = [a | l]
// or its gradient (both halves of dz), or z itself (a plain 1x128 cast of a bf16 tensor, e.g.
// the output gradient, its column sums the bias gradient).
enum Mode : int { kGeluFwd = 0, kGeluBwd = 1, kIdentity = 2, kSwigluFwd = 3, kSwigluBwd = 4 };

constexpr float kNegLog2e = static_cast<float>(-1.4426950408889634);

// sigmoid(a) as kernels/activation.py's _sigmoid.
__device__ __forceinline__ float sigmoid(float a) {
  return rcp_approx(__fadd_rn(1.0f, ex2_approx(__fmul_rn(a, kNegLog2e))));
}

// SwiGLU's value at one element: h = silu(a) * l (forward); dz's element of the activation half
// (da = dh * l * silu'(a)) or, with lin_half, of the linear half (dl = dh * silu(a)).
template <bool kBwd>
__device__ __forceinline__ float swiglu(float a, float l, float g, bool lin_half) {
  const float s = sigmoid(a);
  if (!kBwd) return __fmul_rn(__fmul_rn(a, s), l);
  if (lin_half) return __fmul_rn(g, __fmul_rn(a, s));
  return __fmul_rn(__fmul_rn(g, l), __fmaf_rn(a, __fmaf_rn(-s, s, s), s));
}

template <bool kBwd>
__device__ __forceinline__ float activation(float a, float g) {
  const float aa = __fmul_rn(a, a);
  const float s = gelu_sigmoid(a, aa);
  if (!kBwd) return __fmul_rn(a, s);
  const float p = __fmul_rn(a, __fmaf_rn(kC1, aa, kC0));
  const float d = __fmaf_rn(p, __fmaf_rn(-s, s, s), s);
  return __fmul_rn(g, d);
}

__device__ __forceinline__ float round_bf16(float v) {
  return __bfloat162float(__float2bfloat16_rn(v));
}

__device__ __forceinline__ int abs_bits(float x) {
  return __float_as_int(x) & 0x7FFFFFFF;
}

__device__ __forceinline__ int warp_max(int v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
  return v;
}

// kernels/quantize.py's _block_scale: _scale_from_amax with eps 0, NaN for a block holding inf
// (a NaN amax gives NaN already): the block dequantises to NaN instead of saturating.
__device__ __forceinline__ float scale_from_amax(float amax, float fp8_max, bool pow2) {
  if (amax == __int_as_float(0x7F800000)) return __int_as_float(0x7FC00000);
  const bool unit = amax == 0.0f;
  float s = __fdiv_rn(fp8_max, unit ? 1.0f : amax);
  if (s == __int_as_float(0x7F800000)) s = 3.4028234663852886e38f;
  if (pow2 && s == s) s = __int_as_float(__float_as_int(s) & static_cast<int>(0xFF800000u));
  return unit ? 1.0f : s;
}

__device__ __forceinline__ uint8_t to_fp8(float y, bool e4m3) {
  return e4m3 ? __nv_cvt_float_to_fp8(y, __NV_SATFINITE, __NV_E4M3)
              : __nv_cvt_float_to_fp8(y, __NV_SATFINITE, __NV_E5M2);
}

// v[0..3] times s as FP8 codes, packed into one word (v[0] in the low byte).
__device__ __forceinline__ uint32_t fp8x4(const float* v, float s, bool e4m3) {
  uint32_t q = 0;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    q |= static_cast<uint32_t>(to_fp8(__fmul_rn(v[k], s), e4m3)) << (8 * k);
  }
  return q;
}

// A column pass step's codes (four rows of columns col and col + 1) into the transposed copy.
__device__ __forceinline__ void store_column_pair(uint8_t* __restrict__ data_t, int64_t col,
                                                  int64_t row, int64_t m, uint32_t q_lo,
                                                  uint32_t q_hi) {
  uint8_t* out = data_t + col * m + row;
  *reinterpret_cast<uint32_t*>(out) = q_lo;
  *reinterpret_cast<uint32_t*>(out + m) = q_hi;
}

__device__ __forceinline__ float bf16_lo(uint32_t w) {
  return __uint_as_float(w << 16);
}

__device__ __forceinline__ float bf16_hi(uint32_t w) {
  return __uint_as_float(w & 0xFFFF0000u);
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  // Both already bf16 values: their top halves are exact.
  return (__float_as_uint(lo) >> 16) | (__float_as_uint(hi) & 0xFFFF0000u);
}

// Where a cast writes (both layouts' codes and block inverse scales, the scales' strides: row,
// block) and its FP8 format: one kernel parameter for both kernels.
struct CastOut {
  uint8_t* data;
  float* scale_inv;
  uint8_t* data_t;
  float* scale_inv_t;
  int64_t s_row, s_blk, t_row, t_blk;
  float fp8_max;
  bool e4m3;
  bool pow2;
};

// CTAs a multiprocessor must hold (the register budget): more CTAs overlap one's loads with
// another's arithmetic; the backward's larger state spills below ~85 registers.
constexpr int min_ctas(int mode) {
  return mode == kGeluFwd ? 4 : 3;
}

template <int kMode, bool kDbias>
__global__ void __launch_bounds__(kThreads, min_ctas(kMode)) act_cast_1x128_kernel(
    const __nv_bfloat16* __restrict__ z,
    const __nv_bfloat16* __restrict__ bias,
    const __nv_bfloat16* __restrict__ grad,
    const CastOut out,
    float* __restrict__ part,
    int64_t m,
    int64_t n,
    bool has_bias) {
  // n: the activation's output columns (dh's); z (and the bias) hold 2n for SwiGLU, as does the
  // cast tensor of its backward (dz). CTA (x, y) casts the cast tensor's tile (y, x).
  __shared__ __align__(16) uint32_t tile_words[kTile * kWordsPerRow];
  __shared__ float colsum[kDbias ? 2 * kWarps : 1][kTile];
  constexpr bool kBwd = kMode == kGeluBwd || kMode == kSwigluBwd;
  constexpr bool kGated = kMode == kSwigluFwd || kMode == kSwigluBwd;
  const int64_t zn = kGated ? 2 * n : n;             // z's row stride
  const int64_t on = kMode == kSwigluBwd ? 2 * n : n;  // the cast tensor's
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const int64_t ocol0 = static_cast<int64_t>(blockIdx.x) * kTile;  // in the cast tensor
  const bool lin_half = kMode == kSwigluBwd && ocol0 >= n;
  const int64_t col0 = lin_half ? ocol0 - n : ocol0;  // in dh (and z's activation half)

  // Row pass: lane l of warp w takes columns 8 (l % 16) .. 8 (l % 16) + 7 of rows 16w + l / 16,
  // 16w + 2 + l / 16, ...: one 16-byte load a row piece, two rows a warp instruction.
  const int half = lane / 16;
  const int l16 = lane % 16;
  float b[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  float bl[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  if (has_bias) {
    const uint4 bv = *reinterpret_cast<const uint4*>(bias + col0 + 8 * l16);
    const uint32_t bw[4] = {bv.x, bv.y, bv.z, bv.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) b[2 * j] = bf16_lo(bw[j]), b[2 * j + 1] = bf16_hi(bw[j]);
    if (kGated) {
      const uint4 lv = *reinterpret_cast<const uint4*>(bias + n + col0 + 8 * l16);
      const uint32_t lw[4] = {lv.x, lv.y, lv.z, lv.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) bl[2 * j] = bf16_lo(lw[j]), bl[2 * j + 1] = bf16_hi(lw[j]);
    }
  }
  float csum[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};

  // A thread's row pieces are loaded kGroup at a time before any of them is used (GELU's
  // forward the whole tile, the others a half or, SwiGLU's backward with three inputs, a
  // quarter): many loads in flight per CTA at a register count that keeps min_ctas CTAs on a
  // multiprocessor.
  constexpr int kIters = kRowsPerWarp / 2;
  constexpr int kGroup = kMode == kSwigluBwd ? kIters / 4
                         : (kBwd || kGated)   ? kIters / 2
                                              : kIters;
  const bool load_lin = kMode == kSwigluFwd || (kMode == kSwigluBwd && !lin_half);
#pragma unroll
  for (int i0 = 0; i0 < kIters; i0 += kGroup) {
    uint4 zv[kGroup];
    uint4 gv[kBwd ? kGroup : 1];
    uint4 lv[kGated ? kGroup : 1];
#pragma unroll
    for (int it = 0; it < kGroup; ++it) {
      const int64_t r = row0 + warp * kRowsPerWarp + 2 * (i0 + it) + half;
      const int64_t zoff = r * zn + col0 + 8 * l16;
      zv[it] = __ldg(reinterpret_cast<const uint4*>(z + zoff));
      if (kGated) {
        lv[it] = load_lin ? __ldg(reinterpret_cast<const uint4*>(z + zoff + n)) : zv[it];
      }
      if (kBwd) gv[it] = __ldg(reinterpret_cast<const uint4*>(grad + r * n + col0 + 8 * l16));
    }

#pragma unroll
    for (int it = 0; it < kGroup; ++it) {
      const int r = warp * kRowsPerWarp + 2 * (i0 + it) + half;
      const int64_t off = (row0 + r) * on + ocol0 + 8 * l16;
      const uint32_t zw[4] = {zv[it].x, zv[it].y, zv[it].z, zv[it].w};
      uint32_t gw[4] = {0, 0, 0, 0};
      uint32_t lw[4] = {0, 0, 0, 0};
      if (kBwd) gw[0] = gv[it].x, gw[1] = gv[it].y, gw[2] = gv[it].z, gw[3] = gv[it].w;
      if (kGated) lw[0] = lv[it].x, lw[1] = lv[it].y, lw[2] = lv[it].z, lw[3] = lv[it].w;
      float x[8];
      int amax = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float zf = j % 2 ? bf16_hi(zw[j / 2]) : bf16_lo(zw[j / 2]);
        const float gf = j % 2 ? bf16_hi(gw[j / 2]) : bf16_lo(gw[j / 2]);
        const float a = has_bias ? __fadd_rn(zf, b[j]) : zf;
        float v;
        if (kGated) {
          const float lf = j % 2 ? bf16_hi(lw[j / 2]) : bf16_lo(lw[j / 2]);
          v = swiglu<kBwd>(a, has_bias ? __fadd_rn(lf, bl[j]) : lf, gf, lin_half);
        } else {
          v = kMode == kIdentity ? a : activation<kBwd>(a, gf);
        }
        if (kDbias) csum[j] += v;
        x[j] = kMode == kIdentity ? v : round_bf16(v);
        amax = max(amax, abs_bits(x[j]));
      }
#pragma unroll
      for (int o = 8; o > 0; o >>= 1) amax = max(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
      const float s = scale_from_amax(__int_as_float(amax), out.fp8_max, out.pow2);
      *reinterpret_cast<uint2*>(out.data + off) =
          make_uint2(fp8x4(x, s, out.e4m3), fp8x4(x + 4, s, out.e4m3));
      if (l16 == 0) {
        out.scale_inv[(row0 + r) * out.s_row + blockIdx.x * out.s_blk] = __fdiv_rn(1.0f, s);
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        tile_words[tile_word(r, 4 * l16 + j)] = pack_bf16(x[2 * j], x[2 * j + 1]);
      }
    }
  }
  if (kDbias) {
#pragma unroll
    for (int j = 0; j < 8; ++j) colsum[2 * warp + half][8 * l16 + j] = csum[j];
  }
  __syncthreads();
  if (kDbias && threadIdx.x < kTile) {
    float t = 0.0f;
#pragma unroll
    for (int k = 0; k < 2 * kWarps; ++k) t += colsum[k][threadIdx.x];
    part[static_cast<int64_t>(blockIdx.y) * on + ocol0 + threadIdx.x] = t;
  }

  // Column pass: warp w owns columns 16w .. 16w + 15, two at a time (one shared word); lane l
  // rows 4l .. 4l + 3, whose codes it stores as one 32-bit word per column.
#pragma unroll 2
  for (int p = 0; p < kTile / kWarps / 2; ++p) {
    const int c = warp * (kTile / kWarps) + 2 * p;
    float lo[4], hi[4];
    int amax_lo = 0, amax_hi = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint32_t word = tile_words[tile_word(4 * lane + k, c / 2)];
      lo[k] = bf16_lo(word), hi[k] = bf16_hi(word);
      amax_lo = max(amax_lo, abs_bits(lo[k]));
      amax_hi = max(amax_hi, abs_bits(hi[k]));
    }
    amax_lo = warp_max(amax_lo);
    amax_hi = warp_max(amax_hi);
    const float s_lo = scale_from_amax(__int_as_float(amax_lo), out.fp8_max, out.pow2);
    const float s_hi = scale_from_amax(__int_as_float(amax_hi), out.fp8_max, out.pow2);
    store_column_pair(out.data_t, ocol0 + c, row0 + 4 * lane, m, fp8x4(lo, s_lo, out.e4m3),
                      fp8x4(hi, s_hi, out.e4m3));
    if (lane == 0) {
      out.scale_inv_t[(ocol0 + c) * out.t_row + blockIdx.y * out.t_blk] = __fdiv_rn(1.0f, s_lo);
      out.scale_inv_t[(ocol0 + c + 1) * out.t_row + blockIdx.y * out.t_blk] = __fdiv_rn(1.0f, s_hi);
    }
  }
}

// 128x128 blocks: one CTA a tile. The tile's bf16 pairs go to shared memory as they arrive and
// its amax is reduced over the CTA; the rowwise codes are cast from the registers, the
// transposed ones from shared memory (the column pass of act_cast_1x128_kernel, one scale).
__global__ void __launch_bounds__(kThreads, 4) cast_128x128_kernel(
    const __nv_bfloat16* __restrict__ x,
    const CastOut out,
    int64_t m,
    int64_t n) {
  __shared__ __align__(16) uint32_t tile_words[kTile * kWordsPerRow];
  __shared__ int warp_amax[kWarps];
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int half = lane / 16;
  const int l16 = lane % 16;
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * kTile;
  constexpr int kIters = kRowsPerWarp / 2;
  uint4 v[kIters];
#pragma unroll
  for (int it = 0; it < kIters; ++it) {
    const int64_t off = (row0 + warp * kRowsPerWarp + 2 * it + half) * n + col0 + 8 * l16;
    v[it] = __ldg(reinterpret_cast<const uint4*>(x + off));
  }
  int amax = 0;
#pragma unroll
  for (int it = 0; it < kIters; ++it) {
    const int r = warp * kRowsPerWarp + 2 * it + half;
    const uint32_t w[4] = {v[it].x, v[it].y, v[it].z, v[it].w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      tile_words[tile_word(r, 4 * l16 + j)] = w[j];
      amax = max(amax, max(abs_bits(bf16_lo(w[j])), abs_bits(bf16_hi(w[j]))));
    }
  }
  amax = warp_max(amax);
  if (lane == 0) warp_amax[warp] = amax;
  __syncthreads();
#pragma unroll
  for (int k = 0; k < kWarps; ++k) amax = max(amax, warp_amax[k]);
  const float s = scale_from_amax(__int_as_float(amax), out.fp8_max, out.pow2);

#pragma unroll
  for (int it = 0; it < kIters; ++it) {
    const int64_t off = (row0 + warp * kRowsPerWarp + 2 * it + half) * n + col0 + 8 * l16;
    const uint32_t w[4] = {v[it].x, v[it].y, v[it].z, v[it].w};
    float xf[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) xf[j] = j % 2 ? bf16_hi(w[j / 2]) : bf16_lo(w[j / 2]);
    *reinterpret_cast<uint2*>(out.data + off) =
        make_uint2(fp8x4(xf, s, out.e4m3), fp8x4(xf + 4, s, out.e4m3));
  }

#pragma unroll 2
  for (int p = 0; p < kTile / kWarps / 2; ++p) {
    const int c = warp * (kTile / kWarps) + 2 * p;
    float lo[4], hi[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint32_t word = tile_words[tile_word(4 * lane + k, c / 2)];
      lo[k] = bf16_lo(word), hi[k] = bf16_hi(word);
    }
    store_column_pair(out.data_t, col0 + c, row0 + 4 * lane, m, fp8x4(lo, s, out.e4m3),
                      fp8x4(hi, s, out.e4m3));
  }
  if (threadIdx.x == 0) {
    const float inv = __fdiv_rn(1.0f, s);
    out.scale_inv[blockIdx.y * out.s_row + blockIdx.x * out.s_blk] = inv;
    out.scale_inv_t[blockIdx.x * out.t_row + blockIdx.y * out.t_blk] = inv;
  }
}


void check_2d(const char* op, const at::Tensor& t, const char* name, at::ScalarType dtype,
              int64_t rows, int64_t cols) {
  TORCH_CHECK_VALUE(t.is_cuda() && t.scalar_type() == dtype && t.is_contiguous() &&
                        t.dim() == 2 && t.size(0) == rows && t.size(1) == cols,
                    "te_cuda::", op, ": ", name, " must be a contiguous CUDA ", dtype,
                    " tensor [", rows, ", ", cols, "], got ", t.scalar_type(), " ", t.sizes());
}

// Block scales [rows, blocks]: compact (row-major), or rows-major (strides (1, rows)): the layout
// cuBLAS's blockwise-scaled GEMM takes for a 1x128-scaled operand, written directly so that the
// GEMM needs no copy.
void check_scales(const char* op, const at::Tensor& t, const char* name, int64_t rows,
                  int64_t blocks) {
  const bool layout =
      t.dim() == 2 && (t.is_contiguous() || (t.stride(0) == 1 && t.stride(1) == rows));
  TORCH_CHECK_VALUE(t.is_cuda() && t.scalar_type() == at::kFloat && layout &&
                        t.size(0) == rows && t.size(1) == blocks,
                    "te_cuda::", op, ": ", name, " must be a CUDA float32 tensor [", rows,
                    ", ", blocks, "], contiguous or with strides (1, ", rows, "), got ",
                    t.scalar_type(), " ", t.sizes(), " strides ", t.strides());
}

CastOut cast_out(const at::Tensor& data, const at::Tensor& scale_inv, const at::Tensor& data_t,
                 const at::Tensor& scale_inv_t, double fp8_max, bool e4m3, bool pow2) {
  return CastOut{data.data_ptr<uint8_t>(),  scale_inv.data_ptr<float>(),
                 data_t.data_ptr<uint8_t>(), scale_inv_t.data_ptr<float>(),
                 scale_inv.stride(0),        scale_inv.stride(1),
                 scale_inv_t.stride(0),      scale_inv_t.stride(1),
                 static_cast<float>(fp8_max), e4m3,
                 pow2};
}

void act_cast_1x128(const at::Tensor& z, const std::optional<at::Tensor>& bias,
                    const std::optional<at::Tensor>& grad, const at::Tensor& data,
                    const at::Tensor& scale_inv, const at::Tensor& data_t,
                    const at::Tensor& scale_inv_t, const std::optional<at::Tensor>& part,
                    double fp8_max, bool e4m3, bool pow2, c10::string_view activation) {
  TORCH_CHECK_VALUE(activation == "gelu" || activation == "swiglu" || activation == "identity",
                    "te_cuda::act_cast_1x128: activation must be 'gelu', 'swiglu' or 'identity', "
                    "got '", activation, "'");
  const bool identity = activation == "identity";
  const bool glu = activation == "swiglu";
  TORCH_CHECK_VALUE(!identity || (!bias && !grad),
                    "te_cuda::act_cast_1x128: activation 'identity' takes no bias and no grad");
  // n: the activation's output columns; SwiGLU's z (and bias) hold 2n, its dz (the backward's
  // cast tensor, `on` columns) too.
  const int64_t m = z.size(0), zn = z.dim() == 2 ? z.size(1) : -1;
  const int64_t n = glu ? zn / 2 : zn;
  const int64_t on = glu && grad ? zn : n;
  TORCH_CHECK_VALUE(z.dim() == 2 && m % kTile == 0 && n % kTile == 0 && (!glu || zn % 2 == 0),
                    "te_cuda::act_cast_1x128: z must be [M, N] (swiglu: [M, 2N]) with M and N "
                    "multiples of 128, got ",
                    z.sizes());
  TORCH_CHECK_VALUE(m / kTile <= 65535, "te_cuda::act_cast_1x128: M / 128 must be <= 65535");
  check_2d("act_cast_1x128", z, "z", at::kBFloat16, m, zn);
  if (grad) check_2d("act_cast_1x128", *grad, "grad", at::kBFloat16, m, n);
  if (bias) {
    TORCH_CHECK_VALUE(bias->is_cuda() && bias->scalar_type() == at::kBFloat16 &&
                          bias->is_contiguous() && bias->dim() == 1 && bias->size(0) == zn,
                      "te_cuda::act_cast_1x128: bias must be a contiguous CUDA bfloat16 [", zn,
                      "] tensor");
  }
  for (const at::Tensor* t : {&z, grad ? &*grad : nullptr, bias ? &*bias : nullptr}) {
    TORCH_CHECK_VALUE(t == nullptr || reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0,
                      "te_cuda::act_cast_1x128: z, grad and bias must be 16-byte aligned");
  }
  check_2d("act_cast_1x128", data, "data", at::kByte, m, on);
  check_2d("act_cast_1x128", data_t, "data_t", at::kByte, on, m);
  check_scales("act_cast_1x128", scale_inv, "scale_inv", m, on / kTile);
  check_scales("act_cast_1x128", scale_inv_t, "scale_inv_t", on, m / kTile);
  if (part) {
    TORCH_CHECK_VALUE(grad.has_value() || identity,
                      "te_cuda::act_cast_1x128: part (dbias) needs grad or 'identity'");
    check_2d("act_cast_1x128", *part, "part", at::kFloat, m / kTile, on);
  }
  if (m == 0 || n == 0) return;
  const c10::cuda::CUDAGuard guard(z.device());
  const dim3 blocks(static_cast<unsigned>(on / kTile), static_cast<unsigned>(m / kTile));
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const auto* zp = reinterpret_cast<const __nv_bfloat16*>(z.data_ptr());
  const auto* bp = bias ? reinterpret_cast<const __nv_bfloat16*>(bias->data_ptr()) : nullptr;
  const auto* gp = grad ? reinterpret_cast<const __nv_bfloat16*>(grad->data_ptr()) : nullptr;
  const CastOut out = cast_out(data, scale_inv, data_t, scale_inv_t, fp8_max, e4m3, pow2);
  auto* pp = part ? part->data_ptr<float>() : nullptr;
  const bool hb = bias.has_value();
  const auto launch = [&](auto kernel) {
    kernel<<<blocks, kThreads, 0, stream>>>(zp, bp, gp, out, pp, m, n, hb);
  };
  if (identity) {
    part ? launch(act_cast_1x128_kernel<kIdentity, true>)
         : launch(act_cast_1x128_kernel<kIdentity, false>);
  } else if (!grad) {
    glu ? launch(act_cast_1x128_kernel<kSwigluFwd, false>)
        : launch(act_cast_1x128_kernel<kGeluFwd, false>);
  } else if (glu) {
    part ? launch(act_cast_1x128_kernel<kSwigluBwd, true>)
         : launch(act_cast_1x128_kernel<kSwigluBwd, false>);
  } else {
    part ? launch(act_cast_1x128_kernel<kGeluBwd, true>)
         : launch(act_cast_1x128_kernel<kGeluBwd, false>);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void cast_128x128(const at::Tensor& x, const at::Tensor& data, const at::Tensor& scale_inv,
                  const at::Tensor& data_t, const at::Tensor& scale_inv_t, double fp8_max,
                  bool e4m3, bool pow2) {
  const int64_t m = x.size(0), n = x.dim() == 2 ? x.size(1) : -1;
  TORCH_CHECK_VALUE(x.dim() == 2 && m % kTile == 0 && n % kTile == 0,
                    "te_cuda::cast_128x128: x must be [M, N] with M and N multiples of 128, got ",
                    x.sizes());
  TORCH_CHECK_VALUE(m / kTile <= 65535, "te_cuda::cast_128x128: M / 128 must be <= 65535");
  check_2d("cast_128x128", x, "x", at::kBFloat16, m, n);
  TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0,
                    "te_cuda::cast_128x128: x must be 16-byte aligned");
  check_2d("cast_128x128", data, "data", at::kByte, m, n);
  check_2d("cast_128x128", data_t, "data_t", at::kByte, n, m);
  check_scales("cast_128x128", scale_inv, "scale_inv", m / kTile, n / kTile);
  check_scales("cast_128x128", scale_inv_t, "scale_inv_t", n / kTile, m / kTile);
  if (m == 0 || n == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  const dim3 blocks(static_cast<unsigned>(n / kTile), static_cast<unsigned>(m / kTile));
  cast_128x128_kernel<<<blocks, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const __nv_bfloat16*>(x.data_ptr()),
      cast_out(data, scale_inv, data_t, scale_inv_t, fp8_max, e4m3, pow2), m, n);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY(te_cuda, m) {
  m.def(
      "act_cast_1x128(Tensor z, Tensor? bias, Tensor? grad, Tensor(a!) data, "
      "Tensor(b!) scale_inv, Tensor(c!) data_t, Tensor(d!) scale_inv_t, Tensor(e!)? part, "
      "float fp8_max, bool e4m3, bool pow2, str activation=\"gelu\") -> ()");
  m.def(
      "cast_128x128(Tensor x, Tensor(a!) data, Tensor(b!) scale_inv, Tensor(c!) data_t, "
      "Tensor(d!) scale_inv_t, float fp8_max, bool e4m3, bool pow2) -> ()");
}

TORCH_LIBRARY_IMPL(te_cuda, CUDA, m) {
  m.impl("act_cast_1x128", &act_cast_1x128);
  m.impl("cast_128x128", &cast_128x128);
}
