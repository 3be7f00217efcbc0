"""The C++ source of the compiled moment kernels (``runtime.update.moment_kernel`` builds it with torch's
cpp_extension): one AdamW update of a block's int8 or bf16 moments, one parallel region over the whole update.

Owns: the source text and the two values the Python side substitutes into it (:func:`kernel_source`). Leaves out:
building, choosing and calling it (``moment_kernel``), the formats it reads and writes (``moment_formats``: the same
maps, the same layout, the same stochastic-rounding tables).

- ``adamw_int8``: decode, AdamW and encode of one QUANT_BLOCK at a time in registers and a thread's L1. Its
  arithmetic is its own (not bit-identical to torch ops: codes within one of theirs; on the kernel test's block,
  the same codes). Why it is written as it is: per element it is compute bound (16 bytes a parameter from memory,
  and a few dozen vector operations), so it spends one square root and one division an element, AdamW's own (the
  first version spent four and two: square roots are 6-12 cycles a vector on server cores where a multiply is
  one): the encode's roots (``sqrt(|m| / s)``, and ``(v / s)^(1/4)`` as ``sqrt(sqrt(v) / sqrt(s))`` from AdamW's
  ``sqrt(v)``, kept for it) are ``x * rsqrt(x)`` from vrsqrt14ps and one Newton step where the build machine has
  AVX-512, else from the bits and three Newton steps (:c:func:`root`), both to a few ulps; the codes leave through
  a rounding conversion and a narrowing store (AVX-512) or int32 (elsewhere), not the dozen permutes a vector the
  compiler writes for a float-to-byte conversion; the bias corrections, ``1 - beta`` (in double, rounded once, as
  torch: ``1 - 0.999f`` is 1.3e-5 off) and the block's reciprocals are computed once per parameter or block, never
  per element; the largest magnitudes are taken in the update's pass (integer maxima of the bits: they vectorize
  where a float one would need -ffast-math); float, never double, per element; no branch in an element loop.
- ``adamw_bf16``: widen a chunk of the moments into a thread's fp32 scratch, run torch's own fused AdamW
  (``at::_fused_adamw_``) on the chunk, narrow back (to nearest even, or stochastically with the tables' bits:
  [Note: bf16 stochastic rounding] in ``moment_formats``). torch's kernel, not a copy of its arithmetic, so the
  result is the torch-ops path's bit for bit on every CPU torch runs on (its vector width and its compiler's
  fused multiply-adds included): a copy of the arithmetic would have to match the contractions of each of torch's
  builds (AVX2, AVX-512) and could not be tested on the machines that matter. A chunk splits a parameter only at
  multiples of its size from the parameter's start (a multiple of 64): torch's kernel takes the same elements
  through its vector loop and its scalar tail as over the whole tensor. Its cost beside fp32's: the fused
  kernel's arithmetic (on one core that is what fp32's update spends: there bf16 cannot be faster) plus the
  widening and narrowing in cache; where many cores share memory, fp32 waits on its 28 bytes a parameter and bf16
  moves 20.
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
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

constexpr int64_t kBlock = QUANT_BLOCK_VALUE;
constexpr float kMinScale = MIN_SCALE_VALUE;

// sqrt(x) of a finite x >= 0 in multiplies and fused multiply-adds: a first 1/sqrt from the bits (within 3.4%), three
// Newton steps (1.7e-3, 4.6e-6, then a few ulps), times x. The encode takes two roots an element, and vsqrtps costs
// 6-12 cycles a vector on server cores where a multiply costs one. 0 gives 0 (0 times a finite first guess); a
// denormal x gets a root that is too small but still far below what rounds to code 1 (the encode's only use).
static inline float root(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  bits = 0x5f375a86u - (bits >> 1);
  float r;
  std::memcpy(&r, &bits, 4);
  const float half = 0.5f * x;
  r = r * (1.5f - half * r * r);
  r = r * (1.5f - half * r * r);
  r = r * (1.5f - half * r * r);
  return x * r;
}

#if defined(__AVX512F__)
// root() for 16 values: vrsqrt14ps (14 bits) and one Newton step instead of the bit trick's three; 0 gives 0.
static inline __m512 root16(__m512 x) {
  const __m512 r = _mm512_rsqrt14_ps(x);
  const __m512 half_x = _mm512_mul_ps(x, _mm512_set1_ps(0.5f));
  const __m512 step = _mm512_fnmadd_ps(_mm512_mul_ps(half_x, r), r, _mm512_set1_ps(1.5f));
  const __mmask16 positive = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GT_OQ);
  return _mm512_maskz_mul_ps(positive, x, _mm512_mul_ps(r, step));
}

// The encode of a whole block (values past the parameter's end are zero: their codes are the padding's zeros):
// the same codes as the scalar loops below, a conversion to int32 rounding to nearest even and a narrowing store
// (saturating to 255 for v) in place of the compiler's dozen permutes a vector.
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

// What the build chose, for the bench's table: the int8 encode's instructions.
std::string build_info() {
#if defined(__AVX512F__)
  return "int8 encode: AVX-512 (vrsqrt14ps)";
#else
  return "int8 encode: portable loops (no AVX-512 on the build machine)";
#endif
}

// What a kept parameter's step needs, in float, computed once per call in double and rounded once, as torch's CPU
// kernel does (1 - beta2 taken in float would be 1.3e-5 off for 0.999: 1 - 0.999f is not 0.001f).
struct Step {
  float one_minus_beta1, beta2, one_minus_beta2, eps, decay, step_size, inv_bc2_sqrt;
};

static std::vector<Step> step_constants(const torch::Tensor& hypers) {
  // hypers: float64 [h, 6] = (lr, beta1, beta2, eps, weight_decay, step) (step already incremented)
  const double* hy = hypers.data_ptr<double>();
  std::vector<Step> out(hypers.size(0));
  for (int64_t k = 0; k < hypers.size(0); ++k) {
    const double* h = hy + 6 * k;
    const double bc1 = 1.0 - std::pow(h[1], h[5]);
    const double bc2_sqrt = std::sqrt(1.0 - std::pow(h[2], h[5]));
    out[k] = Step{(float)(1.0 - h[1]), (float)h[2], (float)(1.0 - h[2]), (float)h[3], (float)(1.0 - h[0] * h[4]),
                  (float)(h[0] / bc1), (float)(1.0 / bc2_sqrt)};
  }
  return out;
}

// blocks: int64 [n, 4] = (flat offset of the block's first value, code offset (a block multiple), valid values,
// the parameter's row of hypers).
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
  const std::vector<Step> constants = step_constants(hypers);
  const Step* steps = constants.data();
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
    alignas(64) float r[kBlock];  // sqrt(v): AdamW's denominator's, and the encode's
    for (int64_t b = begin; b < end; ++b) {
      const int64_t flat = desc[4 * b], code = desc[4 * b + 1], n = desc[4 * b + 2];
      const Step s = steps[desc[4 * b + 3]];
      const int64_t sb = code / kBlock;
      const float m_factor = ms_in[sb] * (1.0f / (127.0f * 127.0f));
      const float v_factor = vs_in[sb] * (1.0f / (255.0f * 255.0f * 255.0f * 255.0f));
      // The largest magnitudes as integers: a non-negative float's bits order as it does (NaN above infinity, so
      // it propagates), and an integer max reduction vectorizes where a float one would need -ffast-math.
      uint32_t m_top = 0, v_top = 0;
      #pragma omp simd reduction(max: m_top, v_top)
      for (int64_t i = 0; i < n; ++i) {  // decode, AdamW, the block's largest: one pass, no branch
        const float c = (float)mci[code + i];
        const float d = (float)vci[code + i];
        const float d2 = d * d;
        float mi = c * std::fabs(c) * m_factor;
        float vi = d2 * d2 * v_factor;
        const float g = gi[flat + i];
        mi = mi + s.one_minus_beta1 * (g - mi);
        vi = s.beta2 * vi + s.one_minus_beta2 * g * g;
        const float vr = std::sqrt(vi);  // exact, as torch's: the step's denominator
        const float denom = vr * s.inv_bc2_sqrt + s.eps;
        po[flat + i] = pi[flat + i] * s.decay - s.step_size * mi / denom;
        m[i] = mi;
        r[i] = vr;
        uint32_t mb, vb;
        std::memcpy(&mb, &mi, 4);
        std::memcpy(&vb, &vi, 4);
        m_top = std::max(m_top, mb & 0x7fffffffu);
        v_top = std::max(v_top, vb & 0x7fffffffu);
      }
      float m_max, v_max;
      std::memcpy(&m_max, &m_top, 4);
      std::memcpy(&v_max, &v_top, 4);
      const float ms = std::max(m_max, kMinScale), vs = std::max(v_max, kMinScale);
      const float m_inv = 1.0f / ms, r_inv = 1.0f / std::sqrt(vs);
#if defined(__AVX512F__)
      for (int64_t i = n; i < kBlock; ++i) {  // the padding of a parameter's last block: zero codes
        m[i] = 0.0f;
        r[i] = 0.0f;
      }
      encode_block(m, r, m_inv, r_inv, mco + code, vco + code);
#else
      // encode: c = 127 sign(m) sqrt(|m| / s), d = 255 (sqrt(v) / sqrt(s))^(1/2), both to nearest even as int32,
      // then narrowed (the float-to-byte conversions GCC writes otherwise take a dozen permutes a vector).
      #pragma omp simd
      for (int64_t i = 0; i < n; ++i) {
        const int32_t c = (int32_t)std::rint(127.0f * root(std::fabs(m[i]) * m_inv));
        mco[code + i] = (int8_t)(m[i] < 0.0f ? -c : c);
      }
      #pragma omp simd
      for (int64_t i = 0; i < n; ++i) {
        const int32_t d = (int32_t)std::rint(255.0f * root(r[i] * r_inv));
        // at most 255 (rounding may lift the largest a hair above 1); a positive v never gets code 0
        vco[code + i] = (uint8_t)std::max(std::min(d, 255), (int32_t)(r[i] > 0.0f));
      }
      for (int64_t i = n; i < kBlock; ++i) {  // the padding of a parameter's last block stays zero
        mco[code + i] = 0;
        vco[code + i] = 0;
      }
#endif
      ms_out[sb] = ms;
      vs_out[sb] = vs;
    }
  });
}

// Both moments' bfloat16 -> float: exact, the bits moved up, the two streams read together (restrict arguments: the
// loop vectorizes), and the same stretch of the next chunk asked for (``ahead`` values further on; 0: none): its
// moments reach the cache while torch's kernel runs on this chunk, where each chunk's reads would otherwise start
// cold (two short streams a chunk: the hardware's prefetch ramps up again on each).
static inline void widen(const uint16_t* __restrict m16, const uint16_t* __restrict v16, float* __restrict m,
                         float* __restrict v, int64_t n, int64_t ahead) {
  uint32_t* __restrict m_bits = reinterpret_cast<uint32_t*>(m);
  uint32_t* __restrict v_bits = reinterpret_cast<uint32_t*>(v);
  for (int64_t start = 0; start < n; start += 32) {  // a cache line of bf16 values at a time
    if (ahead) {
      __builtin_prefetch(m16 + start + ahead);
      __builtin_prefetch(v16 + start + ahead);
    }
    const int64_t end = std::min(n, start + 32);
    #pragma omp simd
    for (int64_t i = start; i < end; ++i) {
      m_bits[i] = (uint32_t)m16[i] << 16;
      v_bits[i] = (uint32_t)v16[i] << 16;
    }
  }
}

// torch's float -> bfloat16 conversion: to nearest even; NaN as torch's scalar conversion writes it.
static inline void narrow_nearest(const float* __restrict values, uint16_t* __restrict out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, &values[i], 4);
    const uint16_t rounded = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    out[i] = std::isnan(values[i]) ? (uint16_t)0x7fc0 : rounded;
  }
}

// [Note: bf16 stochastic rounding]: element i of the block adds T1[(i + o1) % P1] ^ T2[(i + o2) % P2] below the
// bf16 bits and truncates. The tables are stored twice over, so a run of up to min(P1, P2) consecutive entries from
// any offset below P is one contiguous slice: the loop takes such runs, as moment_formats.rounding_bits does.
static inline void narrow_stochastic(const float* __restrict values, uint16_t* __restrict out, int64_t n,
                                     int64_t start, int64_t o1, int64_t o2,
                                     const uint16_t* __restrict t1, int64_t p1,
                                     const uint16_t* __restrict t2, int64_t p2) {
  int64_t first = (start + o1) % p1, second = (start + o2) % p2;
  const int64_t most = std::min(p1, p2);
  for (int64_t done = 0; done < n;) {
    const int64_t length = std::min(most, n - done);
    const uint16_t* __restrict a = t1 + first;
    const uint16_t* __restrict b = t2 + second;
    const float* __restrict x = values + done;
    uint16_t* __restrict y = out + done;
    #pragma omp simd
    for (int64_t i = 0; i < length; ++i) {
      uint32_t u;
      std::memcpy(&u, &x[i], 4);
      y[i] = (uint16_t)((u + (uint32_t)(uint16_t)(a[i] ^ b[i])) >> 16);
    }
    done += length;
    first = (first + length) % p1;
    second = (second + length) % p2;
  }
}

// params: int64 [n, 3] = (flat offset, values, kept row) of each kept parameter; hypers: float64 [h, 6] as
// adamw_int8's (its step column unused: torch's kernel reads the step tensor); steps: the kept parameters' step
// tensors (incremented already); offsets: int64 [h, 4] = the stochastic rounding's table offsets (o1, o2) of
// exp_avg, then of exp_avg_sq, -1: to nearest even.
void adamw_bf16(torch::Tensor master, torch::Tensor grad, torch::Tensor m_in, torch::Tensor v_in,
                torch::Tensor out_master, torch::Tensor out_m, torch::Tensor out_v,
                torch::Tensor params, torch::Tensor hypers, std::vector<torch::Tensor> steps,
                torch::Tensor offsets, torch::Tensor table1, torch::Tensor table2, int64_t chunk) {
  TORCH_CHECK(chunk > 0 && chunk % 64 == 0, "chunk must be a positive multiple of 64");
  float* p_in = master.data_ptr<float>();
  float* g_in = grad.data_ptr<float>();
  const uint16_t* m_src = reinterpret_cast<const uint16_t*>(m_in.data_ptr<at::BFloat16>());
  const uint16_t* v_src = reinterpret_cast<const uint16_t*>(v_in.data_ptr<at::BFloat16>());
  float* p_out = out_master.data_ptr<float>();
  uint16_t* m_dst = reinterpret_cast<uint16_t*>(out_m.data_ptr<at::BFloat16>());
  uint16_t* v_dst = reinterpret_cast<uint16_t*>(out_v.data_ptr<at::BFloat16>());
  const int64_t* desc = params.data_ptr<int64_t>();
  const double* hy = hypers.data_ptr<double>();
  const int64_t* off = offsets.data_ptr<int64_t>();
  // The tables' 16-bit values as uint16 (int16 tensors): half the bytes of moment_formats' int32 tables to read.
  const uint16_t* t1 = reinterpret_cast<const uint16_t*>(table1.data_ptr<int16_t>());
  const uint16_t* t2 = reinterpret_cast<const uint16_t*>(table2.data_ptr<int16_t>());
  const int64_t p1 = table1.numel() / 2, p2 = table2.numel() / 2;
  const bool in_place = p_in == p_out;
  // The chunks: (parameter row, first value), each at most chunk values, at multiples of chunk from the start.
  std::vector<std::pair<int64_t, int64_t>> chunks;
  for (int64_t r = 0; r < params.size(0); ++r) {
    for (int64_t start = 0; start < desc[3 * r + 1]; start += chunk) {
      chunks.emplace_back(r, start);
    }
  }
  const auto options = master.options();
  pybind11::gil_scoped_release no_gil;
  at::parallel_for(0, (int64_t)chunks.size(), 1, [&](int64_t begin, int64_t end) {
    // torch's kernel below runs on this thread (a parallel_for inside a parallel region runs inline), without
    // autograd's bookkeeping: these are plain buffers.
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    // the thread's scratch, kept from call to call (a fresh 512 KiB would be mapped and faulted in every update)
    static thread_local std::vector<float> scratch;
    if ((int64_t)scratch.size() < 2 * chunk) {
      scratch.resize(2 * chunk);
    }
    float* m = scratch.data();
    float* v = m + chunk;
    for (int64_t c = begin; c < end; ++c) {
      const int64_t r = chunks[c].first, start = chunks[c].second;
      const int64_t flat = desc[3 * r] + start, n = std::min(chunk, desc[3 * r + 1] - start), k = desc[3 * r + 2];
      const double* h = hy + 6 * k;
      // the next chunk of this thread's range, where it continues this one's values (nothing to ask for else)
      const bool next_follows = c + 1 < end && desc[3 * chunks[c + 1].first] + chunks[c + 1].second == flat + n;
      widen(m_src + flat, v_src + flat, m, v, n, next_follows ? n : 0);
      if (!in_place) {
        std::memcpy(p_out + flat, p_in + flat, n * sizeof(float));
      }
      at::Tensor p_t = at::from_blob(p_out + flat, {n}, options);
      at::Tensor g_t = at::from_blob(g_in + flat, {n}, options);
      at::Tensor m_t = at::from_blob(m, {n}, options);
      at::Tensor v_t = at::from_blob(v, {n}, options);
      at::_fused_adamw_({p_t}, {g_t}, {m_t}, {v_t}, {}, {steps[k]}, h[0], h[1], h[2], h[4], h[3], false, false);
      const int64_t* o = off + 4 * k;
      const float* values[2] = {m, v};
      uint16_t* targets[2] = {m_dst + flat, v_dst + flat};
      for (int kind = 0; kind < 2; ++kind) {
        if (o[2 * kind] < 0) {
          narrow_nearest(values[kind], targets[kind], n);
        } else {
          narrow_stochastic(values[kind], targets[kind], n, flat, o[2 * kind], o[2 * kind + 1], t1, p1, t2, p2);
        }
      }
    }
  });
}
"""


def kernel_source(quant_block: int, min_scale: float) -> str:
    """The C++ source with the int8 format's block size and smallest scale written in."""
    return _SOURCE.replace("QUANT_BLOCK_VALUE", str(quant_block)).replace("MIN_SCALE_VALUE", f"{min_scale!r}f")
