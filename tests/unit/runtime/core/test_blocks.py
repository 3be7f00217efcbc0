"""build_blocks: one block per repeated layer, outer modules grouped by size in forward order, every
trainable parameter in exactly one block, slots laid out contiguously in model.parameters() order."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from runtime.bundled.example_model import ExampleLM, ModelShape
from runtime.core.blocks import Block, build_blocks, find_layer_container

SHAPE = ModelShape(vocab_size=256, hidden_size=32, num_layers=3, num_heads=4, ffn_size=64, max_seq_len=64)
EMBED_NBYTES = 256 * 32 * 4  # fp32 embedding (and untied head)
NORM_NBYTES = 32 * 4


def make_model(**overrides) -> ExampleLM:
    torch.manual_seed(0)
    shape = ModelShape(**{**SHAPE.__dict__, **overrides})
    return ExampleLM(shape)


def by_name(blocks: list[Block]) -> dict[str, Block]:
    return {b.name: b for b in blocks}


def owners(blocks: list[Block]) -> dict[int, list[int]]:
    """id(param) -> indices of every block holding it."""
    out: dict[int, list[int]] = {}
    for block in blocks:
        for slot in block.slots:
            out.setdefault(id(slot.param), []).append(block.index)
    return out


def assert_layout(model: nn.Module, blocks: list[Block]) -> None:
    """Indices are positions; slots contiguous from 0, in model.parameters() order, with the right index."""
    position = {id(p): i for i, p in enumerate(model.parameters())}
    names = {id(p): n for n, p in model.named_parameters()}
    assert [b.index for b in blocks] == list(range(len(blocks)))
    for block in blocks:
        assert block.slots, f"{block.name} is empty"
        offset = 0
        for slot in block.slots:
            assert slot.offset == offset
            assert slot.numel == slot.param.numel()
            assert slot.shape == slot.param.shape
            assert slot.index == position[id(slot.param)]
            assert slot.name == names[id(slot.param)]
            offset += slot.numel
        assert block.numel == offset
        assert [s.index for s in block.slots] == sorted(s.index for s in block.slots)
        assert block.key("master") == f"block{block.index}.master"


def test_one_block_per_layer_with_small_outer_modules_in_rest_blocks():
    model = make_model()
    blocks = build_blocks(model)  # default 16 MiB: embedding, norm and head are all small
    assert [b.name for b in blocks] == ["rest.before", "layers.0", "layers.1", "layers.2", "rest.after"]
    assert [b.is_layer for b in blocks] == [False, True, True, True, False]
    for i, layer in enumerate(model.layers):
        block = by_name(blocks)[f"layers.{i}"]
        assert block.modules == [layer]
        assert {id(s.param) for s in block.slots} == {id(p) for p in layer.parameters()}
    rest_before, rest_after = blocks[0], blocks[-1]
    assert [s.param for s in rest_before.slots] == [model.embed.weight]
    assert rest_before.modules == [model.embed]
    # After the layers, in forward order: the final norm, then the head.
    assert [s.name for s in rest_after.slots] == ["norm.weight", "head.weight"]
    assert rest_after.modules == [model.norm, model.head]
    assert_layout(model, blocks)


def test_large_outer_modules_own_blocks_and_small_ones_share_rest_after():
    model = make_model()
    blocks = build_blocks(model, min_block_nbytes=EMBED_NBYTES)  # embed and head qualify, norm does not
    names = [b.name for b in blocks]
    assert names == ["embed", "layers.0", "layers.1", "layers.2", "head", "rest.after"]
    named = by_name(blocks)
    assert [s.param for s in named["embed"].slots] == [model.embed.weight]
    assert [s.param for s in named["head"].slots] == [model.head.weight]
    assert [s.param for s in named["rest.after"].slots] == [model.norm.weight]
    assert "rest.before" not in names  # nothing small before the layers
    assert_layout(model, blocks)


def test_threshold_is_inclusive_and_tiny_threshold_gives_every_outer_module_a_block():
    model = make_model()
    just_below = build_blocks(model, min_block_nbytes=EMBED_NBYTES + 1)
    assert [b.name for b in just_below] == ["rest.before", "layers.0", "layers.1", "layers.2", "rest.after"]
    every = build_blocks(model, min_block_nbytes=NORM_NBYTES)
    assert [b.name for b in every] == ["embed", "layers.0", "layers.1", "layers.2", "norm", "head"]


@pytest.mark.parametrize("min_block_nbytes", [1, NORM_NBYTES + 1, EMBED_NBYTES, 16 << 20])
def test_before_blocks_precede_layers_and_after_blocks_follow(min_block_nbytes):
    model = make_model()
    blocks = build_blocks(model, min_block_nbytes=min_block_nbytes)
    layer_idx = [b.index for b in blocks if b.is_layer]
    assert layer_idx == list(range(layer_idx[0], layer_idx[0] + SHAPE.num_layers))
    param_block = {id(s.param): b.index for b in blocks for s in b.slots}
    assert param_block[id(model.embed.weight)] < min(layer_idx)
    assert param_block[id(model.norm.weight)] > max(layer_idx)
    assert param_block[id(model.head.weight)] > max(layer_idx)


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("min_block_nbytes", [1, EMBED_NBYTES, 16 << 20])
def test_every_trainable_parameter_in_exactly_one_block(tie, min_block_nbytes):
    model = make_model(tie_embeddings=tie)
    blocks = build_blocks(model, min_block_nbytes=min_block_nbytes)
    held = owners(blocks)
    assert set(held) == {id(p) for p in model.parameters()}
    assert all(len(v) == 1 for v in held.values())
    assert sum(b.numel for b in blocks) == sum(p.numel() for p in model.parameters()) == model.shape.num_params
    assert_layout(model, blocks)


@pytest.mark.parametrize("min_block_nbytes", [EMBED_NBYTES, 16 << 20])
def test_tied_embeddings_one_owner_block_listing_both_modules(min_block_nbytes):
    model = make_model(tie_embeddings=True)
    assert model.head.weight is model.embed.weight
    blocks = build_blocks(model, min_block_nbytes=min_block_nbytes)
    held = owners(blocks)[id(model.embed.weight)]
    assert len(held) == 1
    owner = blocks[held[0]]
    assert owner.index < min(b.index for b in blocks if b.is_layer)  # owned where it is first used
    assert model.embed in owner.modules and model.head in owner.modules
    # The head is hooked through the owner block only.
    assert [b.index for b in blocks if model.head in b.modules] == [owner.index]
    assert len(owner.slots) == 1 and owner.slots[0].name == "embed.weight"
    assert_layout(model, blocks)


def test_module_patterns_override_the_layer_search():
    model = make_model()
    blocks = build_blocks(model, module_patterns=["layers.*.qkv", "layers.*.gate_up"])
    layers = [b for b in blocks if b.is_layer]
    assert [b.name for b in layers] == [f"layers.{i}.{m}" for i in range(3) for m in ("qkv", "gate_up")]
    for b in layers:
        module = dict(model.named_modules())[b.name]
        assert b.modules == [module]
        assert [s.param for s in b.slots] == [module.weight]
    held = owners(blocks)
    assert set(held) == {id(p) for p in model.parameters()} and all(len(v) == 1 for v in held.values())
    assert_layout(model, blocks)


def test_module_patterns_nested_matches_are_covered_by_their_ancestor():
    model = make_model()
    # "layers.*" also matches "layers.0.qkv" etc.: only the outermost matches become blocks.
    blocks = build_blocks(model, module_patterns=["layers.*"])
    assert [b.name for b in blocks if b.is_layer] == ["layers.0", "layers.1", "layers.2"]


def test_module_patterns_matching_nothing_is_a_clear_error():
    model = make_model()
    with pytest.raises(ValueError, match=r"matched no module.*embed"):
        build_blocks(model, module_patterns=["transformer.h.*"])


def test_frozen_parameters_are_excluded():
    model = make_model()
    model.embed.weight.requires_grad_(False)
    model.layers[1].qkv.weight.requires_grad_(False)
    blocks = build_blocks(model)
    held = owners(blocks)
    assert id(model.embed.weight) not in held
    assert id(model.layers[1].qkv.weight) not in held
    assert set(held) == {id(p) for p in model.parameters() if p.requires_grad}
    # The embedding had nothing trainable: no block before the layers.
    assert [b.name for b in blocks] == ["layers.0", "layers.1", "layers.2", "rest.after"]
    assert [s.name for s in blocks[1].slots] == [n for n, p in model.layers[1].named_parameters(prefix="layers.1") if p.requires_grad]
    # Slot offsets stay contiguous and indices still refer to model.parameters() positions.
    assert_layout(model, blocks)


def test_fully_frozen_layer_gets_no_block():
    model = make_model()
    for p in model.layers[0].parameters():
        p.requires_grad_(False)
    blocks = build_blocks(model)
    assert [b.name for b in blocks] == ["rest.before", "layers.1", "layers.2", "rest.after"]
    assert_layout(model, blocks)


class NoRepeats(nn.Module):
    """No container of repeated same-class modules."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.mid = nn.Sequential(nn.Linear(16, 16), nn.ReLU())  # mixed classes: not a layer container
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.mid(self.norm(self.inp(x))))


def test_model_without_repeated_container():
    model = NoRepeats()
    assert find_layer_container(model) is None
    blocks = build_blocks(model)
    assert [b.name for b in blocks] == ["rest.before"]
    assert not blocks[0].is_layer
    assert [s.param for s in blocks[0].slots] == list(model.parameters())
    assert set(map(id, blocks[0].modules)) == {id(model.inp), id(model.norm), id(model.mid[0]), id(model.out)}
    assert_layout(model, blocks)
    big = build_blocks(model, min_block_nbytes=(16 * 16 + 16) * 4)  # only mid.0 holds that many bytes
    assert [b.name for b in big] == ["mid.0", "rest.before"]
    assert [s.param for s in big[0].slots] == list(model.mid[0].parameters())
    assert big[0].modules == [model.mid[0]]
    assert_layout(model, big)


def test_find_layer_container_picks_the_largest_repeated_container():
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.small = nn.ModuleList(nn.Linear(2, 2) for _ in range(4))
            self.big = nn.Sequential(*(nn.Linear(8, 8) for _ in range(2)))

    model = Two()
    name, children = find_layer_container(model)
    assert name == "big"
    assert [n for n, _ in children] == ["big.0", "big.1"]
    assert [b.name for b in build_blocks(model) if b.is_layer] == ["big.0", "big.1"]


class HeadTiedToLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.head = nn.Linear(4, 4, bias=False)
        self.head.weight = self.layers[0].weight


def test_outer_module_sharing_a_layer_parameter_needs_that_block():
    model = HeadTiedToLayer()
    blocks = build_blocks(model)
    owner = owners(blocks)[id(model.head.weight)]
    assert len(owner) == 1
    assert any(model.head in b.modules for b in blocks)
