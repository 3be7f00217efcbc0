"""UpdateWorker with a real TierStore on the CPU: exact AdamW updates, job order (ready jobs by priority,
else the oldest), the updated-step bookkeeping, skip and mask jobs, failures surfaced to the waiter,
callbacks, and NVMe write-backs."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from torch import nn

from runtime.planning.memory_plan import WeightSource
from runtime.update.adam import AdamWHyper, split_views
from runtime.update.worker import JobPhase, UpdateJob, UpdateWorker
from tests.unit.runtime.engine.test_weights import Setup, make_setup
from tierstore import CopyState, Handle, TierName

HYPER = AdamWHyper(lr=1.0, beta1=0.85, beta2=0.99, eps=1e-7, weight_decay=0.05)  # jobs carry lr=LR
LR = 1e-2
KINDS = ("master", "exp_avg", "exp_avg_sq")


class GatedHandle(Handle):
    """A transfer handle that is not done until complete() is called; ``entered`` is set once the worker
    starts waiting on it."""

    def __init__(self) -> None:
        super().__init__("d2h", "gate", "gpu", "host", 0, None)
        self.entered = threading.Event()

    def wait(self) -> Handle:
        self.entered.set()
        return super().wait()

    def complete(self) -> None:
        if not self._issued.is_set():
            self._set_issued()
            self._finish()


@contextmanager
def running(s: Setup, **kwargs) -> Iterator[UpdateWorker]:
    worker = UpdateWorker(s.blocks, s.store, HYPER, s.weights, **kwargs)
    try:
        yield worker
    finally:
        worker.close()


class Reference:
    """torch.optim.AdamW(fused=True) over the same per-parameter tensors."""

    def __init__(self, s: Setup) -> None:
        self.s = s
        self.params = [[nn.Parameter(v.clone()) for v in split_views(s.masters[b.index], sizes(b))] for b in s.blocks]
        self.opt = torch.optim.AdamW([p for ps in self.params for p in ps], lr=LR, betas=(HYPER.beta1, HYPER.beta2),
                                     eps=HYPER.eps, weight_decay=HYPER.weight_decay, fused=True)

    def step(self, grads: dict[int, torch.Tensor], masks: dict[int, list[bool]] | None = None) -> None:
        for ps in self.params:
            for p in ps:
                p.grad = None
        for index, flat in grads.items():
            keep = (masks or {}).get(index) or [True] * len(self.params[index])
            for p, g, k in zip(self.params[index], split_views(flat, sizes(self.s.blocks[index])), keep, strict=True):
                p.grad = g.clone() if k else None
        self.opt.step()

    def flat(self, index: int, kind: str) -> torch.Tensor:
        ps = self.params[index]
        if kind == "master":
            return torch.cat([p.detach().reshape(-1) for p in ps])
        return torch.cat([self.opt.state[p][kind].reshape(-1) if p in self.opt.state else torch.zeros(p.numel()) for p in ps])


def sizes(block) -> list[int]:  # noqa: ANN001
    return [slot.numel for slot in block.slots]


def host_state(s: Setup, index: int, kind: str) -> torch.Tensor:
    key = s.blocks[index].key(kind)
    s.store.fetch(key, TierName.HOST).wait()
    return s.store.tensor(key, TierName.HOST).clone()


def set_grads(s: Setup, seed: int) -> dict[int, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    grads = {}
    for block in s.blocks:
        g = torch.randn(block.numel, generator=gen)
        s.store.tensor(block.key("grad"), TierName.HOST).copy_(g)
        grads[block.index] = g
    return grads


def job(s: Setup, index: int, step: int, **kwargs) -> UpdateJob:
    hyper = dataclasses.replace(HYPER, lr=LR)
    return UpdateJob(s.blocks[index], kwargs.pop("grad_handle", None), step, [hyper] * len(s.blocks[index].slots), **kwargs)


def snapshot(s: Setup) -> dict[tuple[int, str], torch.Tensor]:
    return {(b.index, kind): host_state(s, b.index, kind) for b in s.blocks for kind in KINDS}


# ---- exactness -----------------------------------------------------------------------------------------
def test_updates_are_bit_identical_to_torch_adamw_over_several_steps():
    with make_setup() as s, running(s) as worker:
        ref = Reference(s)
        for step in (1, 2, 3):
            grads = set_grads(s, seed=step)
            multiplier = torch.tensor(0.25) if step == 3 else None  # a clip coefficient on the last step
            for index in reversed(range(len(s.blocks))):
                worker.submit(job(s, index, step, grad_multiplier=multiplier))
            worker.synchronize(step)
            ref.step({i: g * 0.25 if multiplier is not None else g for i, g in grads.items()})
            for block in s.blocks:
                assert worker.updated_step(block.index) == step
                assert [float(t) for t in worker.param_steps[block.index]] == [float(step)] * len(block.slots)
                for kind in KINDS:
                    assert torch.equal(host_state(s, block.index, kind), ref.flat(block.index, kind)), (step, block.name, kind)
        assert worker.stats.jobs == 3 * len(s.blocks)
        assert not torch.equal(host_state(s, 0, "master"), s.masters[0])


# ---- order ---------------------------------------------------------------------------------------------
def test_jobs_run_lowest_step_first_then_lowest_block_index():
    with make_setup() as s, running(s, record_intervals=True) as worker:
        set_grads(s, seed=0)
        gate = GatedHandle()
        try:
            worker.submit(job(s, 4, 1, grad_handle=gate))
            assert gate.entered.wait(10)  # the worker holds (step 1, block 4) and waits for its gradient
            for step, index in [(2, 3), (1, 2), (2, 0), (1, 3), (2, 4), (1, 0), (2, 2), (1, 1), (2, 1)]:
                worker.submit(job(s, index, step))
            assert not worker.is_updated(0, 1)  # everything is queued behind the gate
        finally:
            gate.complete()
        worker.synchronize(2)
        order = [(index, step) for index, step, _, _ in worker.stats.intervals]
        assert order == [(4, 1), (0, 1), (1, 1), (2, 1), (3, 1), (0, 2), (1, 2), (2, 2), (3, 2), (4, 2)]
        assert all(start <= end for _, _, start, end in worker.stats.intervals)


def test_a_job_whose_gradient_landed_runs_before_a_higher_priority_one_still_copying():
    with make_setup() as s, running(s, record_intervals=True) as worker:
        set_grads(s, seed=1)
        gate, copying = GatedHandle(), GatedHandle()
        try:
            worker.submit(job(s, 4, 1, grad_handle=gate))
            assert gate.entered.wait(10)
            worker.submit(job(s, 0, 1, grad_handle=copying))  # first in priority, gradient not landed
            worker.submit(job(s, 2, 1))  # gradient on host already
            gate.complete()
            assert copying.entered.wait(10)  # the worker only waits on block 0 once nothing else is ready
            assert worker.is_updated(2, 1) and not worker.is_updated(0, 1)
        finally:
            gate.complete()
            copying.complete()
        worker.wait_updated(0, 1)
        assert [(i, st) for i, st, _, _ in worker.stats.intervals] == [(4, 1), (2, 1), (0, 1)]


def test_with_no_gradient_landed_the_oldest_job_is_waited_on_first():
    with make_setup() as s, running(s, record_intervals=True) as worker:
        set_grads(s, seed=2)
        gate, older, newer = GatedHandle(), GatedHandle(), GatedHandle()
        try:
            worker.submit(job(s, 4, 1, grad_handle=gate))
            assert gate.entered.wait(10)
            worker.submit(job(s, 3, 1, grad_handle=older))  # submitted first: its copy finishes first
            worker.submit(job(s, 1, 1, grad_handle=newer))
            gate.complete()
            assert older.entered.wait(10)
            assert not newer.entered.is_set()
        finally:
            for handle in (gate, newer, older):
                handle.complete()
        worker.synchronize(0)
        worker.wait_updated(1, 1)
        worker.wait_updated(3, 1)
        assert [(i, st) for i, st, _, _ in worker.stats.intervals] == [(4, 1), (3, 1), (1, 1)]


def test_without_record_intervals_nothing_is_recorded():
    with make_setup() as s, running(s) as worker:
        worker.submit(job(s, 0, 1))
        worker.synchronize(0)
        worker.wait_updated(0, 1)
        assert worker.stats.intervals == [] and worker.stats.jobs == 1


# ---- bookkeeping ---------------------------------------------------------------------------------------
def test_wait_updated_blocks_until_the_job_has_run():
    with make_setup() as s, running(s) as worker:
        gate = GatedHandle()
        waited: list[float] = []
        waiter = threading.Thread(target=lambda: waited.append(worker.wait_updated(2, 1)))
        try:
            worker.submit(job(s, 2, 1, grad_handle=gate))
            assert gate.entered.wait(10)
            waiter.start()
            waiter.join(0.2)
            assert waiter.is_alive() and waited == []  # the job cannot finish before the gate opens
            assert not worker.is_updated(2, 1)
        finally:
            gate.complete()
        waiter.join(30)
        assert not waiter.is_alive()
        assert len(waited) == 1 and waited[0] > 0.0
        assert worker.is_updated(2, 1) and not worker.is_updated(2, 2)
        assert worker.updated_step(2) == 1
        assert worker.wait_updated(2, 1) == 0.0  # already there: no wait
        assert all(worker.updated_step(i) == 0 for i in (0, 1, 3, 4))


def test_mark_updated_set_updated_step_and_synchronize():
    with make_setup() as s, running(s) as worker:
        assert not worker.is_updated(0, 1) and worker.is_updated(0, 0)
        waiter = threading.Thread(target=worker.wait_updated, args=(0, 1))
        waiter.start()
        worker.mark_updated(0, 1)  # e.g. by the device-side optimizer: wakes the waiter
        waiter.join(30)
        assert not waiter.is_alive()
        worker.mark_updated(3, 5)
        worker.mark_updated(3, 2)  # never goes back
        assert worker.updated_step(3) == 5 and worker.is_updated(3, 4) and worker.wait_updated(3, 5) == 0.0
        worker.set_updated_step(7)  # after a checkpoint load
        assert [worker.updated_step(i) for i in range(5)] == [7] * 5
        worker.synchronize(7)  # returns at once: everything is there
        assert worker.stats.jobs == 0
        before = snapshot(s)
        assert all(torch.equal(before[(b.index, "master")], s.masters[b.index]) for b in s.blocks)


def test_synchronize_waits_for_every_block():
    with make_setup() as s, running(s) as worker:
        set_grads(s, seed=3)
        gate = GatedHandle()
        done = threading.Event()
        syncer = threading.Thread(target=lambda: (worker.synchronize(1), done.set()))
        try:
            for index in range(4):
                worker.submit(job(s, index, 1))
            worker.submit(job(s, 4, 1, grad_handle=gate))
            syncer.start()
            assert gate.entered.wait(10)
            assert not done.is_set()  # block 4 is still waiting for its gradient
        finally:
            gate.complete()
        syncer.join(30)
        assert done.is_set()
        assert all(worker.is_updated(i, 1) for i in range(5))


# ---- skip / mask ---------------------------------------------------------------------------------------
def test_skip_job_changes_nothing_but_marks_updated():
    with make_setup() as s, running(s) as worker:
        grads = set_grads(s, seed=4)
        before = snapshot(s)
        for index in range(len(s.blocks)):
            worker.submit(job(s, index, 1, skip=True, grad_multiplier=torch.tensor(0.5)))
        worker.synchronize(1)
        assert all(worker.is_updated(i, 1) for i in range(len(s.blocks)))
        assert snapshot(s).keys() == before.keys()
        for key, value in snapshot(s).items():
            assert torch.equal(value, before[key]), key
        for block in s.blocks:
            assert all(float(t) == 0.0 for t in worker.param_steps[block.index])
            # The gradient was not even scaled.
            assert torch.equal(s.store.tensor(block.key("grad"), TierName.HOST), grads[block.index])
        assert worker.stats.jobs == len(s.blocks)


def test_mask_excludes_parameters_from_the_update_and_their_step_count():
    with make_setup() as s, running(s) as worker:
        index = 2  # a layer block: lin.weight, lin.bias, norm.weight, norm.bias
        block = s.blocks[index]
        assert len(block.slots) == 4
        ref = Reference(s)
        mask = [True, False, True, False]
        grads = set_grads(s, seed=5)
        worker.submit(job(s, index, 1, mask=mask))
        worker.synchronize(0)
        worker.wait_updated(index, 1)
        ref.step({index: grads[index]}, {index: mask})
        assert [float(t) for t in worker.param_steps[index]] == [1.0, 0.0, 1.0, 0.0]
        for kind in KINDS:
            got = split_views(host_state(s, index, kind), sizes(block))
            initial = split_views(s.masters[index] if kind == "master" else torch.zeros(block.numel), sizes(block))
            expected = split_views(ref.flat(index, kind), sizes(block))
            for i, keep in enumerate(mask):
                assert torch.equal(got[i], expected[i]), (kind, i)
                assert torch.equal(got[i], initial[i]) != keep, (kind, i)  # updated iff kept
        # Next step with every parameter: each keeps its own step count, still exact.
        grads = set_grads(s, seed=6)
        worker.submit(job(s, index, 2))
        worker.wait_updated(index, 2)
        ref.step({index: grads[index]})
        assert [float(t) for t in worker.param_steps[index]] == [2.0, 1.0, 2.0, 1.0]
        for kind in KINDS:
            assert torch.equal(host_state(s, index, kind), ref.flat(index, kind)), kind


# ---- failures and callbacks ----------------------------------------------------------------------------
def test_a_failing_job_surfaces_as_runtime_error_from_wait_updated():
    with make_setup() as s, running(s) as worker:
        failed = Handle("d2h", "block0.grad", "gpu", "host", 0, None)
        failed._fail(ValueError("boom: the gradient copy failed"))
        worker.submit(job(s, 0, 1, grad_handle=failed))
        with pytest.raises(RuntimeError, match="optimizer worker failed") as info:
            worker.wait_updated(0, 1)
        assert isinstance(info.value.__cause__, ValueError)
        assert not worker.is_updated(0, 1)
        with pytest.raises(RuntimeError, match="optimizer worker failed"):
            worker.wait_updated(1, 1)  # any later wait fails too, instead of hanging
        with pytest.raises(RuntimeError, match="optimizer worker failed"):
            worker.submit(job(s, 1, 1))
        assert torch.equal(host_state(s, 0, "master"), s.masters[0])


def test_on_updated_is_called_once_per_job_after_the_mark():
    with make_setup() as s:
        set_grads(s, seed=7)
        calls: list[tuple[int, bool]] = []
        with running(s) as worker:
            worker.on_updated = lambda i: calls.append((i, worker.is_updated(i, 1)))
            for index in (3, 1, 4, 0, 2):
                worker.submit(job(s, index, 1))
        # close() finished the queue: every callback has run, each after its block's mark.
        assert sorted(calls) == [(i, True) for i in range(5)]


# ---- where the weights come from ----------------------------------------------------------------------
def test_weights_source_host_copy_is_refreshed_from_the_new_master():
    with make_setup(compute_dtype=torch.bfloat16, source=WeightSource.WEIGHTS) as s, running(s) as worker:
        set_grads(s, seed=8)
        for index in range(len(s.blocks)):
            worker.submit(job(s, index, 1))
        worker.synchronize(1)
        for block in s.blocks:
            master = host_state(s, block.index, "master")
            assert not torch.equal(master, s.masters[block.index])
            assert torch.equal(s.store.tensor(block.key("weights"), TierName.HOST), master.to(torch.bfloat16))
        s.weights.wait(1)
        assert torch.equal(s.weights.states[1].flat, host_state(s, 1, "master").to(torch.bfloat16))


def test_resident_weights_are_refreshed_after_each_update():
    with make_setup(compute_dtype=torch.bfloat16, source=WeightSource.RESIDENT) as s, running(s) as worker:
        for step in (1, 2):
            set_grads(s, seed=10 + step)
            for index in range(len(s.blocks)):
                worker.submit(job(s, index, step))
            worker.synchronize(step)
            for block in s.blocks:
                assert torch.equal(s.weights.states[block.index].flat, host_state(s, block.index, "master").to(torch.bfloat16))


# ---- NVMe homes ----------------------------------------------------------------------------------------
def test_nvme_home_states_are_read_updated_and_written_back(tmpfs_dir):
    homes = {kind: TierName.NVME for kind in KINDS}
    with make_setup(homes=homes, nvme_path=str(tmpfs_dir)) as s:
        events = []
        lock = threading.Lock()

        def listen(event) -> None:  # noqa: ANN001
            with lock:
                events.append(event)

        s.store.bus.subscribe(listen)
        host = s.store.tiers[TierName.HOST]
        host_baseline = host.used_nbytes  # the gradients
        ref = Reference(s)
        with running(s) as worker:
            for step in (1, 2):
                grads = set_grads(s, seed=20 + step)
                for index in range(len(s.blocks)):
                    worker.submit(job(s, index, step))
                worker.synchronize(step)
                ref.step(grads)
                for block in s.blocks:
                    for kind in KINDS:
                        key = block.key(kind)
                        # Written back and released from host: NVMe holds the only, current copy.
                        assert s.store.state(key, TierName.HOST) is CopyState.ABSENT
                        assert s.store.state(key, TierName.NVME).is_current
                        with lock:
                            writes = [e for e in events if e.kind == "write" and e.key == key]
                            reads = [e for e in events if e.kind == "read" and e.key == key]
                        assert [e.nbytes for e in writes] == [4 * block.numel] * step
                        assert [e.nbytes for e in reads] == [4 * block.numel] * step
                assert host.used_nbytes == host_baseline  # no staging copy left behind
        # What NVMe holds is the exact AdamW result after both steps.
        for block in s.blocks:
            for kind in KINDS:
                assert torch.equal(host_state(s, block.index, kind), ref.flat(block.index, kind)), (block.name, kind)


def test_stage_starts_reading_nvme_state_to_host(tmpfs_dir):
    homes = {kind: TierName.NVME for kind in KINDS}
    with make_setup(homes=homes, nvme_path=str(tmpfs_dir)) as s, running(s) as worker:
        block = s.blocks[1]
        assert all(s.store.state(block.key(k), TierName.HOST) is CopyState.ABSENT for k in KINDS)
        worker.stage(block)
        for kind in KINDS:  # reads issued (in flight or landed) by stage() alone
            assert s.store.state(block.key(kind), TierName.HOST) in (CopyState.LOADING, CopyState.CLEAN)
        for kind in KINDS:
            s.store.fetch(block.key(kind), TierName.HOST).wait()  # the handle of the read in flight
            assert s.store.state(block.key(kind), TierName.HOST).is_current
        assert torch.equal(s.store.tensor(block.key("master"), TierName.HOST), s.masters[1])
        assert all(s.store.state(b.key("master"), TierName.HOST) is CopyState.ABSENT for b in s.blocks if b is not block)



def test_a_job_whose_state_was_read_from_nvme_runs_before_earlier_blocks(tmpfs_dir):
    """Blocks 0-2's moments in host memory, 3-4's on NVMe (spilled): a queued job whose state already landed in
    host memory (read early) runs before the lower-index ready jobs, so its write-back frees the room the other
    blocks' reads need."""
    homes = {kind: TierName.NVME for kind in ("exp_avg", "exp_avg_sq")}
    with make_setup(homes=homes, nvme_path=str(tmpfs_dir)) as s, running(s, record_intervals=True) as worker:
        for block in s.blocks[:3]:
            for kind in ("exp_avg", "exp_avg_sq"):
                s.store.move_home(block.key(kind), TierName.HOST)
        set_grads(s, seed=4)
        gate = GatedHandle()
        try:
            worker.submit(job(s, 4, 1, grad_handle=gate))
            assert gate.entered.wait(10)  # the worker holds block 4, its state already staged at its start
            worker.stage(s.blocks[3])
            for kind in ("exp_avg", "exp_avg_sq"):
                s.store.fetch(s.blocks[3].key(kind), TierName.HOST).wait()  # block 3's read landed
            for index in (0, 1, 2, 3):
                worker.submit(job(s, index, 1))
        finally:
            gate.complete()
        worker.synchronize(1)
        assert [index for index, _, _, _ in worker.stats.intervals] == [4, 3, 0, 1, 2]


def hold_on_block_4_then_queue(s: Setup, worker: UpdateWorker, indices: tuple[int, ...]) -> tuple[GatedHandle, list[GatedHandle]]:
    """The worker held on block 4's step-1 job (its gradient gated), then step-1 jobs of ``indices`` queued, each
    with its own gate: complete them all (finally) to let the worker go."""
    first, gates = GatedHandle(), [GatedHandle() for _ in indices]
    worker.submit(job(s, 4, 1, grad_handle=first))
    assert first.entered.wait(10)
    for index, gate in zip(indices, gates, strict=True):
        worker.submit(job(s, index, 1, grad_handle=gate))
    return first, gates


def test_staging_reaches_past_the_lookahead_to_every_queued_job_on_nvme(tmpfs_dir):
    """At a job's start the worker issues the NVMe reads of every queued job whose state lives there (room
    permitting), not only of the next ``lookahead``: a spilled block's read no longer waits until its job is
    among the next few."""
    homes = {kind: TierName.NVME for kind in ("exp_avg", "exp_avg_sq")}
    with make_setup(homes=homes, nvme_path=str(tmpfs_dir)) as s, running(s, lookahead=1) as worker:
        set_grads(s, seed=5)
        first, gates = hold_on_block_4_then_queue(s, worker, (0, 1, 2, 3))
        try:
            first.complete()
            assert gates[0].entered.wait(10)  # block 0's job started (its staging issued) and waits for its gradient
            for block in s.blocks[1:4]:  # one look-ahead job, and the two past it
                for kind in ("exp_avg", "exp_avg_sq"):
                    assert s.store.state(block.key(kind), TierName.HOST) is not CopyState.ABSENT, (block.name, kind)
        finally:
            first.complete()
            for gate in gates:
                gate.complete()
        worker.synchronize(1)


def test_with_no_write_back_to_wait_for_the_last_queued_job_gives_its_read_ahead_back(tmpfs_dir):
    """The worker's way out when the running job finds no host room and no write-back will free any: the state
    read ahead for the queued job that runs last is released (a clean copy, read again when that job runs)."""
    homes = {kind: TierName.NVME for kind in ("exp_avg", "exp_avg_sq")}
    with make_setup(homes=homes, nvme_path=str(tmpfs_dir)) as s, running(s, lookahead=0) as worker:
        set_grads(s, seed=6)
        first, gates = hold_on_block_4_then_queue(s, worker, (1, 2, 3))
        try:
            for index in (2, 3):
                worker.stage(s.blocks[index])
                for kind in ("exp_avg", "exp_avg_sq"):
                    s.store.fetch(s.blocks[index].key(kind), TierName.HOST).wait()
            assert worker._give_back_read_ahead()
            state = {index: s.store.state(s.blocks[index].key("exp_avg"), TierName.HOST) for index in (1, 2, 3)}
            assert state == {1: CopyState.ABSENT, 2: CopyState.CLEAN, 3: CopyState.ABSENT}  # block 3 runs last
            assert worker._give_back_read_ahead() and worker._give_back_read_ahead() is False
        finally:
            first.complete()
            for gate in gates:
                gate.complete()
        for index in (1, 2, 3, 4):  # block 0 has no job
            worker.wait_updated(index, 1)

# ---- updates before the commit (runtime.update.speculation) ------------------------------------------------------
def wait_phase(job_: UpdateJob, phase: JobPhase, timeout_s: float = 10.0) -> None:
    deadline = time.perf_counter() + timeout_s
    while job_.phase is not phase:
        assert time.perf_counter() < deadline, f"job stuck in {job_.phase}"
        time.sleep(0.001)


def speculative(s: Setup, worker: UpdateWorker, index: int, step: int, **kwargs) -> UpdateJob:
    assert worker.spares.can_speculate(s.blocks[index])
    return job(s, index, step, speculative=True, **kwargs)


def ordinary(spec: UpdateJob, **changes) -> UpdateJob:
    return dataclasses.replace(spec, speculative=False, phase=JobPhase.QUEUED, verdict=None, **changes)


@pytest.mark.parametrize("holds", [True, False])
def test_a_speculative_update_leaves_the_state_until_the_verdict(holds):
    with make_setup() as s, running(s) as worker:
        ref = Reference(s)
        grads = set_grads(s, seed=1)
        before = snapshot(s)
        spec = speculative(s, worker, 2, 1)
        worker.submit(spec)
        wait_phase(spec, JobPhase.SPECULATED)
        assert all(torch.equal(before[k], v) for k, v in snapshot(s).items())
        assert not worker.is_updated(2, 1)
        multiplier = None if holds else torch.tensor(0.25)
        worker.resolve(spec, holds, ordinary(spec, grad_multiplier=multiplier))
        worker.wait_updated(2, 1)
        ref.step({2: grads[2] * (1.0 if holds else 0.25)})
        for kind in KINDS:
            assert torch.equal(host_state(s, 2, kind), ref.flat(2, kind)), kind
        assert [float(t) for t in worker.param_steps[2]] == [1.0] * len(s.blocks[2].slots)
        assert (worker.stats.published, worker.stats.redone) == ((1, 0) if holds else (0, 1))


def test_a_verdict_that_comes_while_the_speculative_run_is_running_applies_when_it_ends():
    with make_setup() as s, running(s) as worker:
        ref = Reference(s)
        grads = set_grads(s, seed=2)
        gate = GatedHandle()
        spec = speculative(s, worker, 1, 1, grad_handle=gate)
        worker.submit(spec)
        assert gate.entered.wait(10)
        assert spec.phase is JobPhase.RUNNING
        worker.resolve(spec, True, ordinary(spec))
        gate.complete()
        worker.wait_updated(1, 1)
        ref.step({1: grads[1]})
        assert torch.equal(host_state(s, 1, "master"), ref.flat(1, "master"))
        assert worker.stats.published == 1


def test_a_verdict_on_a_job_still_queued_runs_the_ordinary_update_in_its_place():
    with make_setup() as s, running(s) as worker:
        ref = Reference(s)
        grads = set_grads(s, seed=3)
        blocker_gate, spec_gate = GatedHandle(), GatedHandle()
        worker.submit(job(s, 0, 1, grad_handle=blocker_gate))  # the oldest: the worker waits on it first
        assert blocker_gate.entered.wait(10)
        spec = speculative(s, worker, 3, 1, grad_handle=spec_gate)
        worker.submit(spec)
        worker.resolve(spec, False, ordinary(spec, grad_multiplier=torch.tensor(0.5)))
        assert spec.phase is JobPhase.WITHDRAWN
        blocker_gate.complete()
        spec_gate.complete()
        worker.wait_updated(0, 1)
        worker.wait_updated(3, 1)
        ref.step({0: grads[0], 3: grads[3] * 0.5})
        for index in (0, 3):
            assert torch.equal(host_state(s, index, "master"), ref.flat(index, "master"))
        assert (worker.stats.published, worker.stats.redone) == (0, 0)  # the early run never happened


def test_a_discarded_speculative_update_changes_nothing():
    with make_setup() as s, running(s) as worker:
        set_grads(s, seed=4)
        before = snapshot(s)
        spec = speculative(s, worker, 4, 1)
        worker.submit(spec)
        wait_phase(spec, JobPhase.SPECULATED)
        worker.resolve(spec, False, None)
        worker.submit(job(s, 0, 1))  # the worker goes on with other work
        worker.wait_updated(0, 1)
        assert not worker.is_updated(4, 1)
        after = snapshot(s)
        for kind in KINDS:
            assert torch.equal(after[(4, kind)], before[(4, kind)])
        assert [float(t) for t in worker.param_steps[4]] == [0.0] * len(s.blocks[4].slots)


def test_a_published_speculative_update_keeps_the_state_of_parameters_without_a_gradient():
    with make_setup() as s, running(s) as worker:
        index = next(b.index for b in s.blocks if len(b.slots) > 1)
        slots = len(s.blocks[index].slots)
        mask = [position != 0 for position in range(slots)]  # the first parameter got no gradient
        ref = Reference(s)
        for step in (1, 2):  # the second run writes into the buffers the first one left behind
            grads = set_grads(s, seed=10 + step)
            spec = speculative(s, worker, index, step, mask=mask)
            worker.submit(spec)
            wait_phase(spec, JobPhase.SPECULATED)
            worker.resolve(spec, True, ordinary(spec))
            worker.wait_updated(index, step)
            ref.step({index: grads[index]}, masks={index: mask})
            for kind in KINDS:
                got, want = host_state(s, index, kind), ref.flat(index, kind)
                assert torch.equal(got, want), (step, kind)


def test_drain_waits_for_the_queued_and_running_updates_only() -> None:
    """discard_pending's wait: returns once every queued job has run, without waiting for steps never submitted."""
    import threading
    import time as _time

    from runtime.update.worker import UpdateWorker

    worker = UpdateWorker.__new__(UpdateWorker)  # the queue machinery alone, no store
    worker._cond = threading.Condition()
    worker._jobs, worker._running, worker._error, worker._stopping, worker._writebacks = [], False, None, False, []
    worker._jobs.append(("queued",))
    finished = threading.Event()

    def run_it() -> None:
        _time.sleep(0.2)
        with worker._cond:
            worker._jobs.clear()
            worker._running = True
        _time.sleep(0.2)
        with worker._cond:
            finished.set()  # the job's work is done before it stops counting as running
            worker._running = False
            worker._cond.notify_all()

    from tierstore.transfer import done_handle

    written = done_handle("block0.exp_avg", "nvme")
    worker._writebacks = [written]
    threading.Thread(target=run_it).start()
    worker.drain()
    assert finished.is_set()
    assert worker._writebacks == [written]  # left for synchronize(), which raises a failed one's error


def test_a_wait_for_an_update_that_was_never_queued_ends_with_an_error_once_the_worker_is_stopped():
    """A training thread still waiting when the session closes under it (interpreter exit) gets an error that
    says why, not a wait that never ends; updates queued before the close still run."""
    with make_setup() as s:
        worker = UpdateWorker(s.blocks, s.store, HYPER, s.weights)
        set_grads(s, seed=1)
        worker.submit(job(s, 0, 1))
        waited: list[BaseException | float] = []
        waiter = threading.Thread(target=lambda: waited.append(_wait_or_error(worker, 1, 1)), daemon=True)
        waiter.start()
        worker.close()
        waiter.join(timeout=10)
        assert not waiter.is_alive(), "the wait outlived the worker"
        assert worker.updated_step(0) == 1  # the queued update ran before the thread stopped
        assert isinstance(waited[0], RuntimeError) and "block 1 was updated to step 1" in str(waited[0])


def _wait_or_error(worker: UpdateWorker, index: int, step: int) -> BaseException | float:
    try:
        return worker.wait_updated(index, step)
    except BaseException as exc:  # noqa: BLE001  (the test inspects it)
        return exc
