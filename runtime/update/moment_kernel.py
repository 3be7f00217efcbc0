"""An opt-in compiled CPU kernel for the AdamW update of compact moments (bf16 and int8): one parallel region over
all of an update's blocks, each block's moments decoded, updated and encoded while they sit in a thread's caches.

Owns: building the extension (its C++ source: ``moment_kernel_source``) with torch's cpp_extension (once per
machine: the build is cached under ``~/.cache/torch_extensions``; about a minute on 2 busy cores), once per process
(:func:`moment_kernel_for`, what ``optimizer.moment_kernel`` asks for: built, refused or fallen back from), and
calling it on a block's buffers (:meth:`Int8Kernel.update` for int8, :meth:`Int8Kernel.update_bf16` for bf16).
Leaves out: the formats (``moment_formats``: the same maps, the same layout, the same rounding tables) and where it
is used (``moments.adamw_update_block`` with a :class:`~runtime.update.moments.MomentScratch` that holds one: the
session hands it to the update thread's, and the CPU AdamW rate probe, ``runtime.update.rates``, times it).

Why: in torch ops, int8 makes about thirty passes over each piece and as many parallel regions, bf16 a dozen; here
each block is read once (master, gradient, stored moments) and written once, so the update moves the format's
bytes (bf16 20 a parameter, int8 16) and little else. int8 is not bit-identical to the torch-ops path (its AdamW
arithmetic and roots are its own): the same maps, codes within one of each other, the same per-block bounds. bf16
is: its arithmetic is a fixed sequence of single fp32 operations (``runtime.update.moments``), compiled without
fused multiply-adds, and each build checks it: ``adamw_bf16`` on :func:`contraction_probe`'s input must give the
torch ops' bits, else (a compiler that contracted anyway) one warning naming the compiler, and bf16 runs torch ops
while int8 keeps the kernel (:attr:`Int8Kernel.bf16_exact`). CPU tensors only; CUDA tensors take the torch-ops path.
Built with ``-march=native`` for the machine that builds it: a cache directory shared by machines of other CPUs
would need its own name per CPU.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import shutil
import time
from typing import Any

import torch

from runtime.config.loader import ConfigError
from runtime.config.schema import MOMENT_KERNELS
from runtime.update.adam import AdamWHyper, bf16_update_constants
from runtime.update.bf16_arith import bf16_ops_step
from runtime.update.moment_formats import (
    MIN_SCALE,
    MOMENT_KINDS,
    QUANT_BLOCK,
    int8_views,
    padded_numel,
    rounding_tables,
)
from runtime.update.moment_kernel_source import kernel_source

log = logging.getLogger(__name__)

# Elements of a bf16 chunk, the unit of work a thread takes: large enough that taking one costs nothing beside
# its data, small enough to share an update's parameters between the threads. A multiple of 64 (whole cache lines
# of both moments); the arithmetic is elementwise, so a chunk's size changes no bit (the tests try several).
BF16_CHUNK = 1 << 16


def contraction_probe() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, tuple[float, ...]]:
    """A small fixed input of bf16's update, (master, gradient, exp_avg, exp_avg_sq as bf16, constants), on which a
    fused multiply-add in place of any one of the sequence's multiply-then-add steps changes the result
    (test_moments_kernel_bf16 checks each): the kernel's build check runs it."""
    gen = torch.Generator().manual_seed(20261129)
    n = 256
    master = torch.randn(n, generator=gen) * 1e-3  # near the step's size: its last bits reach the master's
    grad = torch.randn(n, generator=gen) * 1e-2
    m = (torch.randn(n, generator=gen) * 1e-2).bfloat16()
    # v over five decades: where it is small, (g * g) * (1 - beta2) is not lost beside v * beta2
    v = (torch.rand(n, generator=gen) * 10 ** (torch.rand(n, generator=gen) * -5 - 4)).bfloat16()
    return master, grad, m, v, bf16_update_constants(AdamWHyper(lr=1e-2, weight_decay=0.01), 3.0)


def _hyper_rows(steps: list[torch.Tensor], hypers: list[AdamWHyper]) -> torch.Tensor:
    """float64 [kept, 6]: (lr, beta1, beta2, eps, weight_decay, step) of each kept parameter, as the kernels take."""
    return torch.tensor([(h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, float(step))
                         for h, step in zip(hypers, steps, strict=True)], dtype=torch.float64).reshape(-1, 6)


class Int8Kernel:
    """The compiled CPU update of int8 and bf16 moments (one extension: ``adamw_int8``, ``adamw_bf16``), built (or
    loaded from the cache) at construction; :meth:`build` returns None with one log line where it cannot build.
    (Named for its first format: the engine and the session hold it under that name.)"""

    #: Whether bf16 updates run it: its build's contraction check found the torch-ops path's bits (set when built).
    bf16_exact: bool = True

    def __init__(self) -> None:
        from torch.utils.cpp_extension import load_inline

        flags = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-fno-strict-aliasing"]
        if platform.machine().lower() in ("x86_64", "amd64"):
            # 512-bit vectors where the machine has them (GCC prefers 256 on Intel's server cores): the int8 update
            # 1.05x faster at 16 threads on the H200 machine's Xeon, 1.14x on one (2026-11-29). An x86 option only.
            flags.append("-mprefer-vector-width=512")
        self._module: Any = load_inline(name="tierstore_moments", cpp_sources=[kernel_source(QUANT_BLOCK, MIN_SCALE)],
                                        functions=["adamw_int8", "adamw_bf16", "build_info"], extra_cflags=flags,
                                        extra_ldflags=["-fopenmp"], verbose=False)
        # bf16 runs the kernel only where it gives the torch-ops path's bits: a compiler that fused multiply-adds
        # despite the source's fp-contract=off would give others (int8's bits are its own: it keeps the kernel)
        self.bf16_exact = self._bf16_check()
        if not self.bf16_exact:
            log.warning("%s: the compiled bf16 AdamW kernel differs from the torch-ops path on its contraction check "
                        "(built by %s: it fused multiply-adds?); bf16 moments use torch ops, int8 moments keep the "
                        "kernel", KERNEL_KEY, self.compiler())

    def compiler(self) -> str:
        """The C++ compiler torch's cpp_extension built with: ``$CXX`` (or ``c++``) and the version it reported."""
        version = str(self._module.build_info()).rpartition("; compiler ")[2]
        return f"{os.environ.get('CXX', 'c++')} ({version})"

    def describe(self) -> str:
        """What the build chose where the machine decides (the int8 encode's instructions), the compiler, and whether
        bf16 runs it (:attr:`bf16_exact`), for a table's header."""
        bf16 = "bf16 bit-identical to torch ops" if self.bf16_exact else "bf16 in torch ops (contraction check failed)"
        return f"{self._module.build_info()} ({os.environ.get('CXX', 'c++')}); {bf16}"

    def _bf16_check(self) -> bool:
        """``adamw_bf16`` on :func:`contraction_probe`'s input equals :func:`bf16_ops_step`'s torch ops (then narrowed to
        nearest, as the kernel narrows it here) bit for bit: master, both moments."""
        master, grad, m, v, constants = contraction_probe()
        ours = (master.clone(), m.clone(), v.clone())
        self._module.adamw_bf16(master, grad, m, v, *ours, torch.tensor([[0, master.numel(), 0]], dtype=torch.int64),
                                torch.tensor([constants], dtype=torch.float32), torch.full((1, 4), -1, dtype=torch.int64),
                                *self._tables, BF16_CHUNK)
        p, m32, v32 = master.clone(), m.float(), v.float()
        bf16_ops_step(p, grad, m32, v32, constants, torch.empty_like(p), torch.empty_like(p))
        return all(torch.equal(a.view(torch.int16 if a.dtype == torch.bfloat16 else torch.int32),
                               b.view(torch.int16 if b.dtype == torch.bfloat16 else torch.int32))
                   for a, b in zip(ours, (p, m32.bfloat16(), v32.bfloat16()), strict=True))

    @classmethod
    def build(cls) -> Int8Kernel | None:
        """The kernel, or None (and why, in the log) where it cannot be built here."""
        try:
            return cls()
        except Exception as error:  # any build failure: the torch-ops path serves instead
            log.warning("the compiled AdamW moment kernel could not be built (%s); compact moments use torch ops",
                        error)
            return None

    def update(self, master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
               sizes: list[int], keep: list[bool], steps: list[torch.Tensor], hypers: list[AdamWHyper],
               out: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        """One AdamW step of the kept parameters' int8 moments into ``out`` (which may be the inputs themselves);
        the steps were incremented by the caller. Skipped parameters are not touched (the caller copies them when
        out of place)."""
        blocks = []
        flat = code = kept = 0
        for size, k in zip(sizes, keep, strict=True):
            if k:
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
                                out_v_codes, out_v_scales, torch.cat(blocks).contiguous(), _hyper_rows(steps, hypers))

    @functools.cached_property
    def _tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The stochastic rounding's two tables as int16 (their values are 16 bits; the kernel reads them as
        uint16): half the bytes of the int32 tables, which a chunk reads once over."""
        first, second = rounding_tables(torch.device("cpu"))
        return first.to(torch.int16), second.to(torch.int16)

    def update_bf16(self, master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                    sizes: list[int], keep: list[bool], steps: list[torch.Tensor], hypers: list[AdamWHyper],
                    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                    offsets: dict[str, torch.Tensor], chunk: int = BF16_CHUNK) -> None:
        """One AdamW step of the kept parameters' bf16 moments into ``out`` (which may be the inputs themselves),
        bit for bit what ``moments.adamw_update_block`` does in torch ops: the arithmetic of ``runtime.update.moments``
        (with :func:`~runtime.update.adam.bf16_update_constants` of each parameter's step) on the widened values,
        each kind narrowed stochastically with its table offsets in ``offsets`` (``moment_formats.rounding_offsets``
        of the kept parameters' steps, int64 ``[kept, 2]``) or, a kind not in ``offsets``, to nearest even. The
        steps were incremented by the caller; skipped parameters are not touched."""
        rows = []
        flat = kept = 0
        for size, k in zip(sizes, keep, strict=True):
            if k:
                if size:
                    rows.append((flat, size, kept))
                kept += 1
            flat += size
        if not rows:
            return
        # each constant rounded from its double to fp32 once, here, as torch rounds a Python scalar
        constants = torch.tensor([bf16_update_constants(h, t) for h, t in
                                  zip(hypers, torch.stack(steps).tolist(), strict=True)], dtype=torch.float32)
        nearest = torch.full((kept, 2), -1, dtype=torch.int64)
        table_offsets = torch.cat([offsets.get(kind, nearest).to(torch.int64).reshape(kept, 2)
                                   for kind in MOMENT_KINDS], dim=1).contiguous()
        table1, table2 = self._tables
        self._module.adamw_bf16(master, grad, exp_avg, exp_avg_sq, out[0], out[1], out[2],
                                torch.tensor(rows, dtype=torch.int64), constants, table_offsets, table1, table2, chunk)


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


#: The moment formats with a compiled kernel (fp32 moments run torch's fused AdamW directly: nothing to fuse).
COMPILED_MOMENT_DTYPES = ("bf16", "int8")


@functools.cache
def _built_once() -> tuple[Int8Kernel | None, str]:
    """The kernel built (or loaded from torch's extension cache) once per process, and why not where it fails.
    Cached: the session and the rate probe ask for it, and a failed build should not be retried, or warned about,
    a second time."""
    missing = missing_build_tools()
    if missing:
        return None, "missing " + " and ".join(missing)
    log.info("building (or loading from its cache) the compiled AdamW moment kernel (%s): a first build takes tens "
             "of seconds to a minute, then it loads from torch's extension cache (~/.cache/torch_extensions)",
             KERNEL_KEY)
    started = time.perf_counter()
    try:
        kernel = Int8Kernel()
    except Exception as error:  # any build failure: the caller decides whether that refuses the run
        return None, f"the build failed: {error}"
    log.info("compiled AdamW moment kernel ready in %.1f s", time.perf_counter() - started)
    return kernel, ""


def moment_kernel_for(choice: str, moment_dtype: str, *, cpu_updates: bool = True) -> Int8Kernel | None:
    """The kernel the run's CPU updates use under ``optimizer.moment_kernel`` = ``choice``: None for ``torch``, for
    fp32 moments (no compiled kernel: :data:`COMPILED_MOMENT_DTYPES`) and where no update runs on the CPU
    (``cpu_updates`` False: the device's updates keep torch ops); else the kernel built once per process. ``auto``:
    None, with one warning, where it cannot build. ``compiled``: a :class:`ConfigError` naming the key and what is
    missing."""
    if choice not in MOMENT_KERNELS:
        raise ConfigError(f"{choice!r} is not one of {', '.join(MOMENT_KERNELS)}", KERNEL_KEY)
    if choice == "torch" or moment_dtype not in COMPILED_MOMENT_DTYPES or not cpu_updates:
        return None
    kernel, why = _built_once()
    if kernel is not None and moment_dtype == "bf16" and not kernel.bf16_exact:
        return None  # its build check failed and warned: bf16 runs torch ops
    if kernel is not None:
        return kernel
    if choice == "compiled":
        raise ConfigError(f"compiled: the {moment_dtype} AdamW kernel cannot be built here ({why}); install what is "
                          "missing, or write auto (torch ops where it cannot build) or torch", KERNEL_KEY,
                          kind="environment")
    _warn_fallback(why, moment_dtype)
    return None


# The name the session calls it by (it came first, for int8 alone).
int8_kernel_for = moment_kernel_for


@functools.cache  # once per process and reason, as the build: the rate probe and the session both ask
def _warn_fallback(why: str, moment_dtype: str) -> None:
    speed = {"int8": "about a quarter", "bf16": "about a fifth, on one thread,"}.get(moment_dtype, "a fraction")
    log.warning("%s: auto: the compiled AdamW moment kernel cannot be built here (%s); %s moments use torch ops "
                "(%s of fp32's CPU update speed)", KERNEL_KEY, why, moment_dtype, speed)
