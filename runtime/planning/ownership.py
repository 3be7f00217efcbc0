"""Which rank owns each block's training state in a run of several processes (``runtime.core.ranks``).

[Note: block ownership] Each block's fp32 master, moments and host gradient live on exactly one rank, its owner,
in that rank's host memory (and swap files), updated by that rank's CPU threads: one copy of the training state on
the node, whatever the number of ranks. The owner fetches the block's compute weights over its own PCIe link and
broadcasts them to the other GPUs before each use; the other ranks' gradients of the block are reduced onto the
owner's GPU, which alone sends them to host memory. So each GPU moves 1/N of the weights and gradients over PCIe,
each rank's cores run 1/N of the updates, and the GPUs exchange whole blocks over NVLink (the bytes an
all-gather of shards moves). Whole blocks rather than a 1/N slice of every block keep the update, the state's
layout, its checkpoints (a checkpoint written at N ranks is per block, so it loads at any other number) and
materialization from the meta device exactly as in one process; the price is balance, which the assignment
below bounds by the largest block.

The assignment: largest blocks first, each to the rank with the fewest parameters so far (the lowest rank on a
tie), so consecutive blocks of equal size go to consecutive ranks (the owners of the blocks a forward meets next
differ, and their PCIe links work at once). Pure arithmetic, the same on every rank.
"""

from __future__ import annotations

import dataclasses

import torch

from runtime.config.loader import TierstoreConfig
from runtime.core.blocks import Block
from runtime.planning.hostmem import host_memory
from runtime.planning.settings import sums_on_host


def assign_owners(numels: list[int], world_size: int) -> list[int]:
    """The owning rank of each block (by position in ``numels``, the blocks' sizes in forward order)."""
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, not {world_size}")
    loads = [0] * world_size
    owners = [0] * len(numels)
    for index in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owners[index] = rank
        loads[rank] += numels[index]
    return owners


def imbalance(numels: list[int], owners: list[int], world_size: int) -> float:
    """The most parameters one rank owns over the mean (1.0: perfectly even): what the slowest rank's share of the
    updates and copies costs over an even split."""
    loads = [0] * world_size
    for numel, owner in zip(numels, owners, strict=True):
        loads[owner] += numel
    mean = sum(loads) / world_size
    return max(loads) / mean if mean else 1.0


def owned_blocks(blocks: list[Block], rank: int, world_size: int) -> list[Block]:
    """The blocks ``rank`` of ``world_size`` owns (their own indices kept: planning takes any such list)."""
    owners = assign_owners([block.numel for block in blocks], world_size)
    return [block for block in blocks if owners[block.index] == rank]


def rank_config(cfg: TierstoreConfig, blocks: list[Block], owned: list[Block], device: torch.device) -> TierstoreConfig:
    """``cfg`` as one rank plans with it: the node's ``tiers.host.budget`` and ``tiers.nvme.budget`` shared in
    proportion to the parameters the rank owns (under ``auto``, the RAM available now, which every rank of the node
    sees whole), and ``optimizer.accumulate_on: auto`` decided from the whole model's gradients (every rank's
    ``.grad`` holds them all where they accumulate on the device). The rest of the config is the node's."""
    total = sum(block.numel for block in blocks)
    share = sum(block.numel for block in owned) / total if total else 1.0
    host = cfg.tiers.host
    node_host = host_memory().usable_nbytes if host.budget == "auto" else int(host.budget)
    tiers = dataclasses.replace(cfg.tiers, host=dataclasses.replace(host, budget=int(node_host * share)),
                                nvme=dataclasses.replace(cfg.tiers.nvme, budget=int(cfg.tiers.nvme.budget * share)))
    optimizer = cfg.optimizer
    if optimizer.accumulate_on == "auto":
        optimizer = dataclasses.replace(optimizer, accumulate_on="host" if sums_on_host(blocks, cfg, device) else "gpu")
    return dataclasses.replace(cfg, tiers=tiers, optimizer=optimizer)
