"""Grouping a model's parameters into blocks: the unit of every transfer and every optimizer job.

Default grouping: one block per child of the model's largest container of repeated layers (a ModuleList
or Sequential of same-class modules, e.g. ``model.layers``); among the remaining parameters, each module
whose own parameters hold at least ``min_block_nbytes`` becomes a block; everything else forms a
``rest.before`` or ``rest.after`` block (by where it runs), so block indices follow the forward order.
``modules`` (glob patterns over module names) overrides the layer search.
Parameters shared between modules belong to one block; every module that uses them needs that block.
"""

from __future__ import annotations

import fnmatch
import logging
from dataclasses import dataclass, field

import torch
from torch import nn

log = logging.getLogger(__name__)


@dataclass
class ParamSlot:
    """Where one parameter lives inside its block's flat buffers."""

    name: str
    param: nn.Parameter
    offset: int  # elements from the start of the flat buffer
    numel: int
    shape: torch.Size
    index: int  # position in model.parameters(), the order the reference loop sees
    dtype: torch.dtype = torch.float32  # the parameter's dtype before offload (close() gives it back)
    device: torch.device = torch.device("cpu")  # the parameter's device before offload (a failed offload() gives it back)


@dataclass
class Block:
    """A group of parameters moved and updated together. ``modules`` are the modules whose forward needs
    this block's weights; ``slots`` are the parameters in flat-buffer order."""

    index: int
    name: str
    slots: list[ParamSlot] = field(default_factory=list)
    modules: list[nn.Module] = field(default_factory=list)
    is_layer: bool = False  # one repeated layer: its module's parameters count recursively

    @property
    def numel(self) -> int:
        """Elements in the flat buffer."""
        return sum(slot.numel for slot in self.slots)

    def key(self, kind: str) -> str:
        """The store key of this block's tensor of one kind (master, exp_avg, exp_avg_sq, grad, weights)."""
        return f"block{self.index}.{kind}"


def find_layer_container(model: nn.Module) -> tuple[str, list[tuple[str, nn.Module]]] | None:
    """The container of repeated same-class modules holding the most parameters, with its children."""
    best: tuple[int, str, list[tuple[str, nn.Module]]] | None = None
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(module.named_children())
        if len(children) < 2 or len({type(child) for _, child in children}) != 1:
            continue
        numel = sum(p.numel() for p in module.parameters())
        if numel and (best is None or numel > best[0]):
            best = (numel, name, [(f"{name}.{child_name}" if name else child_name, child) for child_name, child in children])
    return None if best is None else (best[1], best[2])


def build_blocks(model: nn.Module, min_block_nbytes: int = 16 << 20, module_patterns: list[str] | None = None) -> list[Block]:
    """Group model's trainable parameters into blocks in forward order (as far as registration order tells)."""
    named_modules = dict(model.named_modules())
    layer_modules = _layer_modules(model, named_modules, module_patterns)
    param_index = {id(p): i for i, p in enumerate(model.parameters())}
    param_names = {id(p): n for n, p in model.named_parameters()}
    owner_block: dict[int, int] = {}
    blocks: list[Block] = []
    layer_block_ids: set[int] = set()

    def add_block(name: str, params: list[nn.Parameter]) -> Block | None:
        fresh = [p for p in params if p.requires_grad and id(p) not in owner_block]
        if not fresh:
            return None
        block = Block(index=len(blocks), name=name)
        for p in fresh:
            owner_block[id(p)] = block.index
        blocks.append(block)
        return block

    def group_outer(modules: list[tuple[str, nn.Module]], rest_name: str) -> None:
        """Modules outside the layers: large ones become blocks; small ones share one block, placed where
        they run (before or after the layers) so that block indices follow the forward order."""
        rest: list[nn.Parameter] = []
        for name, module in modules:
            own = [p for p in module.parameters(recurse=False) if p.requires_grad and id(p) not in owner_block]
            if own and sum(p.numel() * p.element_size() for p in own) >= min_block_nbytes:
                add_block(name or "<root>", own)
            else:
                rest.extend(p for p in own if all(p is not r for r in rest))
        if rest:
            add_block(rest_name, rest)

    before, after = _outside_layers(named_modules, layer_modules)
    group_outer(before, "rest.before")
    for name, module in layer_modules:
        block = add_block(name, list(module.parameters()))
        if block is not None:
            layer_block_ids.add(block.index)
            block.modules.append(module)
            block.is_layer = True
    group_outer(after, "rest.after")

    # Slots in model.parameters() order within each block, so per-parameter state lines up with the reference.
    for p in model.parameters():
        if id(p) in owner_block:
            block = blocks[owner_block[id(p)]]
            block.slots.append(ParamSlot(param_names[id(p)], p, block.numel, p.numel(), p.shape, param_index[id(p)], p.dtype,
                                             p.device))
    _add_outside_users(blocks, named_modules, owner_block, layer_block_ids)
    log.info("grouped %d parameters into %d blocks (%d layer blocks)", len(owner_block), len(blocks), len(layer_block_ids))
    return blocks


def _layer_modules(model: nn.Module, named_modules: dict[str, nn.Module],
                   module_patterns: list[str] | None) -> list[tuple[str, nn.Module]]:
    """The modules that become one block each: those ``blocks.modules`` names (outermost matches only), else the
    largest container of like layers (``find_layer_container``), else none."""
    if not module_patterns:
        found = find_layer_container(model)
        return found[1] if found else []
    matched = [(name, mod) for name, mod in named_modules.items()
               if name and any(fnmatch.fnmatchcase(name, pat) for pat in module_patterns)]
    # A module matched inside another matched module is covered by its ancestor.
    matched = [(n, m) for n, m in matched if not any(n.startswith(o + ".") for o, _ in matched if o != n)]
    if not matched:
        raise ValueError(f"blocks.modules {module_patterns} matched no module; module names look like {list(named_modules)[1:6]}")
    return matched


def _outside_layers(named_modules: dict[str, nn.Module], layer_modules: list[tuple[str, nn.Module]]
                    ) -> tuple[list[tuple[str, nn.Module]], list[tuple[str, nn.Module]]]:
    """The modules outside the layers, split into those registered before the first layer (embeddings: lower block
    indices, as in forward order) and those after."""
    first_layer = layer_modules[0][0] if layer_modules else None
    layer_names = {n for n, _ in layer_modules}
    before: list[tuple[str, nn.Module]] = []
    after: list[tuple[str, nn.Module]] = []
    seen_first = False
    for name, module in named_modules.items():
        if name == first_layer:
            seen_first = True
        if name in layer_names or any(name.startswith(ln + ".") for ln in layer_names):
            continue
        (after if seen_first else before).append((name, module))
    return before, after


def _add_outside_users(blocks: list[Block], named_modules: dict[str, nn.Module], owner_block: dict[int, int],
                       layer_block_ids: set[int]) -> None:
    """Every module that directly uses a block's parameter needs that block at forward time, unless it lies
    inside the layer that owns it (the layer's own hooks cover it): e.g. a head tied to a layer's weight."""
    inside_layer = {b: {id(m) for m in blocks[b].modules[0].modules()} for b in layer_block_ids}
    for module in named_modules.values():
        for p in module.parameters(recurse=False):
            b = owner_block.get(id(p))
            if b is None or module in blocks[b].modules or id(module) in inside_layer.get(b, ()):
                continue
            blocks[b].modules.append(module)
