"""How the processes of a run agree while they save or load one checkpoint together (``runtime.core.ranks``).

[Note: checkpoints of several processes] One checkpoint per step, whatever the number of ranks, with the block files
a single process writes (one per block tensor), so it loads at any number of ranks. Every rank calls
``save_checkpoint`` / ``load_checkpoint`` with the same arguments at the same point of its program (they are
collective, as ``optimizer.state_dict()`` is). A save: rank 0 holds the root's lock and makes the scratch
directory; each rank writes (and fsyncs) the files of the blocks it owns ([Note: block ownership] in
runtime.planning.ownership) into it; rank 0 gathers every rank's manifest entries, tensor descriptions and step
counters, and each rank's RNG and data states (``ranks`` in meta.json; rank 0's are also meta.json's own ``rng`` and
``data``, which one process or another number of ranks restores), writes meta.json, then the manifest, and publishes
with the one rename. A load: each rank checks the whole listing and meta.json, and reads (hashing) only the files of the blocks it owns;
every rank restores the step counters of every block (a rank counts the updates of the blocks it does not own).
Between the phases the ranks exchange a status: a failure on any rank (a refused root, a full disk, a corrupt
file, a rank that died: the exchange times out) is an error on every rank, and no checkpoint is published (rank 0
removes the scratch directory) or, for a load, every rank refuses to train until a load completes.

What it leaves out: the files and what they hold (``runtime.checkpoint.state``, ``files``, ``meta``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from runtime.checkpoint.files import CheckpointError, DamagedCheckpointError
from runtime.core.ranks import Ranks
from tierstore import TierStoreError

# What the other ranks raise when one failed: the failure's own family, so that a caller that handles it (the CLI's
# save_or_warn: a failed save warns and training goes on) does the same on every rank. Most specific first.
_KINDS: tuple[tuple[str, type[Exception]], ...] = (
    ("damaged", DamagedCheckpointError), ("checkpoint", CheckpointError), ("os", OSError), ("tierstore", TierStoreError))


@dataclass(frozen=True)
class Status:
    """What one rank reports at an exchange: its failure (None: it went well) and what the others need from it."""

    rank: int
    error: str | None = None
    kind: str = "runtime"  # which error the other ranks raise: one of _KINDS, else a RuntimeError
    payload: Any = None


def status(ranks: Ranks, error: BaseException | None, payload: Any = None) -> Status:
    """This rank's status, from the exception it caught (None: it went well)."""
    if error is None:
        return Status(ranks.rank, payload=payload)
    kind = next((name for name, family in _KINDS if isinstance(error, family)), "runtime")
    return Status(ranks.rank, f"{type(error).__name__}: {error}", kind, payload)


def exchange(ranks: Ranks, what: str, mine: Status) -> list[Status]:
    """Every rank's status, by rank (a collective: every rank calls it at the same point). A rank that does not come
    (it died, or took another path) makes it raise after the collective timeout, and the run is broken then."""
    out: list[Any] = [None] * ranks.world_size
    # Ranks._call: the object collective fails as the engine's collectives do, and marks the run broken.
    with _this_ranks_device(ranks):
        ranks.call(f"the exchange of {what}", lambda: dist.all_gather_object(out, mine))
    return out


def from_first(ranks: Ranks, what: str, mine: Status) -> Status:
    """Rank 0's status on every rank (a collective)."""
    box: list[Any] = [mine]
    with _this_ranks_device(ranks):
        ranks.call(f"the broadcast of {what} from rank 0", lambda: dist.broadcast_object_list(box, src=0))
    return box[0]


def _this_ranks_device(ranks: Ranks) -> contextlib.AbstractContextManager[Any]:
    """Under NCCL, object collectives stage through the current CUDA device: this rank's own, even where the program
    joined the group itself without ``torch.cuda.set_device``."""
    return torch.cuda.device(ranks.device) if ranks.device.type == "cuda" else contextlib.nullcontext()


def failed(statuses: list[Status]) -> list[Status]:
    """The statuses that report a failure."""
    return [s for s in statuses if s.error is not None]


def raise_failure(ranks: Ranks, what: str, statuses: list[Status], own: BaseException | None) -> None:
    """Raise on every rank when any rank failed: a rank that failed raises its own error (with the others' added
    to the message when there were several), the others an error of the same kind naming the rank and its cause."""
    bad = failed(statuses)
    if not bad:
        return
    if own is not None:
        if len(bad) > 1:
            others = "; ".join(f"rank {s.rank}: {s.error}" for s in bad if s.rank != ranks.rank)
            own.add_note(f"{what} failed on other ranks too: {others}")
        raise own
    raise_remote(ranks, what, bad)


def raise_remote(ranks: Ranks, what: str, bad: list[Status], effect: str = "") -> NoReturn:
    """The error this rank raises when other ranks failed (``bad``) and it did not; ``effect``: what that means for
    this rank, added to the message."""
    first = bad[0]
    others = "".join(f"; rank {s.rank}: {s.error}" for s in bad[1:])
    message = (f"rank {ranks.rank} of {ranks.world_size}: {what} failed on rank {first.rank} ({first.error}{others}), "
               "so on every rank" + (f": {effect}" if effect else ""))
    raise dict(_KINDS).get(first.kind, RuntimeError)(message)
