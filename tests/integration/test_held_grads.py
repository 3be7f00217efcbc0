"""Gradients of host-updated blocks held on the device until the commit and scaled there ([Note: held
gradients] in ``runtime.held_grads``): bit-identical to the plain loop when every step clips, when some holds are
refused (those gradients are scaled on the host, as before), with the user's own clipping, fp16 overflow steps,
host gradient sums and a dropped step; the holds really happen (counted per block) and leave nothing behind."""

from __future__ import annotations

import torch

from runtime import offload
from runtime.example_model import ExampleLM
from runtime.held_grads import HeldGrads
from tests.integration.reference_loop import ReferenceTrainer
from tests.integration.test_host_sums import train_both
from tests.integration.test_parity import SHAPE, assert_identical, make_batches, run_both, step_and_check


def _host_updated(session) -> int:
    controller = session.controller
    return len(session.blocks) - len(controller.gpu_updated) - len(controller.gpu_streamed)


def test_every_step_clipping_holds_each_host_gradient_and_matches_the_plain_loop():
    hosted: list[int] = []
    ours, theirs, weights, reference, _, (stats, _, worker) = run_both(
        {"dtype": "fp32", "optimizer": {"grad_clip": 0.05}}, steps=4, inspect=lambda s: hosted.append(_host_updated(s)))
    assert ours == theirs
    assert_identical(weights, reference)
    assert min(stats.grad_norms) > 0.05  # every step clipped
    # Step 1 runs its host updates early (out of place, then redone): those gradients left during the backward.
    # Steps 2-4 hold every host-updated block's gradient.
    assert stats.speculation_paused == 3
    assert stats.held_grads == 3 * hosted[0] > 0


def test_refused_holds_are_scaled_on_the_host_exactly():
    refused: list[int] = []

    def refuse_even_blocks(session) -> None:
        held = session.controller.held
        hold = held.try_hold

        def try_hold(index, flat, streamed_state_nbytes=0):
            if index % 2 == 0:
                refused.append(index)
                return False
            return hold(index, flat, streamed_state_nbytes)

        held.try_hold = try_hold

    hosted: list[int] = []
    ours, theirs, weights, reference, _, (stats, _, _) = run_both(
        {"dtype": "fp32", "optimizer": {"grad_clip": 0.05}}, steps=4, prepare=refuse_even_blocks,
        inspect=lambda s: hosted.append(_host_updated(s)))
    assert ours == theirs
    assert_identical(weights, reference)
    assert refused and stats.held_grads > 0
    assert stats.held_grads + len(refused) == 3 * hosted[0]


def test_user_clip_below_one_holds_gradients_exactly():
    torch.manual_seed(0)
    model = ExampleLM(SHAPE)
    reference = ReferenceTrainer(model, grad_clip=0.05)
    model, optimizer = offload(model, {"dtype": "fp32", "optimizer": {"grad_clip": None, "user_grad_clip": True}})
    session = optimizer.session
    with session:
        for x, y in make_batches(4):
            loss = model(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            optimizer.step()
            optimizer.zero_grad()
            assert loss.item() == reference.train_step([(x, y)])[0]
        assert_identical(session.master_state_dict(), reference)
        assert session.controller.stats.held_grads > 0


def test_fp16_overflow_steps_drop_held_gradients():
    # A loss scale of 2**16 overflows this model's fp16 gradients at first; a step after an overflow holds.
    config = {"dtype": "fp16", "optimizer": {"grad_clip": 0.05, "loss_scale": {"initial": 2.0**16}}}
    ours, theirs, weights, reference, _, (stats, _, _) = run_both(config, steps=6, dtype=torch.float16, loss_scale=2.0**16)
    assert reference.skipped >= 1 and stats.skipped_steps == reference.skipped
    assert ours == theirs
    assert_identical(weights, reference)
    assert stats.held_grads > 0


def test_host_sums_with_held_gradients_match_the_plain_loop():
    ours, theirs, weights, reference, stats = train_both({"dtype": "fp32", "optimizer": {"grad_clip": 0.05}}, 2, steps=4)
    assert ours == theirs
    assert_identical(weights, reference)
    assert stats.held_grads > 0


def test_a_dropped_step_lets_its_held_gradients_go():
    torch.manual_seed(0)
    model = ExampleLM(SHAPE)
    reference = ReferenceTrainer(model, grad_clip=0.05)
    model, optimizer = offload(model, {"dtype": "fp32", "optimizer": {"grad_clip": 0.05}})
    session = optimizer.session
    batches = make_batches(4)
    with session:
        for x, y in batches[:2]:  # step 1 clips, so step 2 holds
            step_and_check(model, optimizer, reference, x, y)
        x, y = batches[2]
        model(x, y).backward()
        assert session.controller.held.nbytes > 0
        optimizer.zero_grad()  # drops the pending step
        assert session.controller.held.nbytes == 0
        assert_identical(session.master_state_dict(), reference)
        step_and_check(model, optimizer, reference, *batches[3])
        assert_identical(session.master_state_dict(), reference)


def test_the_room_bounds_what_is_held_on_a_gpu(monkeypatch):
    # Allocated bytes (faked): 20 when the forward began, 100 when the backward began, so the step's activations
    # took 80: everything held plus the streamed state must fit in 80, and allocated must stay within 100.
    allocated = [20]
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated[0])
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: {"num_alloc_retries": 0})
    held = HeldGrads(torch.device("cuda"))
    flat = torch.zeros(4)  # 16 bytes
    held.forward_begin()
    assert not held.try_hold(0, flat)  # the backward has not begun: no room is known
    allocated[0] = 100
    held.begin()
    allocated[0] = 90
    assert held.try_hold(1, flat, streamed_state_nbytes=64)  # 16 + 64 <= 80
    assert not held.try_hold(2, flat, streamed_state_nbytes=64)  # 32 + 64 > 80
    assert held.try_hold(3, flat, streamed_state_nbytes=48)  # 32 + 48 <= 80
    allocated[0] = 101
    assert not held.try_hold(4, flat)  # above what the backward began with
    assert list(held.take()) == [1, 3] and held.nbytes == 0
    # Copies to host still in flight when the forward began (10 bytes) land during it: not part of the base.
    allocated[0] = 30
    held.forward_begin(lambda: 10)
    allocated[0] = 100
    held.begin()
    assert held.try_hold(5, flat, streamed_state_nbytes=64)  # 16 + 64 <= 100 - 20
    assert not held.try_hold(6, flat, streamed_state_nbytes=64)


def test_a_commit_that_fails_in_the_device_updates_refuses_the_next_step():
    # The host's updates are queued before the device's: a failure in the latter leaves blocks at two steps,
    # and the session says so instead of training on.
    import pytest

    torch.manual_seed(0)
    model = ExampleLM(SHAPE)
    model, optimizer = offload(model, {"dtype": "fp32", "optimizer": {"grad_clip": 0.05, "gpu_update_fraction": 0.5}})
    session = optimizer.session
    x, y = make_batches(1)[0]
    with session:
        controller = session.controller
        assert controller.gpu_updated, "the config put no block's update on the device"

        def fail(*args, **kwargs):
            raise RuntimeError("device update failed")

        controller._gpu_update = fail
        model(x, y).backward()
        with pytest.raises(RuntimeError, match="device update failed"):
            optimizer.step()
        with pytest.raises(RuntimeError, match="failed in the device's updates.*load_checkpoint"):
            model(x, y).backward()


def test_an_allocator_retry_halves_what_later_steps_hold(monkeypatch):
    state = {"allocated": 0, "retries": 0}
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: state["allocated"])
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: {"num_alloc_retries": state["retries"]})
    held = HeldGrads(torch.device("cuda"))

    def step(blocks: int) -> int:
        state["allocated"] = 0
        held.forward_begin()
        state["allocated"] = 1000
        held.begin()
        state["allocated"] = 500
        kept = sum(held.try_hold(i, torch.zeros(4)) for i in range(blocks))  # 16 bytes each
        held.take()
        return kept

    assert step(8) == 8 and held.limit_nbytes is None
    state["retries"] = 1  # the allocator gave its cache back during that step's window
    assert step(8) == 4 and held.limit_nbytes == 64  # half of the 128 bytes held
    assert step(8) == 4  # no new retry: the limit stays
    state["retries"] = 3
    assert step(8) == 2 and held.limit_nbytes == 32
