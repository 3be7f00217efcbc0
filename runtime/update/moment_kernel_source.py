"""The C++ source of the compiled moment kernels (``runtime.update.moment_kernel`` builds it with torch's
cpp_extension): one AdamW update of a block's int8 or bf16 moments, one parallel region over the whole update.

Owns: the source text and the two values the Python side substitutes into it (:func:`kernel_source`). Leaves out:
building, choosing and calling it (``moment_kernel``), the formats it reads and writes (``moment_formats``: the same
maps, the same layout, the same stochastic-rounding tables).

- ``adamw_int8``: decode, AdamW and encode of one QUANT_BLOCK at a time in registers and a thread's L1. Its
  arithmetic is its own (not bit-identical to torch ops: codes within one of theirs). Per element it is compute
  bound, and on server cores the square-root-and-divide unit is what it waits for, so where the build machine has
  AVX-512 it spends one root and one division an element, AdamW's own (the first version spent four and two:
  0.88-0.98x the fp32 update on the H200 machine): AdamW's ``sqrt(v)`` is kept for the encode of v
  (``(v / s)^(1/4)`` as ``sqrt(sqrt(v) / sqrt(s))``), the bias correction is a multiply, and the encode's two roots are
  ``x * rsqrt(x)`` from vrsqrt14ps and one Newton step, the codes leaving through rounding conversions and narrowing
  stores (elsewhere the encode's two roots are sqrt in loops the compiler vectorizes: three an element). A block
  whose largest value is not finite stores a NaN scale, so it decodes to NaN (``moment_formats``). Loops compiled
  ``-O3 -march=native`` with 512-bit vectors on x86 (``moment_kernel``). On the H200 machine's Xeon (Sapphire
  Rapids, 16 cores, 2026-11-29, ``runtime.bench.adam_bench --threads 16``): 1.17x the fp32 update's parameters a
  second (4.31 G against 3.69 G). Variants timed in one earlier run of that call (fp32 3.78 G): the first version
  0.98x; one root and one division with exact roots 1.15x (256-bit vectors) and 1.20x (512); with the encode's rsqrt
  1.21x and 1.26x. A rewrite that folded the block's maxima into the update loop (an omp simd reduction) ran at
  0.39x there: GCC kept the maxima on the stack, a store-to-load chain a vector, which AMD's cores hide and the Xeon
  does not.
- ``adamw_bf16``: bf16 moments' own AdamW arithmetic (``runtime.update.moments`` defines it: a fixed sequence of
  single fp32 operations, one division and one root an element, the constants computed in Python and passed as a
  float32 table), one run of 1024 values at a time in registers: widen both moments, update, narrow (to nearest
  even, or stochastically with the tables' bits: [Note: bf16 stochastic rounding] in ``moment_formats``), the
  master updated in place. Compiled without contraction (``#pragma GCC optimize("fp-contract=off")`` around this
  code only: GCC's default for C++ fuses ``a * b + c`` into one rounding; int8's loops keep the build's defaults and
  their bits), vectorized as the rest, so its bits are the torch-ops path's and the tests' plain-ops reference's
  on any CPU. History: it first called torch's own ``at::_fused_adamw_`` on widened chunks, to share torch's bits
  (a copy of torch's arithmetic would have had to match each torch build's contractions); that ran at 0.68x the
  fp32 update at 16 threads on the H200 machine's Xeon (2026-11-29), and on one EPYC core torch's kernel on the
  cached chunk alone took 0.51 of its 0.85 ns a parameter (fp32's whole update 0.56), so no trimming could reach
  fp32's speed. With its own arithmetic, on one busy core of the 2-core box (``adam_bench --threads 1 --numel
  16000000``, 2026-11-29): 0.97-1.03x fp32's parameters a second over several runs (0.99x in the bench's table;
  before: 0.57x); its loop takes 32 values an iteration with two vsqrtps and two vdivps, and a build without them
  ran no faster there, nor runs of 256 or 8192 values (a software prefetch of the next run: 0.69x); where many
  cores share memory bandwidth it moves 20 bytes a parameter to fp32's 28. A first version that narrowed from an
  fp32 scratch in a second pass ran at about 0.8x there.
"""

from __future__ import annotations

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

constexpr int64_t kBlock = QUANT_BLOCK_VALUE;
static_assert(kBlock % 16 == 0, "the AVX-512 encode takes a block 16 values at a time");
constexpr float kMinScale = MIN_SCALE_VALUE;

#if defined(__AVX512F__)
#include <immintrin.h>

// sqrt(x) of 16 values x >= 0 as x * rsqrt(x): vrsqrt14ps (14 bits) and one Newton step, to a few ulps, with no
// vsqrtps (6-12 cycles a vector on server cores, in the unit that also serves AdamW's own root and division); 0
// gives 0 (masked: 0 * rsqrt(0) would be NaN).
static inline __m512 root16(__m512 x) {
  const __m512 r = _mm512_rsqrt14_ps(x);
  const __m512 half_x = _mm512_mul_ps(x, _mm512_set1_ps(0.5f));
  const __m512 step = _mm512_fnmadd_ps(_mm512_mul_ps(half_x, r), r, _mm512_set1_ps(1.5f));
  const __mmask16 positive = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GT_OQ);
  return _mm512_maskz_mul_ps(positive, x, _mm512_mul_ps(r, step));
}

// The encode of a whole block (values past the parameter's end are zero: their codes are the padding's zeros):
// the codes of the loops below (one apart where a value lies within a few ulps of a rounding boundary), through a
// conversion to int32 rounding to nearest even and a narrowing store (saturating to 255 for v) in place of the
// compiler's dozen permutes a vector.
static inline void encode_block(const float* __restrict m, const float* __restrict r, float m_inv, float r_inv,
                                int8_t* __restrict mco, uint8_t* __restrict vco) {
  const __m512 zero = _mm512_setzero_ps(), m_scale = _mm512_set1_ps(m_inv), r_scale = _mm512_set1_ps(r_inv);
  const __m512 levels_m = _mm512_set1_ps(127.0f), levels_v = _mm512_set1_ps(255.0f);
  const __m512i one = _mm512_set1_epi32(1), none = _mm512_setzero_si512();
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  for (int64_t i = 0; i < kBlock; i += 16) {
    const __m512 mv = _mm512_load_ps(m + i);
    const __m512 y = _mm512_mul_ps(root16(_mm512_mul_ps(_mm512_abs_ps(mv), m_scale)), levels_m);
    __m512i c = _mm512_cvt_roundps_epi32(y, kNearest);
    c = _mm512_mask_sub_epi32(c, _mm512_cmp_ps_mask(mv, zero, _CMP_LT_OQ), none, c);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(mco + i), _mm512_cvtepi32_epi8(c));
    const __m512 rv = _mm512_load_ps(r + i);
    const __m512 z = _mm512_mul_ps(root16(_mm512_mul_ps(rv, r_scale)), levels_v);
    __m512i d = _mm512_cvt_roundps_epi32(z, kNearest);
    d = _mm512_mask_max_epi32(d, _mm512_cmp_ps_mask(rv, zero, _CMP_GT_OQ), d, one);  // a positive v: code 1 at least
    _mm_storeu_si128(reinterpret_cast<__m128i*>(vco + i), _mm512_cvtusepi32_epi8(d));
  }
}
#endif

std::string build_info() {
#if defined(__AVX512F__)
  const std::string chosen = "int8 encode: AVX-512 (vrsqrt14ps), update loops -O3 -march=native, 512-bit vectors";
#else
  const std::string chosen = "int8 encode: sqrt loops -O3 -march=native (no AVX-512 on the build machine)";
#endif
  return chosen + "; compiler " + __VERSION__;  // GCC and clang both define __VERSION__
}

// blocks: int64 [n, 4] = (flat offset of the block's first value, code offset (a block multiple), valid values, hyper row)
// hypers: float64 [h, 6] = (lr, beta1, beta2, eps, weight_decay, step) of each kept parameter (step already incremented)
void adamw_int8(torch::Tensor master, torch::Tensor grad,
                torch::Tensor m_codes, torch::Tensor m_scales, torch::Tensor v_codes, torch::Tensor v_scales,
                torch::Tensor out_master, torch::Tensor out_m_codes, torch::Tensor out_m_scales,
                torch::Tensor out_v_codes, torch::Tensor out_v_scales,
                torch::Tensor blocks, torch::Tensor hypers) {
  const float* p_in = master.data_ptr<float>();
  const float* g_in = grad.data_ptr<float>();
  const int8_t* mc_in = reinterpret_cast<const int8_t*>(m_codes.data_ptr<uint8_t>());
  const float* ms_in = m_scales.data_ptr<float>();
  const uint8_t* vc_in = v_codes.data_ptr<uint8_t>();
  const float* vs_in = v_scales.data_ptr<float>();
  float* p_out = out_master.data_ptr<float>();
  int8_t* mc_out = reinterpret_cast<int8_t*>(out_m_codes.data_ptr<uint8_t>());
  float* ms_out = out_m_scales.data_ptr<float>();
  uint8_t* vc_out = out_v_codes.data_ptr<uint8_t>();
  float* vs_out = out_v_scales.data_ptr<float>();
  const int64_t* desc = blocks.data_ptr<int64_t>();
  const double* hy = hypers.data_ptr<double>();
  // The update runs on the worker thread while the training thread runs Python: without the GIL.
  pybind11::gil_scoped_release no_gil;
  at::parallel_for(0, blocks.size(0), 1, [=](int64_t begin, int64_t end) {
    // Local restrict pointers: read through the closure, every store could alias them and no loop vectorizes.
    const float* __restrict pi = p_in;
    const float* __restrict gi = g_in;
    const int8_t* __restrict mci = mc_in;
    const uint8_t* __restrict vci = vc_in;
    float* __restrict po = p_out;
    int8_t* __restrict mco = mc_out;
    uint8_t* __restrict vco = vc_out;
    alignas(64) float m[kBlock];
    alignas(64) float v[kBlock];
    alignas(64) float r[kBlock];
    for (int64_t b = begin; b < end; ++b) {
      const int64_t flat = desc[4 * b], code = desc[4 * b + 1], n = desc[4 * b + 2];
      const double* h = hy + 6 * desc[4 * b + 3];
      const int64_t sb = code / kBlock;
      const float lr = h[0], beta1 = h[1], beta2 = h[2], eps = h[3], wd = h[4];
      const double step = h[5];
      const float bc1 = 1.0 - std::pow((double)beta1, step);
      const float inv_bc2_sqrt = 1.0 / std::sqrt(1.0 - std::pow((double)beta2, step));
      const float step_size = lr / bc1;
      const float decay = 1.0f - lr * wd;
      const float m_factor = ms_in[sb] / (127.0f * 127.0f);
      const float v_factor = vs_in[sb] / (255.0f * 255.0f * 255.0f * 255.0f);
      for (int64_t i = 0; i < n; ++i) {  // decode, AdamW: no reduction here, so the loop vectorizes
        const float c = (float)mci[code + i];
        const float d = (float)vci[code + i];
        const float d2 = d * d;
        float mi = c * std::fabs(c) * m_factor;
        float vi = d2 * d2 * v_factor;
        const float g = gi[flat + i];
        mi = mi + (1.0f - beta1) * (g - mi);
        vi = beta2 * vi + (1.0f - beta2) * g * g;
        const float ri = std::sqrt(vi);  // AdamW's root, kept for the encode of v
        const float denom = ri * inv_bc2_sqrt + eps;
        po[flat + i] = pi[flat + i] * decay - step_size * mi / denom;
        m[i] = mi;
        v[i] = vi;
        r[i] = ri;
      }
      // The largest magnitudes as integers: a non-negative float's bits order as it does (NaN above infinity, so
      // it propagates), and an integer max reduction vectorizes where a float one would need -ffast-math. A loop
      // of its own: folded into the update's, as an omp simd reduction, GCC kept the maxima on the stack, a
      // store-to-load chain a vector that cost 2.3x on the Xeon (AMD's cores hide it).
      const uint32_t* m_bits = reinterpret_cast<const uint32_t*>(m);
      const uint32_t* v_bits = reinterpret_cast<const uint32_t*>(v);
      uint32_t m_top = 0, v_top = 0;
      for (int64_t i = 0; i < n; ++i) {
        m_top = std::max(m_top, m_bits[i] & 0x7fffffffu);
        v_top = std::max(v_top, v_bits[i] & 0x7fffffffu);
      }
      float m_max, v_max;
      std::memcpy(&m_max, &m_top, 4);
      std::memcpy(&v_max, &v_top, 4);
      const float ms = std::max(m_max, kMinScale), vs = std::max(v_max, kMinScale);
      // codes: c = 127 sign(m) sqrt(|m| / ms), d = 255 (v / vs)^(1/4) = 255 sqrt(sqrt(v) / sqrt(vs))
      const float m_inv = 1.0f / ms, r_inv = 1.0f / std::sqrt(vs);
#if defined(__AVX512F__)
      for (int64_t i = n; i < kBlock; ++i) {
        m[i] = 0.0f;
        r[i] = 0.0f;
      }
      encode_block(m, r, m_inv, r_inv, mco + code, vco + code);
#else
      for (int64_t i = 0; i < n; ++i) {
        const float y = std::rint(127.0f * std::sqrt(std::fabs(m[i]) * m_inv));
        mco[code + i] = (int8_t)std::copysign(y, m[i]);
        float z = std::rint(255.0f * std::sqrt(r[i] * r_inv));
        z = z > 255.0f ? 255.0f : z;
        z = (r[i] > 0.0f && z < 1.0f) ? 1.0f : z;  // a positive v never gets code 0
        vco[code + i] = (uint8_t)z;
      }
      for (int64_t i = n; i < kBlock; ++i) {  // the padding of a parameter's last block stays zero
        mco[code + i] = 0;
        vco[code + i] = 0;
      }
#endif
      // a block holding an infinity (or NaN) decodes to NaN, as moment_formats says (the codes above assumed a
      // finite scale: with inf, v's "at least 1" would decode every positive value to inf and freeze the block)
      ms_out[sb] = ms < INFINITY ? ms : NAN;
      vs_out[sb] = vs < INFINITY ? vs : NAN;
    }
  });
}


// bf16 moments' AdamW arithmetic, compiled without contraction: each operation below is one IEEE fp32 operation,
// rounded on its own, as torch's single ops are (GCC contracts a * b + c into a fused multiply-add by default in
// C++, which rounds once: other bits). Only this code: int8's kernel above keeps the build's defaults (its bits
// stay as they were). GCC takes the pragma; clang the one inside the function.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

// Values a run: a run's slices of the rounding tables are contiguous (a run is shorter than either table's period,
// and the tables are stored twice over), and its master, gradient and moments (12 bytes a value) stay in L1.
constexpr int64_t kRun = 1024;

// torch's float -> bfloat16 conversion: to nearest even; NaN as torch's scalar conversion writes it.
static inline uint16_t bf16_nearest(float value) {
  uint32_t u;
  std::memcpy(&u, &value, 4);
  const uint16_t rounded = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  return std::isnan(value) ? (uint16_t)0x7fc0 : rounded;
}

// [Note: bf16 stochastic rounding]: element i of the block adds T1[(i + o1) % P1] ^ T2[(i + o2) % P2] below the
// bf16 bits and truncates (the caller passes the run's two table slices).
static inline uint16_t bf16_stochastic(float value, uint16_t bits) {
  uint32_t u;
  std::memcpy(&u, &value, 4);
  return (uint16_t)((u + (uint32_t)bits) >> 16);
}

static inline float widened(uint16_t bits) {  // exact: the bits moved up
  const uint32_t u = (uint32_t)bits << 16;
  float value;
  std::memcpy(&value, &u, 4);
  return value;
}

// One run of n <= kRun values of a parameter, in place, each value once through registers: widen both moments,
// AdamW in the order of runtime.update.moments (one division and one root an element), narrow (M_STOCHASTIC,
// V_STOCHASTIC: with the tables' bits ma ^ mb, va ^ vb, the run's slices; else to nearest even). k: the parameter's
// constants (adam.BF16_CONSTANTS, rounded to float once).
template <bool M_STOCHASTIC, bool V_STOCHASTIC>
static void update_run(float* __restrict p, const float* __restrict g, uint16_t* __restrict m16,
                       uint16_t* __restrict v16, int64_t n, const float* __restrict k,
                       const uint16_t* __restrict ma, const uint16_t* __restrict mb,
                       const uint16_t* __restrict va, const uint16_t* __restrict vb) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
  const float decay = k[0], b1 = k[1], c1 = k[2], b2 = k[3], c2 = k[4], step_size = k[5], inv_bc2 = k[6], eps = k[7];
  for (int64_t i = 0; i < n; ++i) {
    float mi = widened(m16[i]), vi = widened(v16[i]);
    const float gi = g[i];
    const float pi = p[i] * decay;
    mi = (mi * b1) + (gi * c1);
    vi = (vi * b2) + ((gi * gi) * c2);
    const float d = (std::sqrt(vi) * inv_bc2) + eps;
    p[i] = pi - ((mi / d) * step_size);
    m16[i] = M_STOCHASTIC ? bf16_stochastic(mi, (uint16_t)(ma[i] ^ mb[i])) : bf16_nearest(mi);
    v16[i] = V_STOCHASTIC ? bf16_stochastic(vi, (uint16_t)(va[i] ^ vb[i])) : bf16_nearest(vi);
  }
}

#pragma GCC pop_options

using RunFn = void (*)(float*, const float*, uint16_t*, uint16_t*, int64_t, const float*, const uint16_t*,
                       const uint16_t*, const uint16_t*, const uint16_t*);

// params: int64 [n, 3] = (flat offset, values, kept row) of each kept parameter; constants: float32 [h, 8] = each
// kept parameter's adam.BF16_CONSTANTS (its step's, the step incremented already); offsets: int64 [h, 4] = the
// stochastic rounding's table offsets (o1, o2) of exp_avg, then of exp_avg_sq, -1: to nearest even.
void adamw_bf16(torch::Tensor master, torch::Tensor grad, torch::Tensor m_in, torch::Tensor v_in,
                torch::Tensor out_master, torch::Tensor out_m, torch::Tensor out_v,
                torch::Tensor params, torch::Tensor constants,
                torch::Tensor offsets, torch::Tensor table1, torch::Tensor table2, int64_t chunk) {
  TORCH_CHECK(chunk > 0 && chunk % 64 == 0, "chunk must be a positive multiple of 64");
  TORCH_CHECK(std::min(table1.numel(), table2.numel()) / 2 >= kRun, "a run must fit a table's period");
  TORCH_CHECK(constants.scalar_type() == at::kFloat && constants.dim() == 2 && constants.size(1) == 8,
              "constants must be float32 [kept, 8]");
  TORCH_CHECK(params.scalar_type() == at::kLong && params.dim() == 2 && params.size(1) == 3,
              "params must be int64 [n, 3]");
  TORCH_CHECK(offsets.scalar_type() == at::kLong && offsets.dim() == 2 && offsets.size(1) == 4 &&
              offsets.size(0) == constants.size(0), "offsets must be int64 [kept, 4], a row for each row of constants");
  for (const torch::Tensor* t : {&master, &grad, &m_in, &v_in, &out_master, &out_m, &out_v, &params, &constants,
                                 &offsets, &table1, &table2}) {
    TORCH_CHECK(t->is_contiguous(), "adamw_bf16 takes contiguous tensors only");
  }
  TORCH_CHECK(master.numel() == grad.numel() && master.numel() == out_master.numel() && m_in.numel() == master.numel()
              && v_in.numel() == master.numel() && out_m.numel() == master.numel() && out_v.numel() == master.numel(),
              "master, gradient and moments must have as many values");
  const float* p_in = master.data_ptr<float>();
  const float* g_in = grad.data_ptr<float>();
  const uint16_t* m_src = reinterpret_cast<const uint16_t*>(m_in.data_ptr<at::BFloat16>());
  const uint16_t* v_src = reinterpret_cast<const uint16_t*>(v_in.data_ptr<at::BFloat16>());
  float* p_out = out_master.data_ptr<float>();
  uint16_t* m_dst = reinterpret_cast<uint16_t*>(out_m.data_ptr<at::BFloat16>());
  uint16_t* v_dst = reinterpret_cast<uint16_t*>(out_v.data_ptr<at::BFloat16>());
  const int64_t* desc = params.data_ptr<int64_t>();
  const float* consts = constants.data_ptr<float>();
  const int64_t* off = offsets.data_ptr<int64_t>();
  // The tables' 16-bit values as uint16 (int16 tensors): half the bytes of moment_formats' int32 tables to read.
  const uint16_t* t1 = reinterpret_cast<const uint16_t*>(table1.data_ptr<int16_t>());
  const uint16_t* t2 = reinterpret_cast<const uint16_t*>(table2.data_ptr<int16_t>());
  const int64_t p1 = table1.numel() / 2, p2 = table2.numel() / 2;
  const bool in_place = p_in == p_out;
  // The chunks: (parameter row, first value), each at most chunk values, at multiples of chunk from the start.
  std::vector<std::pair<int64_t, int64_t>> chunks;
  for (int64_t r = 0; r < params.size(0); ++r) {
    TORCH_CHECK(desc[3 * r + 2] >= 0 && desc[3 * r + 2] < constants.size(0), "a parameter's kept row has no constants");
    TORCH_CHECK(desc[3 * r] >= 0 && desc[3 * r + 1] >= 0 && desc[3 * r] + desc[3 * r + 1] <= master.numel(),
                "a parameter's range lies outside master");
    for (int64_t start = 0; start < desc[3 * r + 1]; start += chunk) {
      chunks.emplace_back(r, start);
    }
  }
  // the four variants: exp_avg, exp_avg_sq each narrowed stochastically or to nearest
  const RunFn runs[2][2] = {{update_run<false, false>, update_run<false, true>},
                            {update_run<true, false>, update_run<true, true>}};
  pybind11::gil_scoped_release no_gil;
  at::parallel_for(0, (int64_t)chunks.size(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const int64_t r = chunks[c].first, start = chunks[c].second;
      const int64_t first = desc[3 * r] + start, n = std::min(chunk, desc[3 * r + 1] - start), k = desc[3 * r + 2];
      const float* kc = consts + 8 * k;
      const int64_t* o = off + 4 * k;
      const RunFn run = runs[o[0] >= 0][o[2] >= 0];
      for (int64_t done = 0; done < n; done += kRun) {
        const int64_t flat = first + done, length = std::min(kRun, n - done);
        if (!in_place) {  // out of place: the run copied, then updated there (in L1 now)
          std::memcpy(p_out + flat, p_in + flat, length * sizeof(float));
          std::memcpy(m_dst + flat, m_src + flat, length * sizeof(uint16_t));
          std::memcpy(v_dst + flat, v_src + flat, length * sizeof(uint16_t));
        }
        // the run's table slices, element flat's entries first (unused where a kind rounds to nearest)
        const uint16_t* ma = o[0] >= 0 ? t1 + (flat + o[0]) % p1 : nullptr;
        const uint16_t* mb = o[0] >= 0 ? t2 + (flat + o[1]) % p2 : nullptr;
        const uint16_t* va = o[2] >= 0 ? t1 + (flat + o[2]) % p1 : nullptr;
        const uint16_t* vb = o[2] >= 0 ? t2 + (flat + o[3]) % p2 : nullptr;
        run(p_out + flat, g_in + flat, m_dst + flat, v_dst + flat, length, kc, ma, mb, va, vb);
      }
    }
  });
}
"""


def kernel_source(quant_block: int, min_scale: float) -> str:
    """The C++ source with the int8 format's block size and smallest scale written in."""
    return _SOURCE.replace("QUANT_BLOCK_VALUE", str(quant_block)).replace("MIN_SCALE_VALUE", f"{min_scale!r}f")
