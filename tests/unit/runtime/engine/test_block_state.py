"""BlockTable: one record per block, its update site and spill set from the placement, the placement's sets kept in
step with the records, and the step's facts forgotten by a backward's end or a dropped step as the controller's
index-keyed sets were."""

from __future__ import annotations

import torch
from torch import nn

from runtime.core.blocks import Block, ParamSlot
from runtime.engine.block_state import BlockTable, UpdateSite
from runtime.update.worker import UpdateJob


def _blocks(count: int) -> list[Block]:
    blocks = []
    for index in range(count):
        params = [nn.Parameter(torch.zeros(2)) for _ in range(index + 1)]
        slots = [ParamSlot(f"b{index}.p{n}", p, 2 * n, 2, torch.Size([2]), n) for n, p in enumerate(params)]
        blocks.append(Block(index, f"b{index}", slots))
    return blocks


def test_the_placement_sets_each_record_and_the_sets_in_step():
    blocks = _blocks(5)
    table = BlockTable(blocks, frozenset({0}), frozenset({1, 2}), frozenset({4, 3}))
    assert [s.site for s in table] == [UpdateSite.DEVICE, UpdateSite.STREAMED, UpdateSite.STREAMED, UpdateSite.HOST,
                                       UpdateSite.HOST]
    assert [s.on_device for s in table] == [True, True, True, False, False]
    assert [s.num_slots for s in table] == [1, 2, 3, 4, 5] and [s.index for s in table] == list(range(5))
    assert table.gpu_updated == {0} and table.gpu_streamed == {1, 2}
    assert table.spilled_in_update_order == [3, 4] and [s.spilled for s in table] == [False, False, False, True, True]
    assert [b.index for b in table.host_updated()] == [3, 4]
    table.place(frozenset({0, 1}), frozenset({2}), frozenset({4}))  # a placement adopted after the first step
    assert table[1].site is UpdateSite.DEVICE and table.gpu_updated == {0, 1} and table.gpu_streamed == {2}
    assert not table[3].spilled and table.spilled_in_update_order == [4]


def test_a_backward_end_and_a_dropped_step_forget_what_they_did_before():
    blocks = _blocks(3)
    table = BlockTable(blocks, frozenset(), frozenset(), frozenset())
    for state in table:
        state.grads_done, state.in_backward, state.updating, state.carried = 1, True, True, True
    table[2].job = UpdateJob(blocks[2], None, 1, [])
    table[0].job = UpdateJob(blocks[0], None, 1, [])
    table[1].read_early = True
    assert [job.block.index for job in table.jobs()] == [0, 2]  # forward order, whatever order they came in
    assert table.updating() == [0, 1, 2] and table.read_early() == [1]
    table.end_backward()
    assert all(s.grads_done == 0 and not s.in_backward and s.updating and s.carried for s in table)
    table.reset_step()
    assert table.updating() == [] and all(s.carried for s in table)  # carried blocks are the fetch side's to clear
