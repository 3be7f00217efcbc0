"""What the engine needs from the config, resolved: one frozen record the session builds and the engine's parts read.

What it leaves out: the config's schema and defaults (``runtime.config``) and how 'auto' values are resolved
(``runtime.planning``, ``runtime.session``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.core.ranks import Ranks
from runtime.planning.memory_plan import WeightSource
from runtime.update.adam import AdamWHyper
from runtime.update.moment_kernel import Int8Kernel
from tierstore import TierName


@dataclass(frozen=True)
class RuntimeOptions:
    """What the controller needs from the config, resolved (no 'auto' left)."""

    compute_dtype: torch.dtype
    weight_source: WeightSource
    homes: dict[str, TierName]  # kind -> home tier: master, exp_avg, exp_avg_sq, grad, weights
    hyper: AdamWHyper
    grad_clip: float | None
    accumulation_steps: int
    prefetch_depth: int
    prefetch_budget_nbytes: int
    loss_scale: dict[str, float] | None  # initial, growth_factor, backoff_factor, growth_interval (fp16)
    cpu_threads: int
    record_intervals: bool = False
    gpu_update_fraction: float = 0.0  # share of parameters (first blocks) whose AdamW runs on the device
    host_sums: bool = False  # micro-batch gradients of host-updated blocks summed in host memory (runtime.engine.host_sums)
    host_grad_dtype: torch.dtype = torch.float32  # of the host gradient buffers (optimizer.host_grad_dtype)
    gpu_stream_fraction: float = 0.0  # share (next blocks) updated on the device over state streamed from host
    gpu_stream_ahead: int = 8  # streamed blocks whose state may be brought in ahead of the block in backward
    spilled_blocks: frozenset[int] = frozenset()  # blocks whose moments live on NVMe though homes says host
    keep_for_backward_nbytes: int = 0  # weights a training forward may leave on the device for its backward
    hold_updates: bool = False  # updates wait for optimizer.step() (the user's loop clips: optimizer.user_grad_clip)
    speculate: bool = True  # the plan counts second state buffers: updates that wait for the commit may run early
    moment_dtype: str = "fp32"  # how Adam's moments are stored (optimizer.moment_dtype: runtime.update.moments)
    # The compiled kernel the CPU's int8 updates run (optimizer.moment_kernel, built at offload()); None: torch ops.
    int8_kernel: Int8Kernel | None = None
    # A run of several processes (runtime.core.ranks): this process's rank, and each block's owner ([Note: block
    # ownership] in runtime.planning.ownership). None / empty: one process, which owns every block.
    ranks: Ranks | None = None
    owners: tuple[int, ...] = ()

    def remote(self) -> frozenset[int]:
        """The blocks another rank owns: this process keeps none of their state."""
        if self.ranks is None:
            return frozenset()
        return frozenset(i for i, owner in enumerate(self.owners) if owner != self.ranks.rank)
