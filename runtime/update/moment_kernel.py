"""An opt-in compiled CPU kernel for the int8 AdamW update: decode, AdamW and encode of one QUANT_BLOCK in registers
and a thread's L1, one parallel region over all blocks of an update.

Owns: the kernel's C++ source, building it with torch's cpp_extension (once per machine: the build is cached under
``~/.cache/torch_extensions``; about a minute on 2 busy cores), once per process (:func:`int8_kernel_for`, what
``optimizer.moment_kernel`` asks for: built, refused or fallen back from), and calling it on a block's buffers.
Leaves out: the formats (``moment_formats``: the same maps, the same layout) and where it is used
(``moments.adamw_update_block`` with a :class:`~runtime.update.moments.MomentScratch` that holds one: the session
hands it to the update thread's, and the CPU AdamW rate probe, ``runtime.update.rates``, times it).

Why: in torch ops, int8 makes about thirty passes over each piece and as many parallel regions; here each block is
read once (codes, scales, master, gradient) and written once, so the update moves int8's 16 bytes a parameter and
little else. Not bit-identical to the torch-ops path (the compiler may fuse multiplies and adds, and the AdamW
arithmetic is written out here, not torch's fused kernel): the same maps, codes within one of each other, the same
per-block bounds. CPU tensors only; CUDA tensors take the torch-ops path. Built with ``-march=native`` for the machine
that builds it: a cache directory shared by machines of other CPUs would need its own name per CPU.

Measured (2026-11-29, 33 Mi parameters, ``python -m runtime.bench.adam_bench --numel 33554432``): on one EPYC core
1.30 G parameters/s, 0.61x fp32's fused update (that core streams 60 GB/s: fp32 is not memory-bound there) and 3.6x
int8 in torch ops. On both cores (64 Mi parameters, 03:10, the machine's other load low), where fp32 is memory-bound
(2.31 G parameters/s, 65 GB/s; one thread gave 2.14): int8 kernel 1.07x fp32, bf16 0.88x, int8 in torch ops 0.28x.
With other work on the cores (33 Mi parameters, 03:05): the kernel 2.3x fp32 (one parallel region an update instead
of one a tensor op: fewer waits on a descheduled thread).
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import time
from typing import Any

import torch

from runtime.config.loader import ConfigError
from runtime.update.adam import AdamWHyper
from runtime.update.moment_formats import MIN_SCALE, QUANT_BLOCK, int8_views, padded_numel

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

constexpr int64_t kBlock = QUANT_BLOCK_VALUE;
constexpr float kMinScale = MIN_SCALE_VALUE;

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
    for (int64_t b = begin; b < end; ++b) {
      const int64_t flat = desc[4 * b], code = desc[4 * b + 1], n = desc[4 * b + 2];
      const double* h = hy + 6 * desc[4 * b + 3];
      const int64_t sb = code / kBlock;
      const float lr = h[0], beta1 = h[1], beta2 = h[2], eps = h[3], wd = h[4];
      const double step = h[5];
      const float bc1 = 1.0 - std::pow((double)beta1, step);
      const float bc2_sqrt = std::sqrt(1.0 - std::pow((double)beta2, step));
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
        const float denom = std::sqrt(vi) / bc2_sqrt + eps;
        po[flat + i] = pi[flat + i] * decay - step_size * mi / denom;
        m[i] = mi;
        v[i] = vi;
      }
      // The largest magnitudes as integers: a non-negative float's bits order as it does (NaN above infinity, so
      // it propagates), and an integer max reduction vectorizes where a float one would need -ffast-math.
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
      const float m_inv = 1.0f / ms, v_inv = 1.0f / vs;
      for (int64_t i = 0; i < n; ++i) {
        const float y = std::rint(127.0f * std::sqrt(std::fabs(m[i]) * m_inv));
        mco[code + i] = (int8_t)std::copysign(y, m[i]);
        float z = std::rint(255.0f * std::sqrt(std::sqrt(v[i] * v_inv)));
        z = z > 255.0f ? 255.0f : z;
        z = (v[i] > 0.0f && z < 1.0f) ? 1.0f : z;  // a positive v never gets code 0
        vco[code + i] = (uint8_t)z;
      }
      for (int64_t i = n; i < kBlock; ++i) {  // the padding of a parameter's last block stays zero
        mco[code + i] = 0;
        vco[code + i] = 0;
      }
      ms_out[sb] = ms;
      vs_out[sb] = vs;
    }
  });
}
"""


class Int8Kernel:
    """The compiled int8 update, built (or loaded from the cache) at construction; :meth:`build` returns None with
    one log line where no compiler is available."""

    def __init__(self) -> None:
        from torch.utils.cpp_extension import load_inline

        source = _SOURCE.replace("QUANT_BLOCK_VALUE", str(QUANT_BLOCK)).replace("MIN_SCALE_VALUE", f"{MIN_SCALE!r}f")
        flags = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-fno-strict-aliasing"]
        self._module: Any = load_inline(name="tierstore_moments_int8", cpp_sources=[source], functions=["adamw_int8"],
                                        extra_cflags=flags, extra_ldflags=["-fopenmp"], verbose=False)

    @classmethod
    def build(cls) -> Int8Kernel | None:
        """The kernel, or None (and why, in the log) where it cannot be built here."""
        try:
            return cls()
        except Exception as error:  # any build failure: the torch-ops path serves instead
            log.warning("the compiled int8 AdamW kernel could not be built (%s); int8 moments use torch ops", error)
            return None

    def update(self, master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
               sizes: list[int], keep: list[bool], steps: list[torch.Tensor], hypers: list[AdamWHyper],
               out: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        """One AdamW step of the kept parameters into ``out`` (which may be the inputs themselves); the steps were
        incremented by the caller. Skipped parameters are not touched (the caller copies them when out of place)."""
        blocks, rows = [], []
        flat = code = kept = 0
        for size, k in zip(sizes, keep, strict=True):
            if k:
                hyper = hypers[kept]
                rows.append((hyper.lr, hyper.beta1, hyper.beta2, hyper.eps, hyper.weight_decay, float(steps[kept])))
                starts = torch.arange(0, size, QUANT_BLOCK, dtype=torch.int64)
                blocks.append(torch.stack([flat + starts, code + starts, (size - starts).clamp_max(QUANT_BLOCK),
                                           torch.full_like(starts, kept)], dim=1))
                kept += 1
            flat += size
            code += padded_numel(size)
        if not blocks:
            return
        (m_codes, m_scales), (v_codes, v_scales) = int8_views(exp_avg, sizes), int8_views(exp_avg_sq, sizes)
        (out_m_codes, out_m_scales), (out_v_codes, out_v_scales) = int8_views(out[1], sizes), int8_views(out[2], sizes)
        self._module.adamw_int8(master, grad, m_codes, m_scales, v_codes, v_scales, out[0], out_m_codes, out_m_scales,
                                out_v_codes, out_v_scales, torch.cat(blocks).contiguous(),
                                torch.tensor(rows, dtype=torch.float64))


#: ``optimizer.moment_kernel``: ``auto`` runs the compiled kernel where it builds, ``torch`` never, ``compiled`` always
#: (a run refuses to start where it cannot build).
MOMENT_KERNELS = ("auto", "torch", "compiled")
KERNEL_KEY = "optimizer.moment_kernel"


def missing_build_tools() -> list[str]:
    """What torch's cpp_extension needs to build the kernel and this machine lacks: a C++ compiler (``$CXX`` or
    ``c++``) and ninja. Empty where both are found (the build may still fail: the error says why)."""
    from torch.utils.cpp_extension import is_ninja_available

    missing = []
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        missing.append(f"a C++ compiler ({compiler!r} is not on PATH; set CXX or install g++)")
    if not is_ninja_available():
        missing.append("ninja (pip install ninja)")
    return missing


@functools.cache
def _built_once() -> tuple[Int8Kernel | None, str]:
    """The kernel built (or loaded from torch's extension cache) once per process, and why not where it fails.
    Cached: the session and the rate probe ask for it, and a failed build should not be retried, or warned about,
    a second time."""
    missing = missing_build_tools()
    if missing:
        return None, "missing " + " and ".join(missing)
    log.info("building (or loading from its cache) the compiled int8 AdamW kernel (%s): a first build takes tens of seconds to a minute, "
             "then it loads from torch's extension cache (~/.cache/torch_extensions)", KERNEL_KEY)
    started = time.perf_counter()
    try:
        kernel = Int8Kernel()
    except Exception as error:  # any build failure: the caller decides whether that refuses the run
        return None, f"the build failed: {error}"
    log.info("compiled int8 AdamW kernel ready in %.1f s", time.perf_counter() - started)
    return kernel, ""


def int8_kernel_for(choice: str, moment_dtype: str, *, cpu_updates: bool = True) -> Int8Kernel | None:
    """The kernel the run's CPU updates use under ``optimizer.moment_kernel`` = ``choice``: None for ``torch``, for
    moments other than int8 (only int8 has a compiled kernel) and where no update runs on the CPU (``cpu_updates``
    False: the device's updates keep torch ops); else the kernel built once per process. ``auto``: None, with one
    warning, where it cannot build. ``compiled``: a :class:`ConfigError` naming the key and what is missing."""
    if choice not in MOMENT_KERNELS:
        raise ConfigError(f"{choice!r} is not one of {', '.join(MOMENT_KERNELS)}", KERNEL_KEY)
    if choice == "torch" or moment_dtype != "int8" or not cpu_updates:
        return None
    kernel, why = _built_once()
    if kernel is not None:
        return kernel
    if choice == "compiled":
        raise ConfigError(f"compiled: the int8 AdamW kernel cannot be built here ({why}); install what is missing, "
                          "or write auto (torch ops where it cannot build) or torch", KERNEL_KEY, kind="environment")
    _warn_fallback(why)
    return None


@functools.cache  # once per process and reason, as the build: the rate probe and the session both ask
def _warn_fallback(why: str) -> None:
    log.warning("%s: auto: the compiled int8 AdamW kernel cannot be built here (%s); int8 moments use torch ops "
                "(about a quarter of fp32's CPU update speed)", KERNEL_KEY, why)
