"""The processes of one training run and the collective calls between them (``torch.distributed``).

Several processes train one model (``torchrun --nproc-per-node N``, one per GPU, or N over gloo on the CPU): each
rank owns whole blocks' training state (``runtime.planning.ownership`` decides which) and the ranks exchange the
owned blocks' compute weights and gradients. This module says who this process is (``Ranks``, joining the process
group where the program did not), makes the collective calls the engine, the session and checkpoints ask for, and
gives each rank of a host its share of the cores (``bind_cores``); it decides nothing about what they carry.

[Note: collectives in program order] Every rank must issue the same collective calls in the same order, or the
run hangs (NCCL) or mixes up tensors. The engine issues them only from events every rank reaches in the same order:
a block's weights are broadcast from its owner each time a hook acquires the block (never by a prefetch, whose
timing differs between ranks, and whatever the block's residency on this rank), or started one acquire ahead for the
block the prefetch schedule's trace expects next (the trace is made of the hooks' events alone), except where the
block is held (below), a block's gradient
is reduced to its owner when its backward is done, the gradient norm is summed at the commit, and the ranks' plans
are compared once before anything is allocated. A rank whose model takes another path (a different block order)
breaks this, as it breaks DDP.

[Note: held blocks are not broadcast again] A block acquired while it is held is not broadcast: held by an earlier
acquire of a pass still going on (a forward still inside it; the backward of a block, whose recomputation then
acquires it again), or by a forward of it that ended just before, not releasing it because the trace expects it
next (a head called once a loss piece; held for that one acquire, and no longer past any point where the ranks'
paths meet: a forward's begin, a step's commit or drop: ``Fetcher.held``, ``drop_kept_for_next``). Its weights
have been on every device since the broadcast that began the hold: the releases that run while a block is held
leave it (a forward's and a backward's own, the keep-for-backward queue, a read's room-making), a release that
should not have happened is found at the acquire (a rank that finds the block gone raises, never computes), and a
block's weights change only once its gradients are done or at the commit, after its holds. The hooks and the trace
alone set the marks, so every rank skips alike. Seen on two H200s before this (the 8B scenario, micro-batches of
4 x 4096 tokens, a 1024-token loss piece): 147 broadcasts a micro-batch (1,176 acquires a step of 8), each layer's
in its forward, its backward and its recomputation, the head's once a piece in the forward and in the backward.
Held now: each layer's recomputation, and the head's pieces after the first.

[Note: no GPU collective beside a pinning] Page-locking host memory (cudaHostRegister) or giving it back can wait
for the GPUs this process reaches over NVLink, and a collective's kernel on another rank's GPU spins until this rank
joins it: a rank that pins while another already waits in a collective hangs them both (seen on two H200s: the tiny
test model's ranks, one in cudaHostRegister, the other in its first forward past its first broadcast;
pytorch/pytorch#31095 is the same with DDP's broadcast). So every rank pins at the same point and the ranks meet in
the store (``Ranks.host_barrier``, no kernel) before any collective that follows: after the store's arena at setup,
and between the profile's one-rank-at-a-time bandwidth probes.

What it leaves out: which rank owns which block (planning), when the calls are made (the engine).
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# How long a collective may wait for the other ranks before it raises (a rank that died or took another path):
# torch.distributed's default (10 minutes for NCCL, 30 for gloo) would leave the others hanging that long.
COLLECTIVE_TIMEOUT_S = float(os.environ.get("TIERSTORE_COLLECTIVE_TIMEOUT_S", "300"))


class Ranks:
    """This process's place among the run's processes: its rank, how many there are (more than one), and the device
    whose tensors the collectives take (this rank's GPU under NCCL, the CPU under gloo).

    A collective that fails (another rank died, raised, or took another path, and the timeout passed) leaves the run
    broken: every later call raises at once, naming the first failure, so that cleaning up (``close()``, which
    reads the owners' weights through collectives) ends in one timeout, not one per block."""

    def __init__(self, rank: int, world_size: int, device: torch.device, serial: int = 0):
        self.rank = rank
        self.world_size = world_size
        self.device = device
        # Which session of this process group (every rank offloads as many times, in order): the store's keys a
        # session writes carry it, so that a later session never reads an earlier one's.
        self.serial = serial
        self.broken: str | None = None  # the first collective failure, once there was one
        self._host_barriers = 0  # host_barrier's calls so far: every rank counts them alike (program order)

    def __repr__(self) -> str:
        return f"Ranks(rank={self.rank}, world_size={self.world_size}, device={self.device})"

    def call(self, what: str, call: Callable[[], object]) -> None:
        """Make one collective call (``what`` names it in errors): refused at once where an earlier one failed; a
        failure marks the run broken and raises naming the rank, the call and, where another rank said why it
        failed (``fail``), that."""
        if self.broken is not None:
            raise RuntimeError(f"rank {self.rank} of {self.world_size}: {what} not attempted, an earlier collective failed "
                               f"or this rank failed ({self.broken})")
        try:
            call()
        except Exception as error:
            causes = self._published_failures()
            self.broken = f"{what} on rank {self.rank} of {self.world_size}: {error!r}"
            because = "; ".join(causes) if causes else \
                f"another rank stopped, raised or took another path (after {COLLECTIVE_TIMEOUT_S:g} s at most: " \
                "TIERSTORE_COLLECTIVE_TIMEOUT_S)"
            raise RuntimeError(f"rank {self.rank} of {self.world_size}: {what} failed: {because} ({error})") from error

    def store(self) -> dist.Store | None:
        """The process group's key-value store (torch.distributed's rendezvous store: ``runtime.model.remote_reads``
        asks the owners of blocks through it), or None."""
        try:
            from torch.distributed.distributed_c10d import _get_default_store

            return _get_default_store()
        except Exception:
            return None

    def others_refusing(self, own: str | None, what: str = "the ranks' plans compared") -> list[tuple[int, str]]:
        """Every rank says whether it refuses to go on (``own``: why, or None); returns the other ranks' refusals
        (rank, why). Called by every rank at the same point (before anything is allocated, at the end of a save
        together), so all stop together; ``what`` names the exchange in errors."""
        said: list[str | None] = [None] * self.world_size
        self.call(what, lambda: dist.all_gather_object(said, own))
        return [(rank, why) for rank, why in enumerate(said) if why is not None and rank != self.rank]

    def fail(self, cause: str) -> None:
        """This rank is ending on an error (``close()`` during an exception): it takes part in no collective from now
        on, and says why where the other ranks' failed collectives read it (the process group's store), so their
        error names this rank and the cause. Its leaving (the process ends, its connections close) ends their
        collectives under gloo at once; under NCCL they end at the timeout."""
        if self.broken is None:
            self.broken = f"rank {self.rank} failed: {cause}"
        store = self.store()
        if store is not None:
            try:
                store.set(self.key(f"{_FAILED_KEY}{self.rank}"), cause[:2000])
            except Exception as error:  # the store's host may be gone already: the others then time out, unnamed
                log.warning("rank %d could not tell the others why it failed: %r", self.rank, error)

    def failure_of(self, rank: int) -> str | None:
        """What ``rank`` said of its failure (``fail``), or None: it did not say, or the store cannot be read."""
        store = self.store()
        key = self.key(f"{_FAILED_KEY}{rank}")
        try:
            return store.get(key).decode(errors="replace") if store is not None and store.check([key]) else None
        except Exception:  # the store's host may be the rank that died
            return None

    def _published_failures(self) -> list[str]:
        """What other ranks said of their failure (``fail``), by rank: none where the store cannot be read."""
        found = []
        for rank in range(self.world_size):
            cause = None if rank == self.rank else self.failure_of(rank)
            if cause is not None:
                found.append(f"rank {rank} failed: {cause}")
        return found

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """Make ``tensor`` on every rank equal to ``src``'s (in place; stream-ordered on a GPU). Tensors autograd
        saved views of (a block's compute weights) keep their version: the values written are the owner's same ones."""
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(tensor):
            self.call(f"a broadcast from rank {src}", lambda: dist.broadcast(tensor, src=src))

    def broadcast_async(self, tensor: torch.Tensor, src: int) -> Any:
        """``broadcast`` started now, ended by the returned work's ``wait()`` (on a GPU, the current stream then waits
        for it; on the CPU, the caller does)."""
        works: list[Any] = []
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(tensor):  # (autograd's saved views of it)
            self.call(f"a broadcast from rank {src}", lambda: works.append(dist.broadcast(tensor, src=src, async_op=True)))
        return _Work(self, works[0], f"a broadcast from rank {src}")

    def reduce_mean(self, tensor: torch.Tensor, dst: int) -> None:
        """``dst``'s ``tensor`` becomes the mean over ranks of every rank's (in place; the others' are left
        undefined). The sum is divided by the number of ranks on ``dst`` only: DDP's averaged gradient."""
        self.call(f"a reduction onto rank {dst}", lambda: dist.reduce(tensor, dst=dst, op=dist.ReduceOp.SUM))
        if self.rank == dst:
            tensor.div_(self.world_size)

    def agree_on_serial(self) -> None:
        """Every rank takes the highest of the ranks' session serial numbers (an ``offload()`` that failed on one rank
        before it joined, and was tried again, leaves them apart), so their store keys match."""
        serials: list[int] = [0] * self.world_size
        self.call("the ranks' session numbers compared", lambda: dist.all_gather_object(serials, self.serial))
        self.serial = max(serials)

    def barrier(self, what: str) -> None:
        """Return once every rank has come here (``what`` names the point in errors): this thread waits, on a GPU
        too (NCCL's calls return before the GPUs have met; ``item()`` waits for them)."""
        arrived = torch.zeros(1, device=self.device)
        self.call(what, lambda: (dist.all_reduce(arrived, op=dist.ReduceOp.SUM), arrived.item()))

    def host_barrier(self, what: str) -> None:
        """Return once every rank has come here (``what`` names the point in errors), meeting in the process group's
        store alone: no GPU kernel runs for it. Where a rank page-locks host memory or probes copies while the others
        wait ([Note: no GPU collective beside a pinning]), the waiting ranks must not sit in a collective's kernel.
        A rank that said why it failed (``fail``) ends the wait at once, naming it; one that died silently, at
        TIERSTORE_COLLECTIVE_TIMEOUT_S."""
        store = self.store()
        self._host_barriers += 1
        keys = [self.key(f"host-barrier/{self._host_barriers}/rank{rank}") for rank in range(self.world_size)]

        def meet() -> None:
            if store is None:
                raise RuntimeError("the process group has no store to meet in")
            store.set(keys[self.rank], "1")
            deadline = time.monotonic() + COLLECTIVE_TIMEOUT_S
            pause = 0.001
            while not store.check(keys):
                if self._published_failures():  # (call() names them)
                    raise RuntimeError("another rank failed")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"not every rank came within {COLLECTIVE_TIMEOUT_S:g} s")
                time.sleep(pause)
                pause = min(2 * pause, 0.005)  # a check is a local round trip: the last rank's arrival seen soon

        self.call(what, meet)

    def key(self, name: str) -> str:
        """A key of this session in the process group's store."""
        return f"tierstore/s{self.serial}/{name}"

    def sum(self, tensor: torch.Tensor) -> None:
        """Every rank's ``tensor`` becomes the sum over ranks (in place)."""
        self.call("a sum over ranks", lambda: dist.all_reduce(tensor, op=dist.ReduceOp.SUM))


class _Work:
    """An asynchronous collective's handle: its ``wait()`` fails as ``Ranks.call`` does."""

    def __init__(self, ranks: Ranks, work: Any, what: str):
        self.ranks, self.work, self.what = ranks, work, what

    def wait(self) -> None:
        """Wait for the collective (on a GPU: the current stream waits)."""
        self.ranks.call(f"the end of {self.what}", self.work.wait)


_FAILED_KEY = "failed/rank"
_SESSIONS = itertools.count(1)  # join_ranks' serial numbers: the sessions of this process, in order


def rank_folder(path: str, rank: int) -> str:
    """The folder of ``rank``'s own files under ``path`` (its swap files, its profile): ``path/rank<N>``."""
    return os.path.join(path, f"rank{rank}")


def world_size_requested() -> int:
    """The number of processes the launcher started: the process group's size, else ``WORLD_SIZE`` (torchrun)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    value = os.environ.get("WORLD_SIZE", "1").strip()
    return int(value) if value.isdigit() else 1


def join_ranks(device: torch.device) -> Ranks | None:
    """This process's ``Ranks`` in a run of several processes, joining the process group from torchrun's
    environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) when the program has not: NCCL on a GPU,
    gloo on the CPU. None for a run of one process."""
    if world_size_requested() <= 1:
        return None
    if not dist.is_available():
        raise RuntimeError("WORLD_SIZE asks for several processes, but this torch build has no torch.distributed")
    if not dist.is_initialized():
        missing = [name for name in ("RANK", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
        if missing:
            raise ValueError(f"WORLD_SIZE={os.environ.get('WORLD_SIZE')} asks for several processes, but {', '.join(missing)} "
                             "is not set: start the program with torchrun --nproc-per-node N, or call "
                             "torch.distributed.init_process_group() before offload()")
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        log.info("joined the process group (%s): rank %d of %d", backend, dist.get_rank(), dist.get_world_size())
    if device.type == "cuda":  # this rank's own GPU (torchrun's LOCAL_RANK, or the one the program chose)
        local = os.environ.get("LOCAL_RANK", "0")
        if torch.cuda.current_device() == 0 and local.isdigit() and int(local) != 0:
            # a program that made the group but never chose a GPU: every rank on GPU 0 would hang NCCL's calls
            torch.cuda.set_device(int(local))
        device = torch.device("cuda", torch.cuda.current_device())
    return Ranks(dist.get_rank(), dist.get_world_size(), device, next(_SESSIONS))


def bind_cores(ranks: Ranks) -> list[int] | None:
    """Give this rank its own share of the host's cores (the ranks of one host split them evenly, in order of their
    local rank), so the ranks' CPU updates do not compete for the same cores: the default thread count
    (``optimizer.cpu_threads: auto``) then counts this share. Left alone (None) where the launcher or the program
    already restricted the process's cores, or where there are fewer cores than ranks. Applies to this thread and the
    threads it starts afterwards (the optimizer worker, torch's intra-op pool)."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    local_rank = int(os.environ.get("LOCAL_RANK", ranks.rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", ranks.world_size))
    cores = sorted(os.sched_getaffinity(0))
    if local_world <= 1 or len(cores) < local_world or len(cores) < (os.cpu_count() or 0):
        return None
    per_rank = len(cores) // local_world
    mine = cores[local_rank * per_rank:(local_rank + 1) * per_rank]
    os.sched_setaffinity(0, mine)
    log.info("rank %d: CPU cores %d-%d of %d (its share of the host's, for its updates)", ranks.rank, mine[0], mine[-1],
             len(cores))
    return mine
