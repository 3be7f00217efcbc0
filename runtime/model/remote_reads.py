"""Reads of another rank's blocks, answered by that rank's read service: no collective, so any rank may read alone.

[Note: reads served by the owner] With several processes each block's master and moments live on its owner only
([Note: block ownership] in runtime.planning.ownership). A read of a block this rank does not own between steps
(``state_dict()``, ``optimizer.state_dict()``, ``session.save_pretrained``) was a broadcast from the owner, so every
rank had to make the same reads in the same order. The HF Trainer saves on rank 0 alone (``save_model``, its
checkpoints): rank 0's reads waited for ranks that never came. Instead each rank runs a read service, a thread that
watches the process group's store for requests addressed to it. A request names a block, a kind (master, exp_avg,
exp_avg_sq, or the step counters), the requester's committed step and its count of the block's writes between steps
(``load_state_dict``, a parameter written), and a file in this host's shared memory (``/dev/shm``: no disk; the
temporary directory where it has no room, as in a container's 64 MiB). The owner waits until it has committed that
step and made as many writes (it cannot be further on: its next commit needs the requester's gradients, and every
write starts with a barrier of all ranks, ``StateAccess.before_writes``, which the requester reaches only after its
reads), until the block's update to that step is done and, on a GPU, until the device work queued by that commit and
write has run (their events, waited on without blocking the device: nothing queued later, such as the next step's
collectives, which wait for the requester; the owner's CPU may be a commit ahead, its device work waiting);
then it copies the state with ``TierStore.snapshot``, which stages, moves and releases nothing, so the owner's own
threads may go on moving it, and writes the values to the file (on a CUDA stream of the service's own). The requester
loads the file and deletes it. ``close()`` still gathers by broadcast (every rank closes, and on GPUs the broadcast
is faster than files). The store's keys carry the session's serial number, so a later session in the same process
group never reads an earlier one's (the ranks agree on it at setup, ``Ranks.agree_on_serial``).

A request unanswered within ``TIERSTORE_COLLECTIVE_TIMEOUT_S`` (the owner died or stopped serving) raises naming
the rank; an owner that cannot read the block answers with its error, which the requester raises.

What it leaves out: what is read and when (``runtime.model.state_access``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from runtime.core.ranks import COLLECTIVE_TIMEOUT_S, Ranks

log = logging.getLogger(__name__)

_PREFIX = "read"  # under the session's keys (Ranks.key)
_IDLE_POLL_S = 0.05  # how often an idle service looks for a request (a store lookup: cheap)
_ANSWER_POLL_S = 0.002  # how often a requester looks for the answer
_FAILURE_POLLS = 50  # and every this many looks, whether the owner said it failed (Ranks.fail)


def _request_key(ranks: Ranks, owner: int, number: int) -> str:
    return ranks.key(f"{_PREFIX}/{owner}/{number}")


def _answer_key(ranks: Ranks, owner: int, number: int) -> str:
    return ranks.key(f"{_PREFIX}/{owner}/{number}/done")


_SHM = "/dev/shm"


def _room_in_shared_memory(nbytes: int) -> bool:
    """Whether a file of ``nbytes`` fits in this host's shared memory (a container's is often 64 MiB)."""
    try:
        return os.access(_SHM, os.W_OK) and shutil.disk_usage(_SHM).free > 2 * nbytes
    except OSError:
        return False


class ReadService:
    """This rank's answers to the other ranks' reads of its blocks: a daemon thread from ``start()`` to ``close()``.
    ``read(index, kind, step, writes)`` gives the block's fp32 values of that kind at that step after that many writes
    of it between steps (``StateAccess.own_copy``)."""

    def __init__(self, ranks: Ranks, read: Callable[[int, str, int, int], torch.Tensor]):
        self.ranks = ranks
        self.read = read
        self.served = 0  # requests answered (tests read it)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"tierstore-reads-rank{ranks.rank}", daemon=True)

    def start(self) -> None:
        """Begin answering requests."""
        self._thread.start()

    def close(self) -> None:
        """Stop answering (the thread ends within one poll)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5 * _IDLE_POLL_S + 5)

    def _run(self) -> None:
        store = self.ranks.store()
        if store is None:
            return
        if self.ranks.device.type == "cuda":
            # This thread's CUDA calls go to this rank's GPU, not GPU 0, and on a stream of its own: the default
            # stream holds the owner's next collectives, queued already, which wait for the rank reading.
            torch.cuda.set_device(self.ranks.device)
            with torch.cuda.stream(torch.cuda.Stream(self.ranks.device)):
                self._serve(store)
        else:
            self._serve(store)

    def _serve(self, store: Any) -> None:
        number = 1
        while not self._stop.is_set():
            key = _request_key(self.ranks, self.ranks.rank, number)
            try:
                if not store.check([key]):
                    time.sleep(_IDLE_POLL_S)
                    continue
                request = json.loads(store.get(key).decode())
                store.set(_answer_key(self.ranks, self.ranks.rank, number), self._answer(request))
            except Exception as error:  # the store's host (rank 0) is gone: nobody can ask any more
                log.debug("rank %d: read service stops: %r", self.ranks.rank, error)
                return
            number += 1

    def _answer(self, request: dict) -> str:
        """Read and write the requested block into the requester's file; '' when done, else the error."""
        if self.ranks.broken is not None:  # this rank failed (or saw a collective fail): its state is not for reading
            return self.ranks.broken
        path = Path(request["path"])
        tmp = path.with_name(path.name + ".tmp")
        try:
            values = self.read(int(request["block"]), str(request["kind"]), int(request["step"]), int(request["writes"]))
            torch.save(values, tmp)
            os.replace(tmp, path)
            self.served += 1
            return ""
        except Exception as error:
            tmp.unlink(missing_ok=True)
            log.warning("rank %d could not serve rank %s's read of block %s (%s): %r", self.ranks.rank,
                        request.get("from"), request.get("block"), request.get("kind"), error, exc_info=True)
            return f"{type(error).__name__}: {error}"


class RemoteReader:
    """This rank's reads of blocks other ranks own, through their read services."""

    def __init__(self, ranks: Ranks):
        self.ranks = ranks
        self._directories: dict[bool, str] = {}  # in shared memory or not -> the directory, made at first use

    def _directory(self, nbytes: int) -> str:
        """Where a file of ``nbytes`` goes: shared memory (no disk) where it has room, else the temporary directory."""
        shared = _room_in_shared_memory(nbytes)
        if shared not in self._directories:
            self._directories[shared] = tempfile.mkdtemp(prefix=f"tierstore-reads-rank{self.ranks.rank}-",
                                                         dir=_SHM if shared else None)
        return self._directories[shared]

    def read(self, owner: int, index: int, kind: str, step: int, writes: int, nbytes: int = 0) -> torch.Tensor:
        """Block ``index``'s fp32 values of ``kind`` (about ``nbytes``) at ``step``, after ``writes`` writes of it
        between steps, from rank ``owner`` (a CPU tensor)."""
        store = self.ranks.store()
        if store is None:
            raise RuntimeError(f"rank {self.ranks.rank}: no process group store to ask rank {owner} for block {index}")
        number = store.add(self.ranks.key(f"{_PREFIX}/{owner}/count"), 1)
        path = Path(self._directory(nbytes)) / f"block{index}-{kind}-{number}.pt"
        store.set(_request_key(self.ranks, owner, number), json.dumps(
            {"block": index, "kind": kind, "step": step, "writes": writes, "path": str(path), "from": self.ranks.rank}))
        answer = _answer_key(self.ranks, owner, number)
        deadline = time.monotonic() + COLLECTIVE_TIMEOUT_S
        polls = 0
        while not store.check([answer]):
            polls += 1
            failed = self.ranks.failure_of(owner) if polls % _FAILURE_POLLS == 0 else None
            if failed is not None or time.monotonic() > deadline:
                why = f"it failed: {failed}" if failed is not None else \
                    f"not within {COLLECTIVE_TIMEOUT_S:g} s (TIERSTORE_COLLECTIVE_TIMEOUT_S): it stopped, or its session was closed"
                path.unlink(missing_ok=True)  # (where it answers after all, its file goes with the directory)
                raise RuntimeError(f"rank {self.ranks.rank} of {self.ranks.world_size}: rank {owner} did not answer the "
                                   f"read of block {index} ({kind}): {why}")
            time.sleep(_ANSWER_POLL_S)
        failure = store.get(answer).decode()
        for key in (_request_key(self.ranks, owner, number), answer):
            store.delete_key(key)
        if failure:
            raise RuntimeError(f"rank {self.ranks.rank} of {self.ranks.world_size}: rank {owner} could not read block "
                               f"{index} ({kind}) for it: {failure}")
        try:
            return torch.load(path, weights_only=True)
        finally:
            path.unlink(missing_ok=True)

    def close(self) -> None:
        """Remove the directories of this rank's reads."""
        for directory in self._directories.values():
            shutil.rmtree(directory, ignore_errors=True)
        self._directories = {}
