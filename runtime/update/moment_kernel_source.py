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
  moves 20. Measured: 0.68x fp32 at 16 threads on the H200 machine's Xeon (2026-11-29); on one EPYC core, of its
  0.85 ns a parameter torch's kernel on the cached chunk took 0.51 (fp32's whole update 0.56), the narrowing 0.16,
  the widening 0.06. So no trimming of the widening and narrowing brings bf16 to fp32's speed: that needs
  arithmetic of its own (one division, as int8's), hence a reference of its own for the bit-for-bit tests.
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
  return "int8 encode: AVX-512 (vrsqrt14ps), update loops -O3 -march=native, 512-bit vectors";
#else
  return "int8 encode: sqrt loops -O3 -march=native (no AVX-512 on the build machine)";
#endif
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
