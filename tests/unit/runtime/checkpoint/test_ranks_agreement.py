"""What each rank raises when one rank's part of a checkpoint save or load failed (runtime.checkpoint.ranks): the
failing rank its own error, the others one of the same family naming the rank and its cause, so a caller that
handles a failed save (the CLI warns and trains on) does the same on every rank."""

from __future__ import annotations

import pytest
import torch

from runtime.checkpoint.files import CheckpointError, DamagedCheckpointError
from runtime.checkpoint.ranks import raise_failure, status
from runtime.core.ranks import Ranks
from tierstore import TierStoreError


def ranks(rank: int) -> Ranks:
    return Ranks(rank, 3, torch.device("cpu"))


@pytest.mark.parametrize("error, family", [
    (OSError(28, "No space left on device"), OSError),
    (DamagedCheckpointError("block1.master.bin: sha256 differs"), DamagedCheckpointError),
    (CheckpointError("step-000002 exists and was not written by this run"), CheckpointError),
    (TierStoreError("swap file corrupt"), TierStoreError),
    (KeyError("block1.master"), RuntimeError),
])
def test_every_rank_raises_the_failures_family(error, family):
    statuses = [status(ranks(0), None), status(ranks(1), error), status(ranks(2), None)]
    with pytest.raises(type(error)) as own:
        raise_failure(ranks(1), "saving a checkpoint", statuses, error)
    assert own.value is error
    for rank in (0, 2):
        with pytest.raises(family, match=rf"rank {rank} of 3: saving a checkpoint failed on rank 1 \({type(error).__name__}"):
            raise_failure(ranks(rank), "saving a checkpoint", statuses, None)


def test_nothing_is_raised_when_every_rank_went_well():
    raise_failure(ranks(0), "saving a checkpoint", [status(ranks(r), None) for r in range(3)], None)


def test_a_failing_rank_hears_of_the_others_failures():
    mine, theirs = OSError("disk full here"), CheckpointError("refused there")
    statuses = [status(ranks(0), theirs), status(ranks(1), mine), status(ranks(2), None)]
    with pytest.raises(OSError) as raised:
        raise_failure(ranks(1), "saving a checkpoint", statuses, mine)
    assert any("rank 0: CheckpointError: refused there" in note for note in raised.value.__notes__)
