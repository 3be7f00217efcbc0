"""runtime.update.device_updates on the CPU (the "device" is host memory there): when the device's updates run, and how
far ahead streamed state comes in."""

from __future__ import annotations

import pytest
import torch

from runtime import offload
from runtime.bundled.example_model import ExampleLM, ModelShape
from runtime.update.worker import STATE_KINDS
from tests.integration.test_parity import make_batches
from tierstore import CopyState, TierName

SHAPE = ModelShape(vocab_size=256, hidden_size=32, num_layers=4, num_heads=4, ffn_size=64, max_seq_len=64)


def _session(clip: float | None, update: float = 0.3, stream: float = 0.5):
    torch.manual_seed(0)
    model, optimizer = offload(ExampleLM(SHAPE), {"dtype": "fp32", "optimizer": {
        "grad_clip": clip, "gpu_update_fraction": update, "gpu_stream_fraction": stream}})
    return model, optimizer, optimizer.session


def _masters(session, indices) -> dict[int, torch.Tensor]:
    return {i: session.store.tensor(session.blocks[i].key("master"), TierName.GPU).clone() for i in indices}


@pytest.mark.parametrize("clip", [None, 1.0])
def test_device_updates_run_as_gradients_land_or_wait_for_the_commit(clip):
    """Without a clip the device-updated blocks update during the backward (nothing pending when it ends); with one
    they wait in the pending list, unchanged, until step() runs them in forward order."""
    model, optimizer, session = _session(clip)
    updates = session.controller.device_updates
    resident = sorted(session.controller.gpu_updated)
    assert resident, "the config put no block's update on the device"
    try:
        x, y = make_batches(1)[0]
        before = _masters(session, resident)
        model(x, y).backward()
        after_backward = _masters(session, resident)
        changed = [not torch.equal(before[i], after_backward[i]) for i in resident]
        if clip is None:
            assert not updates.pending and all(changed)
        else:
            pending = [block.index for block, *_ in updates.pending]
            assert set(resident) | session.controller.gpu_streamed == set(pending) and not any(changed)
        optimizer.step()
        assert not updates.pending
        assert all(not torch.equal(before[i], t) for i, t in _masters(session, resident).items())
    finally:
        session.close()


def test_a_refused_stream_in_stops_the_blocks_behind_it():
    """stream_in_order brings in the first ``always`` blocks regardless of room, then stops at the first block
    without room: none further ahead comes in, even one that would have room. Room is the weights window
    beside the block's state in the GPU tier's free bytes."""
    model, optimizer, session = _session(None, update=0.0, stream=0.8)
    updates, controller = session.controller.device_updates, session.controller
    streamed = sorted(controller.gpu_streamed, reverse=True)  # the backward's order
    assert len(streamed) >= 3
    try:
        def on_device(index: int) -> bool:
            key = session.blocks[index].key("exp_avg")
            return session.store.state(key, TierName.GPU) is not CopyState.ABSENT

        assert not any(on_device(i) for i in streamed)
        updates.weights_window_nbytes = session.store.tiers[TierName.GPU].free_nbytes + 1  # no room for anything
        updates.stream_in_order(streamed, always=1)
        assert [on_device(i) for i in streamed] == [True] + [False] * (len(streamed) - 1)
        updates.weights_window_nbytes = 0  # room for all, but the second block is refused
        room = updates._room_to_stream
        updates._room_to_stream = lambda index: index != streamed[1] and room(index)
        updates.stream_in_order(streamed, always=1)
        assert [on_device(i) for i in streamed] == [True] + [False] * (len(streamed) - 1)
        del updates._room_to_stream
        updates.stream_in_order(streamed, always=0)
        assert all(on_device(i) for i in streamed)
        for index in streamed:  # clean copies brought in for nothing: let them go, as a dropped step does
            for kind in STATE_KINDS:
                session.store.release_read_ahead(session.blocks[index].key(kind), TierName.GPU)
    finally:
        session.close()
