"""``runtime.clipping.widen_and_scale``: a bf16 host gradient widened to fp32 and scaled a piece at a time gives the
bits of widening it whole and then ``scale_slots`` (the user's per-parameter factors, then the clip coefficient)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from runtime.blocks import build_blocks
from runtime.clipping import scale_slots, widen_and_scale


@pytest.mark.parametrize("with_scales", [False, True])
@pytest.mark.parametrize("with_multiplier", [False, True])
def test_widening_in_pieces_equals_widening_whole_then_scaling(with_scales, with_multiplier):
    model = nn.Sequential(nn.Linear(13, 11), nn.Linear(11, 7))
    block = build_blocks(model, 1)[0]
    narrow = torch.randn(block.numel, generator=torch.Generator().manual_seed(0)).bfloat16()
    scales = [torch.tensor(0.3 + 0.1 * i) if i % 2 == 0 else None for i in range(len(block.slots))] if with_scales else None
    multiplier = torch.tensor(0.123456) if with_multiplier else None
    expected = narrow.float()
    scale_slots(expected, block, scales, multiplier)
    out = torch.full((block.numel,), float("nan"))
    widen_and_scale(narrow, out, block, scales, multiplier, piece_numel=17)  # pieces cut across parameters
    assert torch.equal(out, expected)
