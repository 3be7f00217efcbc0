"""A plain PyTorch training loop that the offloaded runtime must match, step by step.

fp32: the model itself with ``torch.optim.AdamW(fused=True)`` and ``clip_grad_norm_``.
bf16 / fp16: the model in the compute dtype with fp32 master copies (mixed precision done by hand, the way
every offload runtime does it): grads are cast to fp32, unscaled (fp16, GradScaler's own kernels), clipped,
and AdamW updates the masters, which are cast back into the model.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class ReferenceTrainer:
    """Trains a copy of a model with plain PyTorch."""

    model: nn.Module
    dtype: torch.dtype = torch.float32
    lr: float = 1e-3
    weight_decay: float = 0.01
    grad_clip: float | None = None
    accumulation_steps: int = 1
    loss_scale: float | None = None  # fp16 initial scale
    growth_interval: int = 2000
    device: str = "cpu"
    skipped: int = 0
    losses: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.model = copy.deepcopy(self.model).to(self.device)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        if self.dtype == torch.float32:
            self.masters = self.params
        else:
            self.masters = [nn.Parameter(p.detach().clone().float()) for p in self.params]
            self.model.to(self.dtype)
        self.optimizer = torch.optim.AdamW(self.masters, lr=self.lr, weight_decay=self.weight_decay, fused=True)
        if self.loss_scale is not None:
            self.scale = torch.full((), self.loss_scale, dtype=torch.float32, device=self.device)
            self.tracker = torch.zeros((), dtype=torch.int32, device=self.device)

    def train_step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
        """One optimizer step over ``accumulation_steps`` micro-batches; returns their losses."""
        losses = []
        for x, y in batches:
            loss = self.model(x.to(self.device), y.to(self.device))
            losses.append(loss.item())
            (loss * self.scale if self.loss_scale is not None else loss).backward()
        self.losses += losses
        if self.dtype != torch.float32:
            for p, m in zip(self.params, self.masters, strict=True):
                m.grad = None if p.grad is None else p.grad.float()
                p.grad = None
        grads = [m.grad for m in self.masters if m.grad is not None]
        found_inf = torch.zeros((), dtype=torch.float32, device=self.device)
        if self.loss_scale is not None:
            inv = self.scale.double().reciprocal().float()
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv)
        if self.grad_clip is not None and not found_inf.item():
            torch.nn.utils.clip_grad_norm_(self.masters, self.grad_clip)
        if found_inf.item():
            self.skipped += 1
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.loss_scale is not None:
            torch._amp_update_scale_(self.scale, self.tracker, found_inf, 2.0, 0.5, self.growth_interval)
        if self.dtype != torch.float32:
            with torch.no_grad():
                for p, m in zip(self.params, self.masters, strict=True):
                    p.copy_(m)
        return losses

    def master_state(self) -> dict[str, torch.Tensor]:
        """fp32 weights by parameter name."""
        names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        return {n: m.detach().float().cpu() for n, m in zip(names, self.masters, strict=True)}
