"""The update pipeline: block gradients on host -> CPU AdamW -> updated weights, on a worker thread.

The autograd thread submits a job as soon as a block's gradient has been copied off the GPU (the job carries
the copy's handle: the buffer and the event that guards it travel together). The worker waits for that copy,
brings the block's fp32 master and moments to host memory (reading them from NVMe when they live there,
issued ahead for queued jobs), runs fused AdamW, writes back what lives on NVMe, refreshes the block's
compute weights where they come from, and marks the block updated at step t. The next forward waits for that
mark for the blocks it needs, and for nothing else.

Jobs are taken by priority: lowest step, then lowest block index -- the block the next forward needs first --
except that a ready job whose state was read from NVMe into host memory goes first: its write-back frees the
staging room the other spilled blocks' reads wait for.
In *streaming* mode jobs are submitted as gradients arrive and overlap backward; whatever is left when
backward ends runs in forward order, so the next forward starts while later blocks still update. In
*deferred* mode (the update needs the whole gradient first: global-norm clipping or fp16 overflow checks)
every job is submitted at the end of backward, and runs in forward order (its gradient, when it waited on the
device for the commit, already scaled there and on its way: [Note: held gradients] in ``runtime.engine.held_grads``),
except the *speculative* jobs of host-updated blocks: they run as gradients land, out of place, and the commit
publishes or redoes them (see [Note: speculative updates] in ``runtime.update.speculation``).
"""

from __future__ import annotations

import dataclasses
import enum
import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from runtime.core.blocks import Block
from runtime.planning.memory_plan import STATE_KINDS, WeightSource
from runtime.update.adam import AdamWHyper, scale_slots
from runtime.update.collaborators import ComputeWeights
from runtime.update.moment_kernel import Int8Kernel
from runtime.update.moments import MomentScratch, adamw_update_block, kept_entries
from runtime.update.speculation import SpareBuffers
from tierstore import CapacityError, CopyState, Handle, TierName, TierStore, close_at_exit

log = logging.getLogger(__name__)


class JobPhase(enum.Enum):
    """Where a job is: queued -> running -> done; a speculative job -> speculated (its result in the block's
    spares) until the commit's verdict, or withdrawn when the verdict came while it was still queued."""

    QUEUED = "queued"
    RUNNING = "running"
    SPECULATED = "speculated"
    DONE = "done"
    WITHDRAWN = "withdrawn"


@dataclass
class UpdateJob:
    """One block's update at one optimizer step."""

    block: Block
    grad_handle: Handle | None  # the D2H copy filling the block's host gradient
    step: int  # the optimizer step this update makes (1-based)
    hypers: list[AdamWHyper]  # per parameter of the block: its group's hyper-parameters
    grad_multiplier: torch.Tensor | None = None  # clip coefficient (0-dim fp32, CPU), applied before Adam
    slot_multipliers: list[torch.Tensor | None] | None = None  # the user's clip factor per parameter (CPU)
    skip: bool = False  # fp16 overflow: mark updated without changing anything
    mask: list[bool] | None = None  # per parameter: got a gradient (None: all did); others are not updated
    speculative: bool = False  # runs before the commit, into the block's spares (runtime.update.speculation)
    publish: bool = False  # the commit kept a speculative result: make the spares the block's state
    spec_steps: list[torch.Tensor] | None = None  # per-parameter step counters after the speculative run
    phase: JobPhase = JobPhase.QUEUED
    # The commit's verdict on a speculative job that was running when it came: (result holds, job to run instead).
    verdict: tuple[bool, UpdateJob | None] | None = None


@dataclass
class WorkerStats:
    """Timing of the worker: seconds in Adam, in waiting for its inputs, and per-job intervals."""

    adam_s: float = 0.0
    kernel_s: float = 0.0  # of adam_s, in the AdamW kernel itself, early (speculative) runs included
    scale_s: float = 0.0  # of adam_s, widening narrow host gradients to fp32 and multiplying by clip factors
    refresh_s: float = 0.0  # of adam_s, issuing (or making) the compute weights' refresh
    wait_inputs_s: float = 0.0
    jobs: int = 0
    published: int = 0  # updates run before their commit whose result the commit kept
    redone: int = 0  # updates run before their commit whose result the commit replaced (a clip below 1, ...)
    intervals: list[tuple[int, int, float, float]] = field(default_factory=list)  # (block, step, start, end)


class UpdateWorker:
    """Runs block updates on one thread (AdamW itself uses torch's intra-op thread pool)."""

    def __init__(self, blocks: list[Block], store: TierStore, hyper: AdamWHyper, weights: ComputeWeights,
                 lookahead: int = 2, record_intervals: bool = False, moment_dtype: str = "fp32",
                 int8_kernel: Int8Kernel | None = None):
        self.blocks = blocks
        self.moment_dtype = moment_dtype  # how the moments are stored (runtime.update.moments decodes and encodes)
        # This thread's fp32 pieces of compact moments, reused by every update; int8 through the compiled kernel where
        # offload() built one (optimizer.moment_kernel), before any update.
        self._moment_scratch = MomentScratch(int8_kernel=int8_kernel)
        self.store = store
        self.hyper = hyper
        self.weights = weights
        self.lookahead = lookahead
        self.record_intervals = record_intervals
        self.stats = WorkerStats()
        # One fp32 step counter per parameter, exactly as torch.optim.AdamW keeps them.
        self.param_steps: list[list[torch.Tensor]] = [[torch.zeros((), dtype=torch.float32) for _ in b.slots] for b in blocks]
        self._updated_step = [0] * len(blocks)
        self._cond = threading.Condition()
        self._jobs: list[tuple[int, int, int, UpdateJob]] = []  # heap of (step, block index, seq, job)
        self._sequence = itertools.count()
        self._stopping = False
        self._running = False  # a job taken from the queue has not finished (drain() waits for it)
        self._writebacks: list[Handle] = []  # evictions to NVMe still in flight
        self.on_updated: Callable[[int], None] | None = None  # called in this thread after each update
        self._error: BaseException | None = None
        self._refresh_staging: torch.Tensor | None = None
        self._widened: torch.Tensor | None = None  # fp32 copy of a narrower host gradient (_fp32_grad)
        self.spares = SpareBuffers(store)
        if weights.source is WeightSource.RESIDENT and store.device.type == "cuda":
            largest = max((b.numel for b in blocks), default=0)
            with torch.cuda.stream(store.engine.h2d_stream):
                self._refresh_staging = torch.empty(largest, dtype=torch.float32, device=store.device)
        self._thread = threading.Thread(target=self._run, name="tierstore-adam", daemon=True)
        self._thread.start()
        close_at_exit(self, UpdateWorker.close)  # stopped before the store it writes to (registered earlier)

    # ---- producer side -------------------------------------------------------------------------------
    def submit(self, job: UpdateJob) -> None:
        """Queue one block's update."""
        self._raise_if_failed()
        with self._cond:
            heapq.heappush(self._jobs, (job.step, job.block.index, next(self._sequence), job))
            self._cond.notify_all()

    def resolve(self, job: UpdateJob, holds: bool, redo: UpdateJob | None) -> None:
        """The commit's verdict on a speculative job: its result ``holds`` (it is published), or ``redo`` runs
        instead from the untouched state; ``holds`` False and ``redo`` None drop it (a discarded step)."""
        with self._cond:
            if job.phase is JobPhase.QUEUED:  # never ran: the ordinary update runs in its place
                self._jobs = [item for item in self._jobs if item[-1] is not job]
                heapq.heapify(self._jobs)
                job.phase = JobPhase.WITHDRAWN
                follow = redo
            elif job.phase is JobPhase.RUNNING:
                job.verdict = (holds, redo)  # applied by the worker when the run ends
                return
            else:
                follow = self._publish_job(job) if holds else redo
                self.stats.redone += not holds and redo is not None
            if follow is not None:
                heapq.heappush(self._jobs, (follow.step, follow.block.index, next(self._sequence), follow))
                self._cond.notify_all()

    @staticmethod
    def _publish_job(job: UpdateJob) -> UpdateJob:
        return dataclasses.replace(job, speculative=False, publish=True, phase=JobPhase.QUEUED, verdict=None)

    def stage(self, block: Block, kinds: tuple[str, ...] = STATE_KINDS) -> tuple[bool, bool]:
        """Start bringing block's optimizer state (``kinds`` of it) to host early (e.g. when its backward begins).
        Returns whether a read from NVMe started now, and whether the state is (or will be) on host: False when the
        host staging room is full."""
        return self._issue_staging(block, kinds)

    # ---- consumer side -------------------------------------------------------------------------------
    def is_updated(self, index: int, step: int) -> bool:
        """True when block index has been updated to optimizer step ``step``."""
        return self._updated_step[index] >= step

    def wait_updated(self, index: int, step: int) -> float:
        """Block until block index is updated to ``step``; returns the seconds waited."""
        if self._updated_step[index] >= step:
            return 0.0
        start = time.perf_counter()
        with self._cond:
            while self._updated_step[index] < step and self._error is None and not self._stopped():
                self._cond.wait(timeout=1.0)
        self._raise_if_failed()
        if self._updated_step[index] < step:  # closed (by close() or at interpreter exit) with the update never queued
            raise RuntimeError(f"the update worker was stopped (the session was closed) before block {index} was "
                               f"updated to step {step}: nothing will update it now")
        return time.perf_counter() - start

    @property
    def error(self) -> BaseException | None:
        """What stopped the thread (an update that failed), or None while it runs."""
        return self._error

    def _stopped(self) -> bool:
        """Whether the thread has finished stopping (close() lets it run the jobs queued before it ends)."""
        return self._stopping and not self._thread.is_alive()

    def drain(self) -> None:
        """Wait until no update is queued or running and the NVMe write-backs they started have landed (a failed
        worker or a stopping one ends the wait; its error surfaces at the next submit). The write-backs stay
        listed: a failed one still raises at ``synchronize``."""
        with self._cond:
            while (self._jobs or self._running) and self._error is None and not self._stopping:
                self._cond.wait(0.1)
            writebacks = list(self._writebacks)
        for handle in writebacks:
            handle._wait_complete()

    def synchronize(self, step: int) -> None:
        """Block until every block is updated to ``step`` and every write-back to NVMe has landed."""
        for index in range(len(self.blocks)):
            self.wait_updated(index, step)
        with self._cond:
            writebacks, self._writebacks = self._writebacks, []
        for handle in writebacks:
            handle.wait()

    def updated_step(self, index: int) -> int:
        """The last step block index was updated to."""
        return self._updated_step[index]

    def mark_updated(self, index: int, step: int) -> None:
        """Record that block index was updated to ``step`` by someone else (the device-side optimizer)."""
        with self._cond:
            self._updated_step[index] = max(self._updated_step[index], step)
            self._cond.notify_all()

    def set_updated_step(self, step: int) -> None:
        """Mark every block as updated to ``step`` (after loading a checkpoint)."""
        with self._cond:
            self._updated_step = [step] * len(self.blocks)
            self._cond.notify_all()

    def close(self) -> None:
        """Finish queued jobs and stop the thread."""
        if self._thread.is_alive():
            with self._cond:
                self._stopping = True
                self._cond.notify_all()
            self._thread.join()
        if not self.store.closed:
            self.spares.close()

    # ---- the thread ----------------------------------------------------------------------------------
    def _next_job(self) -> UpdateJob | None:
        """The job to run next: among jobs whose gradient has landed on host, one whose NVMe state has landed in
        host memory, else the one the next forward needs first (lowest step, then lowest block index); when none
        has landed, the oldest, whose copy the
        in-order D2H stream finishes first. So the worker never idles on one copy while another block's
        gradient is ready, and whatever is left when backward ends runs in forward order."""
        with self._cond:
            while not self._jobs and not self._stopping:
                self._cond.wait()
            if not self._jobs:
                return None
            candidates = sorted(self._jobs)
        # done() may publish transfer events to listeners: never call it holding the lock.
        ready = [item for item in candidates if item[-1].grad_handle is None or item[-1].grad_handle.done()]
        # Of the first step's ready jobs, one whose state from NVMe is already in host memory goes first: its
        # write-back frees the staging room the other spilled blocks' reads wait for. In forward order those
        # waited behind every block held in memory (the 8B scenario's first 19, 1.3 s of CPU AdamW after the
        # commit) while the next forward, past them, waited for the disk.
        landed = [item for item in ready if item[0] == ready[0][0] and self._disk_state_landed(item[-1].block)]
        chosen = landed[0] if landed else ready[0] if ready else min(candidates, key=lambda item: item[2])
        if self._state_on_disk(chosen[-1].block, staged=False):
            # Its state needs host room that the state already read for other jobs (look-ahead, early reads) may
            # hold until they run: run one of those first, or this thread would wait for room only it can free.
            # One whose state is all read (or being read) first: a part-read one needs more room still.
            holding = [item for item in candidates if self._state_on_disk(item[-1].block, staged=True)]
            whole = [item for item in holding if not self._state_on_disk(item[-1].block, staged=False)]
            chosen = whole[0] if whole else holding[0] if holding else chosen
        with self._cond:
            if chosen not in self._jobs:  # withdrawn by a verdict meanwhile
                return self._next_job()
            self._jobs.remove(chosen)
            heapq.heapify(self._jobs)
            chosen[-1].phase = JobPhase.RUNNING
            self._running = True
        return chosen[-1]

    def _disk_state_landed(self, block: Block) -> bool:
        """Whether some of block's state lives on NVMe and all of that has a current copy in host memory (read
        early or ahead, the read landed)."""
        on_disk = False
        if not self._holds_state(block):
            return False
        for kind in STATE_KINDS:
            key = block.key(kind)
            if self.store.record(key).home is TierName.NVME:
                if not self.store.state(key, TierName.HOST).is_current:
                    return False
                if self.store.state(key, TierName.NVME) is CopyState.LOADING:
                    return False  # its last update's write-back is still in flight: the job would wait for it
                on_disk = True
        return on_disk

    def _state_on_disk(self, block: Block, staged: bool) -> bool:
        """Whether some of block's state lives on NVMe with (``staged``) or without a copy in host memory."""
        if not self._holds_state(block):
            return False
        for kind in STATE_KINDS:
            key = block.key(kind)
            if self.store.record(key).home is TierName.NVME:
                if (self.store.state(key, TierName.HOST) is not CopyState.ABSENT) == staged:
                    return True
        return False

    def _run(self) -> None:
        while True:
            job: UpdateJob | None = None
            try:  # choosing the next job can fail too (a store lookup): that must reach the training thread as well
                job = self._next_job()
                if job is None:
                    return
                self._fill_lookahead(job)
                self._run_job(job)
                with self._cond:
                    self._running = False
                    self._cond.notify_all()
            except BaseException as exc:  # surfaced to the training thread at its next wait
                log.exception("update of %s failed", job.block.name if job is not None else "the next block")
                with self._cond:
                    self._error = exc
                    self._cond.notify_all()
                return

    def _fill_lookahead(self, running: UpdateJob) -> None:
        """Start staging (NVMe reads) of the ``running`` job's state, then of the next ``lookahead`` queued jobs',
        then of every other queued job whose state lives on NVMe, in priority order, while the host staging room
        takes them: a spilled block's read need not wait until its job is among the next few (after the commit
        of the 8B scenario, behind 19 updates of blocks held in memory). The running job's own state goes first:
        room taken by queued jobs that cannot run before it would never come back to it."""
        if not (running.skip or running.publish) and not self._issue_staging(running.block)[1]:
            return  # no room even for the running job: it waits for write-backs, and nothing is read for later
        with self._cond:
            queued = [item[-1] for item in sorted(self._jobs) if not (item[-1].skip or item[-1].publish)]
        for position, job in enumerate(queued):
            if position >= self.lookahead and not self._state_on_disk(job.block, staged=False):
                continue
            if not self._issue_staging(job.block)[1]:
                return  # the room is full: stop, so that at most one job holds part of its state; the next start asks again

    def _issue_staging(self, block: Block, kinds: tuple[str, ...] = STATE_KINDS) -> tuple[bool, bool]:
        started = False
        if not self._holds_state(block):
            return started, True
        for kind in kinds:
            key = block.key(kind)
            absent = self.store.state(key, TierName.HOST) is CopyState.ABSENT
            try:
                self.store.fetch(key, TierName.HOST)
                started |= absent
            except CapacityError:
                return started, False  # host staging room is full: the job fetches when it runs
        return started, True

    def _run_job(self, job: UpdateJob) -> None:
        if job.publish:
            self._publish(job)
            return
        block, index = job.block, job.block.index
        start = time.perf_counter()
        if job.grad_handle is not None:
            job.grad_handle.wait()
        if job.skip:  # nothing changes: state read ahead for it (look-ahead, early reads) gives its room back
            self._release_read_ahead(block)
            skip_start = time.perf_counter()
            self.stats.wait_inputs_s += skip_start - start
            self._count(job, skip_start)
            self._finish(job)
            return
        host = {kind: self._host_tensor(block.key(kind)) for kind in STATE_KINDS}
        grad = self.store.tensor(block.key("grad"), TierName.HOST)  # waits for its copy to land: an input
        adam_start = time.perf_counter()
        self.stats.wait_inputs_s += adam_start - start
        grad = self._fp32_grad(grad)
        if job.speculative:
            self._speculate(job, host, grad)
            self._count(job, adam_start)
            return
        # A clip coefficient of exactly 1 (the clip did not bind) changes no bit: skip its pass over the gradient.
        multiplier = job.grad_multiplier
        scale_slots(grad, block, job.slot_multipliers, None if multiplier is None or float(multiplier) == 1.0 else multiplier)
        self.stats.scale_s += time.perf_counter() - adam_start
        sizes = [slot.numel for slot in block.slots]
        keep = job.mask or [True] * len(sizes)
        kernel_start = time.perf_counter()
        adamw_update_block(host["master"], grad, host["exp_avg"], host["exp_avg_sq"], sizes, keep,
                           kept_entries(self.param_steps[index], keep), kept_entries(job.hypers, keep), self.moment_dtype,
                           scratch=self._moment_scratch, rounding_seed=index)  # a block's own bits (bf16 rounding)
        self.stats.kernel_s += time.perf_counter() - kernel_start
        for kind in STATE_KINDS:
            self.store.mark_dirty(block.key(kind), TierName.HOST, step=job.step)
        refresh_start = time.perf_counter()
        refresh = self._refresh_weights(block, host["master"], job.step)
        self.stats.refresh_s += time.perf_counter() - refresh_start
        for kind in STATE_KINDS:
            if self.store.record(block.key(kind)).home is TierName.NVME:
                if kind == "master" and refresh is not None:
                    refresh.wait()  # the H2D still reads the host copy the eviction will free
                handle = self.store.evict(block.key(kind), TierName.HOST)  # written back, then released
                with self._cond:
                    pending = list(self._writebacks)
                # done() may run the transfers' completion callbacks, which take the store's lock: not under _cond,
                # which the training thread's submit() and waits take.
                landed = {id(h) for h in pending if h.done()}
                with self._cond:
                    self._writebacks = [h for h in self._writebacks if id(h) not in landed] + [handle]
        self._count(job, adam_start)
        self._finish(job)

    def _fp32_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """The block's host gradient in fp32, what the clip's multiply and AdamW take: itself, or one narrower
        (``optimizer.host_grad_dtype: compute``) widened into a buffer of this thread's that grows to the largest
        block (pageable: only the CPU reads it). Widening is exact, and the host gradient keeps its bits (an update
        done again after the commit widens it again)."""
        if grad.dtype == torch.float32:
            return grad
        if self._widened is None or self._widened.numel() < grad.numel():
            self._widened = None  # the old one goes before the larger one is taken
            self._widened = torch.empty(grad.numel(), dtype=torch.float32)
        widened = self._widened[: grad.numel()]
        with torch.profiler.record_function("tierstore.widen_host_grad"):
            widened.copy_(grad)  # counted with the clip's multiply (scale_s) or, for an early update, in adam_s
        return widened

    def _holds_state(self, block: Block) -> bool:
        """Whether this process keeps block's state: not where another rank owns it ([Note: block ownership] in
        runtime.planning.ownership), whose skip jobs only keep the count of its updates."""
        return self.store.has(block.key("master"))

    def _release_read_ahead(self, block: Block) -> None:
        if not self._holds_state(block):
            return
        for kind in STATE_KINDS:
            if self.store.record(block.key(kind)).home is TierName.NVME:
                self.store.release_read_ahead(block.key(kind), TierName.HOST)

    def _speculate(self, job: UpdateJob, host: dict[str, torch.Tensor], grad: torch.Tensor) -> None:
        """AdamW into the block's spares with the gradient as backward left it; the store's state is untouched.
        Ends in the commit's verdict when it came meanwhile, else waits for it (phase SPECULATED)."""
        block = job.block
        sizes = [slot.numel for slot in block.slots]
        keep = job.mask or [True] * len(sizes)
        targets = self.spares.targets(block)
        job.spec_steps = [s.clone() for s in self.param_steps[block.index]]
        kernel_start = time.perf_counter()
        # The spares replace whole buffers: the update leaves parameters without a gradient as they were there too.
        adamw_update_block(host["master"], grad, host["exp_avg"], host["exp_avg_sq"], sizes, keep,
                           kept_entries(job.spec_steps, keep), kept_entries(job.hypers, keep), self.moment_dtype,
                           out=(targets["master"], targets["exp_avg"], targets["exp_avg_sq"]), scratch=self._moment_scratch,
                           rounding_seed=block.index)  # as the update at the commit: an early result is the same bits
        self.stats.kernel_s += time.perf_counter() - kernel_start  # an early update's kernel is the kernel too
        with self._cond:
            job.phase = JobPhase.SPECULATED
            verdict, job.verdict = job.verdict, None
        if verdict is not None:
            self.resolve(job, *verdict)

    def _publish(self, job: UpdateJob) -> None:
        """The commit kept a speculative result: the spares become the block's state, then as after any update."""
        block, start = job.block, time.perf_counter()
        self.spares.publish(block, job.step)
        for counter, value in zip(self.param_steps[block.index], job.spec_steps or [], strict=False):
            counter.copy_(value)
        self._refresh_weights(block, self.store.tensor(block.key("master"), TierName.HOST), job.step)
        self.stats.published += 1
        self._count(job, start)
        self._finish(job)

    def _count(self, job: UpdateJob, start: float) -> None:
        end = time.perf_counter()
        self.stats.adam_s += end - start
        self.stats.jobs += 1
        if self.record_intervals:
            self.stats.intervals.append((job.block.index, job.step, start, end))

    def _finish(self, job: UpdateJob) -> None:
        """Block updated to job.step: the next forward may use it."""
        index = job.block.index
        with self._cond:
            job.phase = JobPhase.DONE
            self._updated_step[index] = max(self._updated_step[index], job.step)
            self._cond.notify_all()
        if self.on_updated is not None:
            self.on_updated(index)

    def _host_tensor(self, key: str, timeout_s: float = 120.0) -> torch.Tensor:
        deadline = time.perf_counter() + timeout_s
        self.store.wait_written(key)  # the block's last write-back: its host copy is about to change in place
        while True:
            try:
                self.store.fetch(key, TierName.HOST).wait()
                return self.store.tensor(key, TierName.HOST)
            except CapacityError as exc:
                # Staging room is taken by write-backs still in flight (they free it when they land) or by state
                # read ahead for queued jobs, which can only run after this one: with no write-back left to
                # land, give the latter's room back.
                if not self._writebacks_in_flight() and self._give_back_read_ahead():
                    continue
                if time.perf_counter() > deadline:
                    raise RuntimeError(f"no host room to stage {key} from NVMe for {timeout_s:.0f} s; raise tiers.host.budget") from exc
                time.sleep(0.001)

    def _writebacks_in_flight(self) -> bool:
        with self._cond:
            handles = list(self._writebacks)
        return any(not handle.done() for handle in handles)

    def _give_back_read_ahead(self) -> bool:
        """Release the state read ahead for the queued job that runs last; False when no queued job holds any."""
        with self._cond:
            queued = [item[-1] for item in sorted(self._jobs, reverse=True)]
        for job in queued:
            if self._state_on_disk(job.block, staged=True):
                try:
                    self._release_read_ahead(job.block)
                except RuntimeError:  # not a read-ahead (a copy still being written home): not ours to drop
                    continue
                return True
        return False

    def _refresh_weights(self, block: Block, master: torch.Tensor, step: int) -> Handle | None:
        """Bring the block's compute weights up to date with its new master; returns a copy still reading it."""
        source = self.weights.source
        if source is WeightSource.WEIGHTS:
            key = block.key("weights")
            self.store.fetch(key, TierName.HOST).wait()
            self.store.tensor(key, TierName.HOST).copy_(master)  # the one extra host pass of this mode
            self.store.mark_dirty(key, TierName.HOST, step=step)
            if self.store.record(key).home is TierName.NVME:
                self.store.evict(key, TierName.HOST, release=False)
        elif source is WeightSource.RESIDENT:
            if self._refresh_staging is not None:
                # A master whose home is NVMe is evicted right after this: its copy may not wait in a queue.
                may_hold = self.store.record(block.key("master")).home is not TierName.NVME
                return self.weights.refresh_resident(block.index, self._refresh_staging, may_hold)
            self.weights.load_resident(block.index)
        return None

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the optimizer worker failed: {self._error!r}") from self._error
