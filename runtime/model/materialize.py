"""Models built on the meta device: parameters are filled one block at a time, never all at once.

A model of 10B parameters needs 40 GB just to exist in fp32 on the host before ``offload`` copies it into
the store. Built under ``torch.device("meta")`` it needs nothing: ``materialize_meta_parameters`` swaps
each meta parameter for a host parameter whose storage is reserved but not touched (the OS commits pages
on first write), and the controller fills each block with the caller's ``init`` just before copying it
into the store, then frees it. Peak host memory for the model itself is then one block.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence

import torch
from torch import nn

from runtime.core.blocks import Block

ParamInit = Callable[[str, torch.Tensor], None]
"""Fills one parameter in place: ``init(name, tensor)`` with the name from ``model.named_parameters()``."""


def materialize_meta_parameters(model: nn.Module) -> set[int]:
    """Replace every parameter on the meta device with an uninitialised host parameter of the same shape,
    dtype and requires_grad (tied parameters stay tied). Returns the ids of the new parameters."""
    replaced: dict[int, nn.Parameter] = {}
    for module_name, module in model.named_modules():
        for name, buf in module._buffers.items():
            if buf is not None and buf.is_meta:
                where = f"{module_name}.{name}" if module_name else name
                raise ValueError(f"buffer {where} is on the meta device: create buffers on the CPU (or register them "
                                 f"after building the model); only parameters can be materialised block by block")
        for name, param in list(module._parameters.items()):
            if param is None or not param.is_meta:
                continue
            new = replaced.get(id(param))
            if new is None:
                new = nn.Parameter(torch.empty(param.shape, dtype=param.dtype), requires_grad=param.requires_grad)
                replaced[id(param)] = new
            module._parameters[name] = new
    return {id(p) for p in replaced.values()}


def initialize(named: Sequence[tuple[str, torch.Tensor]], init: ParamInit) -> None:
    """Run ``init`` on each (name, parameter) without recording autograd history."""
    with torch.no_grad():
        for name, param in named:
            init(name, param.data)


def block_filler(init: ParamInit | None, uninitialized: set[int]) -> Callable[[Block], None] | None:
    """What the engine calls on each block just before copying it into the store: ``init`` run on the block's
    parameters that ``materialize_meta_parameters`` left uninitialised (None: nothing to fill)."""
    if init is None or not uninitialized:
        return None

    def fill(block: Block) -> None:
        fresh = [(slot.name, slot.param) for slot in block.slots if id(slot.param) in uninitialized]
        if fresh:
            initialize(fresh, init)

    return fill


def seeded_normal_init(name: str, tensor: torch.Tensor, std: float = 0.02) -> None:
    """A ready ``init``: Normal(0, std) for matrices, ones for vectors (norm scales), seeded by the parameter's
    name so the result does not depend on the order blocks are filled in."""
    if tensor.dim() < 2:
        tensor.fill_(1.0)
        return
    tensor.normal_(0.0, std, generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))
