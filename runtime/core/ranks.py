"""The processes of one training run and the collective calls between them (``torch.distributed``).

Several processes train one model (``torchrun --nproc-per-node N``, one per GPU, or N over gloo on the CPU): each
rank owns whole blocks' training state (``runtime.planning.ownership`` decides which) and the ranks exchange the
owned blocks' compute weights and gradients. This module says who this process is (``Ranks``) and issues the
three collective calls the engine makes; it decides nothing.

[Note: collectives in program order] Every rank must issue the same collective calls in the same order, or the
run hangs (NCCL) or mixes up tensors. The engine issues them only from events every rank reaches in the same order:
a block's weights are broadcast from its owner each time a hook acquires the block (never by a prefetch, whose
timing differs between ranks, and whatever the block's residency on this rank), a block's gradient is reduced to
its owner when its backward is done, and the gradient norm is summed at the commit. A rank whose model takes another
path (a different block order) breaks this, as it breaks DDP.

What it leaves out: which rank owns which block (planning), when the calls are made (the engine).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from datetime import timedelta

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

    def __init__(self, rank: int, world_size: int, device: torch.device):
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.broken: str | None = None  # the first collective failure, once there was one

    def __repr__(self) -> str:
        return f"Ranks(rank={self.rank}, world_size={self.world_size}, device={self.device})"

    def _call(self, what: str, call: Callable[[], object]) -> None:
        if self.broken is not None:
            raise RuntimeError(f"rank {self.rank} of {self.world_size}: {what} not attempted, an earlier collective failed "
                               f"({self.broken})")
        try:
            call()
        except Exception as error:
            self.broken = f"{what} on rank {self.rank} of {self.world_size}: {error!r}"
            raise RuntimeError(f"rank {self.rank} of {self.world_size}: {what} failed: another rank stopped, raised or "
                               f"took another path (after {COLLECTIVE_TIMEOUT_S:g} s at most: "
                               f"TIERSTORE_COLLECTIVE_TIMEOUT_S): {error}") from error

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """Make ``tensor`` on every rank equal to ``src``'s (in place; stream-ordered on a GPU)."""
        self._call(f"a broadcast from rank {src}", lambda: dist.broadcast(tensor, src=src))

    def reduce_mean(self, tensor: torch.Tensor, dst: int) -> None:
        """``dst``'s ``tensor`` becomes the mean over ranks of every rank's (in place; the others' are left
        undefined). The sum is divided by the number of ranks on ``dst`` only: DDP's averaged gradient."""
        self._call(f"a reduction onto rank {dst}", lambda: dist.reduce(tensor, dst=dst, op=dist.ReduceOp.SUM))
        if self.rank == dst:
            tensor.div_(self.world_size)

    def sum(self, tensor: torch.Tensor) -> None:
        """Every rank's ``tensor`` becomes the sum over ranks (in place)."""
        self._call("a sum over ranks", lambda: dist.all_reduce(tensor, op=dist.ReduceOp.SUM))


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
        device = torch.device("cuda", torch.cuda.current_device())
    return Ranks(dist.get_rank(), dist.get_world_size(), device)


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
