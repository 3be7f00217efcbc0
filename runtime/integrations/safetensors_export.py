"""Save an offloaded model's weights as sharded safetensors files, a few blocks at a time.

For a model whose weights do not fit in host memory at once (``model.state_dict()`` and ``close()`` need
them all), this writes the layout HF ``from_pretrained`` reads: ``model-00001-of-0000N.safetensors`` files
and ``model.safetensors.index.json`` (total size and the file of each tensor), plus ``config.json`` when the
model has an HF config. Only one shard's tensors are in host memory at a time. Files are written under a
temporary name and renamed, so a crash leaves no half-written shard under a final name.

Needs the ``safetensors`` package (``pip install -e '.[hf]'``).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from runtime.core.blocks import Block
from tierstore import create_new

log = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"
EXPORT_MODE = 0o644  # exported weights are read by others (from_pretrained in another account, a model hub upload)


class OffloadedWeights(Protocol):
    """What ``save_sharded`` reads of an offloaded model (``runtime.session.OffloadSession`` is one): its blocks,
    the module (for the parameters and buffers not offloaded, and an HF config), the compute dtype, and one
    block's current weights at a time."""

    @property
    def blocks(self) -> list[Block]:
        """The offloaded blocks, in the model's order."""

    @property
    def model(self) -> nn.Module:
        """The offloaded module."""

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the weights are computed in (the shards' default)."""

    def weights_of(self, block: Block, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """The block's current weights by parameter name, CPU tensors in ``dtype``."""


def plan_shards(blocks: list[Block], itemsize: int, max_shard_nbytes: int) -> list[list[Block]]:
    """Consecutive blocks grouped into shards of at most ``max_shard_nbytes`` (a larger block gets its own)."""
    shards: list[list[Block]] = []
    current: list[Block] = []
    nbytes = 0
    for block in blocks:
        size = block.numel * itemsize
        if current and nbytes + size > max_shard_nbytes:
            shards.append(current)
            current, nbytes = [], 0
        current.append(block)
        nbytes += size
    if current:
        shards.append(current)
    return shards


def save_sharded(session: OffloadedWeights, directory: str | os.PathLike[str], *,
                 max_shard_nbytes: int = 5 << 30, dtype: torch.dtype | None = None) -> Path:
    """Write the session's current weights (the fp32 masters cast to ``dtype``, default the compute dtype) and
    the model's other parameters and persistent buffers as HF-style safetensors shards; returns the index path."""
    try:
        from safetensors.torch import save_file
    except ImportError as exc:
        raise ImportError("save_sharded needs safetensors: pip install -e '.[hf]'") from exc
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    dtype = dtype or session.compute_dtype
    shards = plan_shards(session.blocks, torch.empty((), dtype=dtype).itemsize, max_shard_nbytes)
    rest = _other_tensors(session)
    total = len(shards) + (1 if rest else 0)
    weight_map: dict[str, str] = {}
    total_nbytes = 0
    for number, blocks in enumerate(shards, start=1):
        tensors: dict[str, torch.Tensor] = {}
        for block in blocks:
            tensors.update(session.weights_of(block, dtype))
        name = f"model-{number:05d}-of-{total:05d}.safetensors"
        total_nbytes += _write(save_file, tensors, out / name)
        weight_map.update(dict.fromkeys(tensors, name))
        log.info("saved shard %d/%d (%d tensors)", number, total, len(tensors))
    if rest:
        name = f"model-{total:05d}-of-{total:05d}.safetensors"
        total_nbytes += _write(save_file, rest, out / name)
        weight_map.update(dict.fromkeys(rest, name))
    index = out / INDEX_NAME
    tmp = _fresh_tmp(index)
    with open(tmp, "w") as file:  # our own regular file, just created: nothing planted is followed
        file.write(json.dumps({"metadata": {"total_size": total_nbytes}, "weight_map": weight_map}, indent=2))
    os.replace(tmp, index)  # a rename replaces whatever is at the final name, a link too, and never follows it
    config = getattr(session.model, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        config.save_pretrained(str(out))
    return index


def _other_tensors(session: OffloadedWeights) -> dict[str, torch.Tensor]:
    """Parameters tierstore does not offload (frozen ones) and persistent buffers, by state_dict name."""
    offloaded = {id(slot.param) for block in session.blocks for slot in block.slots}
    out: dict[str, torch.Tensor] = {}
    for prefix, module in session.model.named_modules():
        dot = f"{prefix}." if prefix else ""
        for name, p in module._parameters.items():
            if p is not None and id(p) not in offloaded:
                out[dot + name] = p.detach().to("cpu", copy=True)
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                out[dot + name] = buf.detach().to("cpu", copy=True)
    return out


def _fresh_tmp(path: Path) -> Path:
    """``path`` + ``.tmp``, created new as a regular file of ours (mode 0644, as exported weights are shared): a
    leftover of a killed save or a link planted at that name is unlinked first, never written through."""
    tmp = path.with_name(path.name + ".tmp")
    os.close(create_new(tmp, flags=os.O_WRONLY, mode=EXPORT_MODE, replace_stale=True))
    return tmp


def _write(save_file: Callable[..., None], tensors: dict[str, torch.Tensor], path: Path) -> int:
    tmp = _fresh_tmp(path)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, path)
    return sum(t.numel() * t.element_size() for t in tensors.values())
