"""The config's values a plan is made with, resolved for this machine: the compute device and dtype, the CPU
optimizer's threads, where micro-batch gradients are summed and in what dtype, whether updates wait for the commit,
and the home tier of each kind of state.

Owns: reading those keys (``auto`` included) into the values the plan and the engine use. Leaves out: the placement
knobs that need the machine's rates (``runtime.planning.placement``) and anything allocated.
"""

from __future__ import annotations

import os

import torch

from runtime.config.loader import TierstoreConfig
from runtime.config.schema import clip_threshold
from runtime.core.blocks import Block
from runtime.planning.memory_plan import WeightSource, gpu_budget_nbytes
from tierstore import TierName

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def resolve_device(config: TierstoreConfig) -> torch.device:
    """The compute device the config asks for (auto: CUDA when available)."""
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: cuda, but CUDA is not available here; use device: auto or cpu")
    if config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def compute_itemsize(cfg: TierstoreConfig) -> int:
    """Bytes an element of the compute weights (``dtype``)."""
    return torch.empty((), dtype=DTYPES[cfg.dtype]).element_size()


def resolve_homes(config: TierstoreConfig) -> tuple[dict[str, TierName], WeightSource]:
    """Home tier of each kind of state, and where compute weights are fetched from."""
    placement = config.placement
    nvme = config.tiers.nvme.path is not None

    def pick(value: str, kind: str) -> TierName:
        if value == "auto":
            return TierName.HOST
        if value == "gpu":
            raise ValueError(f"placement.{kind}: gpu is not supported for optimizer state yet; use host or nvme")
        if value == "nvme" and not nvme:
            raise ValueError(f"placement.{kind}: nvme needs tiers.nvme.path")
        return TierName(value)

    homes = {"master": pick(placement.master, "master"), "exp_avg": pick(placement.moments, "moments"),
             "exp_avg_sq": pick(placement.moments, "moments"), "grad": TierName.HOST}
    weights = placement.weights
    if weights == "gpu":
        source = WeightSource.RESIDENT
    elif weights == "nvme":
        raise ValueError("placement.weights: nvme is not supported yet; use host (bf16 weights in pinned memory) or gpu")
    elif homes["master"] is TierName.HOST:
        source = WeightSource.MASTER  # fetch the fp32 master itself and cast on the GPU: no extra host copy
    else:
        source = WeightSource.WEIGHTS
    homes["weights"] = TierName.HOST
    return homes, source


def sums_on_host(blocks: list[Block], cfg: TierstoreConfig, device: torch.device) -> bool:
    """``optimizer.accumulate_on`` resolved: True when the micro-batches' gradients are summed in host memory
    (``auto``: when the model's gradients in the compute dtype would take more than a quarter of the GPU budget)."""
    opt = cfg.optimizer
    if opt.accumulation_steps == 1 or opt.accumulate_on == "gpu":
        return False
    if opt.accumulate_on == "host":
        return True
    return sum(b.numel for b in blocks) * compute_itemsize(cfg) * 4 > gpu_budget_nbytes(cfg, device)


def host_grad_dtype(cfg: TierstoreConfig, host_sums: bool) -> torch.dtype:
    """``optimizer.host_grad_dtype`` resolved: the dtype of the host gradient buffers the CPU updates from (``auto``:
    the compute dtype under bf16 where micro-batches sum in host memory, ``host_sums``; else fp32)."""
    choice = cfg.optimizer.host_grad_dtype
    if choice == "fp32" or cfg.dtype != "bf16" or (choice == "auto" and not host_sums):
        return torch.float32
    return DTYPES[cfg.dtype]


def waits_for_commit(cfg: TierstoreConfig) -> bool:
    """True when updates need the whole gradient before they can commit: clipping (tierstore's or the loop's)
    or fp16 overflow checks."""
    return clip_threshold(cfg.optimizer) is not None or cfg.dtype == "fp16" or cfg.optimizer.user_grad_clip


def cpu_threads(cfg: TierstoreConfig) -> int:
    """``optimizer.cpu_threads`` as a number (``auto``: ``default_cpu_threads()``)."""
    threads = cfg.optimizer.cpu_threads
    return default_cpu_threads() if threads == "auto" else int(threads)


def default_cpu_threads() -> int:
    """Threads for the CPU optimizer: every core but two when a GPU is fed (the Python thread launching
    forward kernels and the autograd thread launching backward ones). One more OpenMP thread than there
    are free cores stalls every parallel region on the descheduled one."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    return max(1, cores - (2 if torch.cuda.is_available() else 0))
