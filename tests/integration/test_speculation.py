"""Updates that run before their step commits (clipping, fp16, the user's clip): bit-identical to the plain loop
whether the commit keeps the early result (coefficient exactly 1) or redoes it (a clip below 1, an overflow),
and the early runs really happen (counted by the worker). Tests that count published or redone runs let each early
job start before its verdict (``early_jobs_run_before_their_verdict``): which path a job takes must not depend on how
busy the machine is."""

from __future__ import annotations

import pytest
import torch

from runtime import offload
from runtime.bundled.example_model import ExampleLM
from tests.integration.reference_loop import ReferenceTrainer
from tests.integration.test_parity import SHAPE, assert_identical, make_batches, run_both, train_with_the_users_clip


def worker_stats(stats):
    return stats[2]


def early_jobs_run_before_their_verdict(session) -> None:
    """``run_both``'s ``prepare``: the commit's verdict on an early job waits (up to 5 s) until the worker has
    started it. On this tiny model the backward can end before the worker thread gets the GIL, and a verdict on a
    job still queued withdraws it (the ordinary update runs instead: exact too, but then neither the publish nor
    the redo path is exercised; CI saw that on a loaded 2-core machine)."""
    import threading

    from runtime.update.worker import JobPhase

    worker = session.controller.worker
    resolve, run_job = worker.resolve, worker._run_job
    started = threading.Condition()

    def run_job_announced(job):  # the worker has marked the job running when it calls this
        with started:
            started.notify_all()
        run_job(job)

    def resolve_once_started(job, holds, redo):
        with started:
            started.wait_for(lambda: job.phase is not JobPhase.QUEUED, timeout=5)
        resolve(job, holds, redo)

    worker._run_job, worker.resolve = run_job_announced, resolve_once_started


def test_clip_that_never_scales_publishes_every_early_update():
    ours, theirs, weights, reference, _, stats = run_both({"dtype": "fp32", "optimizer": {"grad_clip": 1e6}},
                                                          prepare=early_jobs_run_before_their_verdict)
    assert ours == theirs
    assert_identical(weights, reference)
    worker = worker_stats(stats)
    assert worker.published > 0 and worker.redone == 0


def test_an_early_updates_kernel_time_is_counted(monkeypatch):
    """WorkerStats.kernel_s (the bench's time line reads it) counts the kernel of updates that ran early and were
    published, not only of those run at the commit: here each early kernel takes at least 20 ms."""
    import time

    import runtime.update.worker as overlap

    kernel = overlap.adamw_update_block

    def slow_kernel(*args, **kwargs):
        if kwargs.get("out") is not None:  # an early update's: out of place, into the spares
            time.sleep(0.02)  # the kernel time the count must include
        return kernel(*args, **kwargs)

    monkeypatch.setattr(overlap, "adamw_update_block", slow_kernel)
    *_, stats = run_both({"dtype": "fp32", "optimizer": {"grad_clip": 1e6}}, steps=2)
    worker = worker_stats(stats)
    assert worker.published > 0 and worker.kernel_s >= 0.02 * worker.published


def test_clip_below_one_redoes_every_early_update_exactly():
    ours, theirs, weights, reference, _, stats = run_both({"dtype": "fp32", "optimizer": {"grad_clip": 0.05}},
                                                          prepare=early_jobs_run_before_their_verdict)
    assert ours == theirs
    assert_identical(weights, reference)
    assert max(stats[0].grad_norms) > 0.05
    worker = worker_stats(stats)
    assert worker.redone > 0 and worker.published == 0


def test_a_step_after_one_that_clipped_does_not_run_early():
    # Every step clips: only the first step's early updates run (and are redone); the steps after a clipping
    # step wait for their commit, and the result is still the plain loop's.
    ours, theirs, weights, reference, _, stats = run_both({"dtype": "fp32", "optimizer": {"grad_clip": 0.05}}, steps=4)
    assert ours == theirs
    assert_identical(weights, reference)
    controller, worker = stats[0], worker_stats(stats)
    assert min(controller.grad_norms) > 0.05
    assert controller.speculation_paused == 3
    assert worker.published == 0
    _, _, _, _, _, one = run_both({"dtype": "fp32", "optimizer": {"grad_clip": 0.05}}, steps=1)
    assert one[0].early_updates > 0
    assert controller.early_updates == one[0].early_updates  # nothing was queued early after the first step


def test_early_updates_resume_after_a_step_that_did_not_clip():
    # Norms from an unclipped run; a threshold below the first step's norm and above the second's: step 1 clips
    # (step 2 does not run early), step 2 does not clip (step 3 runs early again).
    _, _, _, _, _, (probe, _, _) = run_both({"dtype": "fp32", "optimizer": {"grad_clip": 1e6}}, steps=3)
    norms = list(probe.grad_norms)
    if not norms[0] > norms[1]:
        pytest.fail(f"this model's first two gradient norms {norms[:2]} do not fall: the test's premise is wrong")
    threshold = (norms[0] + norms[1]) / 2
    ours, theirs, weights, reference, _, stats = run_both({"dtype": "fp32", "optimizer": {"grad_clip": threshold}}, steps=3)
    assert ours == theirs
    assert_identical(weights, reference)
    assert stats[0].speculation_paused == 1
    _, _, _, _, _, one = run_both({"dtype": "fp32", "optimizer": {"grad_clip": threshold}}, steps=1)
    assert one[0].early_updates > 0
    assert stats[0].early_updates == 2 * one[0].early_updates  # steps 1 and 3


def test_steps_that_clip_and_steps_that_do_not_mix_exactly():
    # A threshold below the first norm of an unclipped run and above the next three: the first step clips, the
    # next ones do not, so early updates are redone (step 1), paused (step 2), then run and kept (steps 3, 4).
    _, _, _, _, _, (probe, _, _) = run_both({"dtype": "fp32", "optimizer": {"grad_clip": 1e6}}, steps=6)
    norms = list(probe.grad_norms)
    if not norms[0] > max(norms[1:4]):
        pytest.fail(f"this model's gradient norms {norms} do not start with the largest: the test's premise is wrong")
    threshold = (norms[0] + max(norms[1:4])) / 2
    ours, theirs, weights, reference, _, stats = run_both({"dtype": "fp32", "optimizer": {"grad_clip": threshold}}, steps=6,
                                                          prepare=early_jobs_run_before_their_verdict)
    assert ours == theirs
    assert_identical(weights, reference)
    worker = worker_stats(stats)
    assert worker.published > 0 and worker.redone > 0


def test_accumulation_with_clipping_publishes_early_updates_exactly():
    config = {"dtype": "fp32", "optimizer": {"grad_clip": 1e6, "accumulation_steps": 2}}
    ours, theirs, weights, reference, _, stats = run_both(config, prepare=early_jobs_run_before_their_verdict)
    assert ours == theirs
    assert_identical(weights, reference)
    assert worker_stats(stats).published > 0


def test_fp16_overflow_discards_early_updates():
    # A loss scale of 2**16 overflows this model's fp16 gradients in its first step only.
    config = {"dtype": "fp16", "optimizer": {"grad_clip": 1e6, "loss_scale": {"initial": 2.0**16}}}
    ours, theirs, weights, reference, _, stats = run_both(config, steps=6, dtype=torch.float16, loss_scale=2.0**16,
                                                          prepare=early_jobs_run_before_their_verdict)
    assert reference.skipped >= 1 and stats[0].skipped_steps == reference.skipped
    assert ours == theirs
    assert_identical(weights, reference)
    worker = worker_stats(stats)
    assert worker.redone > 0 and worker.published > 0  # overflow steps dropped theirs, later steps kept theirs


def test_weights_resident_refreshed_at_publish():
    config = {"dtype": "fp32", "placement": {"weights": "gpu"}, "optimizer": {"grad_clip": 1e6}}
    ours, theirs, weights, reference, _, stats = run_both(config, prepare=early_jobs_run_before_their_verdict)
    assert ours == theirs
    assert_identical(weights, reference)
    assert worker_stats(stats).published > 0


@pytest.mark.parametrize("max_norm", [1e6, 0.05])
def test_user_clip_in_the_loop_is_exact_with_early_updates(max_norm):
    worker = train_with_the_users_clip(max_norm, prepare=early_jobs_run_before_their_verdict).controller.worker.stats
    assert (worker.published > 0) == (max_norm > 1) and (worker.redone > 0) == (max_norm < 1)


def test_abandoned_step_leaves_the_state_of_the_last_commit():
    # backward ran (early updates with it), then the loop gave the step up: the weights are the last commit's.
    torch.manual_seed(0)
    model = ExampleLM(SHAPE)
    reference = ReferenceTrainer(model, grad_clip=1e6)
    model, optimizer = offload(model, {"dtype": "fp32", "optimizer": {"grad_clip": 1e6}})
    session = optimizer.session
    batches = make_batches(3)
    try:
        x, y = batches[0]
        model(x, y).backward()
        optimizer.step()
        optimizer.zero_grad()
        reference.train_step([(x, y)])
        x, y = batches[1]
        model(x, y).backward()
        session.controller.worker.synchronize(session.controller.optimizer_step)
        before_step = {name: p.detach().clone() for name, p in model.named_parameters()}  # read between backward and step
        optimizer.zero_grad()  # drops the pending step
        assert_identical(session.master_state_dict(), reference)
        for name, value in before_step.items():
            assert torch.equal(value, reference.master_state()[name]), name
        x, y = batches[2]
        loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        assert loss.item() == reference.train_step([(x, y)])[0]
        assert_identical(session.master_state_dict(), reference)
    finally:
        session.close()


def test_parameters_without_a_gradient_keep_their_state_when_early_updates_are_published():
    import copy

    from tests.integration.test_kept_grads import PartlyUsedNet

    torch.manual_seed(0)
    model = PartlyUsedNet()
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    config = {"dtype": "fp32", "blocks": {"modules": ["layers.*"]},
              "optimizer": {"lr": 1e-2, "weight_decay": 0.01, "grad_clip": 1e6}}
    model, optimizer = offload(model, config)
    session = optimizer.session
    try:
        for step in range(5):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
            model(x, step % 2 == 1).backward()
            optimizer.step()
            optimizer.zero_grad()
            reference(x, step % 2 == 1).backward()
            torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e6)
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
        weights = session.master_state_dict()
        assert session.controller.worker.stats.published > 0
    finally:
        session.close()
    for name, p in reference.named_parameters():
        assert torch.equal(weights[name], p.detach()), name
