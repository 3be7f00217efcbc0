"""Gradients of host-updated blocks held on the device until the commit and scaled there ([Note: held
gradients] in ``runtime.engine.held_grads``): bit-identical to the plain loop when every step clips, when some holds are
refused (those gradients are scaled on the host, as before), with the user's own clipping, fp16 overflow steps,
host gradient sums and a dropped step; the holds really happen (counted per block) and leave nothing behind."""

from __future__ import annotations

import pytest
import torch

from runtime import offload
from runtime.bundled.example_model import ExampleLM
from runtime.engine.held_grads import HeldGrads
from tests.integration.reference_loop import ReferenceTrainer
from tests.integration.test_host_sums import train_both
from tests.integration.test_parity import (
    SHAPE,
    assert_identical,
    make_batches,
    run_both,
    step_and_check,
    steps_and_check,
    train_with_the_users_clip,
)


def _host_updated(session) -> int:
    return len(session.controller.host_updated_blocks)


def _refuse_even_blocks(held: HeldGrads, refused: list[int]) -> None:
    """Make ``held`` refuse the even blocks' gradients (recorded in ``refused``): they leave during the backward and
    the worker scales them."""
    hold = held.try_hold

    def try_hold(index, flat):
        if index % 2 == 0:
            refused.append(index)
            return False
        return hold(index, flat)

    held.try_hold = try_hold


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
        _refuse_even_blocks(session.controller.held, refused)

    hosted: list[int] = []
    ours, theirs, weights, reference, _, (stats, _, _) = run_both(
        {"dtype": "fp32", "optimizer": {"grad_clip": 0.05}}, steps=4, prepare=refuse_even_blocks,
        inspect=lambda s: hosted.append(_host_updated(s)))
    assert ours == theirs
    assert_identical(weights, reference)
    assert refused and stats.held_grads > 0
    assert stats.held_grads + len(refused) == 3 * hosted[0]


def test_user_clip_below_one_holds_gradients_exactly():
    assert train_with_the_users_clip(0.05).controller.stats.held_grads > 0


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

    def step(streamed_state_nbytes: int, in_flight: int = 0, forward_base: int = 20) -> None:
        allocated[0] = forward_base
        held.forward_begin(lambda: in_flight)
        allocated[0] = 100
        held.begin(streamed_state_nbytes)
        allocated[0] = 90

    held.forward_begin()
    assert not held.try_hold(0, flat)  # the backward has not begun: no room is known
    step(streamed_state_nbytes=64)
    assert held.try_hold(1, flat)  # 16 + 64 <= 80
    assert not held.try_hold(2, flat)  # 32 + 64 > 80
    assert list(held.take()) == [1] and held.nbytes == 0
    step(streamed_state_nbytes=48)
    assert held.try_hold(1, flat) and held.try_hold(3, flat)  # 32 + 48 <= 80
    assert not held.try_hold(2, flat)  # 48 + 48 > 80
    held.take()
    step(streamed_state_nbytes=0)
    allocated[0] = 101
    assert not held.try_hold(4, flat)  # above what the backward began with
    # Copies to host still in flight when the forward began (10 bytes) land during it: not part of the base.
    held.take()
    step(streamed_state_nbytes=64, in_flight=10, forward_base=30)
    assert held.try_hold(5, flat)  # 16 + 64 <= 100 - 20
    assert not held.try_hold(6, flat)


def test_a_commit_that_fails_part_way_refuses_the_next_step_until_a_checkpoint_load(tmp_path):
    # The host's updates are queued before the device's: a failure in the latter leaves blocks at two steps. The
    # session says so instead of training on, lets the queued updates finish, and a checkpoint load puts every
    # block back at one step, after which training matches the plain loop.
    import time

    import pytest

    from runtime import load_checkpoint, save_checkpoint

    torch.manual_seed(0)
    model = ExampleLM(SHAPE)
    reference = ReferenceTrainer(model, grad_clip=0.05)
    model, optimizer = offload(model, {"dtype": "fp32", "optimizer": {"grad_clip": 0.05, "gpu_update_fraction": 0.5}})
    session = optimizer.session
    batches = make_batches(3)
    with session:
        controller = session.controller
        assert controller.gpu_updated, "the config put no block's update on the device"
        step_and_check(model, optimizer, reference, *batches[0])
        save_checkpoint(session, tmp_path / "ckpt")
        run_job, device_update = controller.worker._run_job, controller.device_updates.update

        def slow_job(job):  # the failed step's host updates are still queued when the device's fail
            time.sleep(0.05)
            run_job(job)

        def fail(*args, **kwargs):
            raise RuntimeError("device update failed")

        controller.worker._run_job, controller.device_updates.update = slow_job, fail
        model(*batches[1]).backward()
        with pytest.raises(RuntimeError, match="device update failed"):
            optimizer.step()
        controller.worker._run_job, controller.device_updates.update = run_job, device_update
        with pytest.raises(RuntimeError, match="failed after some of its updates were queued.*load_checkpoint"):
            model(*batches[2]).backward()
        load_checkpoint(session, tmp_path / "ckpt")
        assert_identical(session.master_state_dict(), reference)
        step_and_check(model, optimizer, reference, *batches[2])
        assert_identical(session.master_state_dict(), reference)


def _held_with_driven_allocator(monkeypatch) -> tuple[HeldGrads, dict[str, int]]:
    """A HeldGrads on a CUDA device whose allocator the test drives: ``state["retries"]`` is what
    ``torch.cuda.memory_stats`` reports as the allocator's retries so far."""
    state = {"allocated": 0, "retries": 0}
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: state["allocated"])
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: {"num_alloc_retries": state["retries"]})
    return HeldGrads(torch.device("cuda")), state


def _window(held: HeldGrads, state: dict[str, int], retries: int, *, dropped: bool = False) -> int:
    """One step's window with ``retries`` allocator retries counted by its backward's start: the forward begins at
    0 bytes, the backward at 1000, eight 16-byte gradients are offered at 500; the step commits (or is dropped).
    Returns how many were held."""
    state["retries"], state["allocated"] = retries, 0
    held.forward_begin()
    state["allocated"] = 1000
    held.begin()
    state["allocated"] = 500
    kept = sum(held.try_hold(i, torch.zeros(4)) for i in range(8))
    held.drop() if dropped else held.take()
    return kept


def test_allocator_retries_after_the_first_halve_what_later_steps_hold(monkeypatch):
    """The first step window with an allocator retry is let pass (one device synchronization); every later one
    halves what the steps after it may hold."""
    held, state = _held_with_driven_allocator(monkeypatch)
    assert _window(held, state, 0) == 8 and held.limit_nbytes is None
    assert _window(held, state, 1) == 8 and held.limit_nbytes is None  # a retry in the last window: let pass
    assert _window(held, state, 2) == 4 and held.limit_nbytes == 64  # and again: half of the 128 bytes held
    assert _window(held, state, 2) == 4  # no new retry: the limit stays
    assert _window(held, state, 4) == 2 and held.limit_nbytes == 32


def test_a_first_window_with_several_allocator_retries_halves_at_once(monkeypatch):
    held, state = _held_with_driven_allocator(monkeypatch)
    assert [_window(held, state, retries) for retries in (0, 2, 2)] == [8, 4, 4] and held.limit_nbytes == 64


def _no_speculation(session) -> None:
    import dataclasses

    controller = session.controller
    controller.options = dataclasses.replace(controller.options, speculate=False)


def test_holds_follow_the_last_clip_factor():
    # Without early updates (a plan with no second buffers) a step holds its host gradients only where the last
    # commit multiplied them: every step when the clip binds, only the first (the guess) when it never does.
    hosted: list[int] = []
    inspect = lambda s: hosted.append(_host_updated(s))  # noqa: E731
    ours, theirs, weights, reference, _, (binding, _, _) = run_both(
        {"dtype": "fp32", "optimizer": {"grad_clip": 0.05}}, steps=4, prepare=_no_speculation, inspect=inspect)
    assert ours == theirs
    assert_identical(weights, reference)
    assert binding.held_grads == 4 * hosted[0] and binding.early_updates == 0
    ours, theirs, weights, reference, _, (idle, _, _) = run_both(
        {"dtype": "fp32", "optimizer": {"grad_clip": 1e6}}, steps=4, prepare=_no_speculation, inspect=inspect)
    assert ours == theirs
    assert_identical(weights, reference)
    assert idle.held_grads == hosted[1]  # step 1 only


def test_a_users_clip_that_does_not_bind_stops_the_holds():
    # clip_grad_norm_ records a factor every step, exactly 1 when the clip does not bind: nothing to multiply, so
    # only the first step (the guess) holds.
    session = train_with_the_users_clip(1e6, prepare=_no_speculation)
    assert session.controller.stats.held_grads == _host_updated(session) > 0


def test_fp16_loss_scaling_without_clipping_holds_nothing():
    config = {"dtype": "fp16", "optimizer": {"loss_scale": {"initial": 2.0**16}}}
    ours, theirs, weights, reference, _, (stats, _, _) = run_both(config, steps=4, dtype=torch.float16,
                                                                  loss_scale=2.0**16, prepare=_no_speculation)
    assert ours == theirs
    assert_identical(weights, reference)
    assert stats.held_grads == 0


def test_user_scales_of_refused_holds_are_applied_on_the_host_exactly():
    # Held gradients are scaled on the device, refused ones by the worker with the user's per-parameter factors.
    refused: list[int] = []
    session = train_with_the_users_clip(0.05, prepare=lambda s: _refuse_even_blocks(s.controller.held, refused))
    assert refused and session.controller.stats.held_grads > 0


@pytest.mark.parametrize("accumulation", [1, 2])
def test_a_drop_whose_cleanup_fails_refuses_the_next_step_until_a_checkpoint_load(tmp_path, accumulation):
    # zero_grad() before step() drops the step (with 2: between micro-batches, its first already summed in host
    # memory); if a copy it waits for failed, the session cannot know every block is at one step: it refuses the
    # next one, and a checkpoint load mends it: the next step starts from none of the dropped one's sums.
    from runtime import load_checkpoint, save_checkpoint

    torch.manual_seed(0)
    model = ExampleLM(SHAPE)
    reference = ReferenceTrainer(model, grad_clip=0.05, accumulation_steps=accumulation)
    config = {"dtype": "fp32", "optimizer": {"grad_clip": 0.05, "accumulation_steps": accumulation,
                                             "accumulate_on": "host" if accumulation > 1 else "gpu"}}
    model, optimizer = offload(model, config)
    session = optimizer.session
    batches = make_batches(3 * accumulation)

    def step(micro) -> None:
        steps_and_check(model, optimizer, reference, micro)

    with session:
        controller = session.controller
        step(batches[:accumulation])
        save_checkpoint(session, tmp_path / "ckpt")
        model(*batches[accumulation]).backward()  # the dropped step's first micro-batch
        wait = controller.writebacks.wait_all

        def failing_wait():
            raise RuntimeError("a write-back failed")

        controller.writebacks.wait_all = failing_wait
        with pytest.raises(RuntimeError, match="a write-back failed"):
            optimizer.zero_grad()
        controller.writebacks.wait_all = wait
        with pytest.raises(RuntimeError, match="dropping a step failed part-way.*load_checkpoint"):
            model(*batches[2 * accumulation]).backward()
        load_checkpoint(session, tmp_path / "ckpt")
        step(batches[2 * accumulation:])
        assert_identical(session.master_state_dict(), reference)


def test_a_retry_in_a_dropped_steps_window_counts_like_any_other(monkeypatch):
    """A step dropped after it held gradients (an exception, zero_grad() before step()) counts its holds as a
    committed one does: retries in its window are let pass once, then halve."""
    held, state = _held_with_driven_allocator(monkeypatch)
    kept = [_window(held, state, retries, dropped=dropped)
            for retries, dropped in ((0, True), (1, True), (2, False), (2, False))]
    assert kept == [8, 8, 4, 4] and held.limit_nbytes == 64
