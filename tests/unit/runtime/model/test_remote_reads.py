"""The read service and its requester ([Note: reads served by the owner]) in one process: two ranks' halves over an
in-process store (torch.distributed's HashStore), no process group. A request is answered with the owner's values
through a file, an owner that cannot read answers with its error, a rank that failed answers with its failure, and a
request nobody answers raises naming the owner."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import runtime.model.remote_reads as remote_reads
from runtime.core.ranks import Ranks
from runtime.model.remote_reads import ReadService, RemoteReader


class StoreRanks(Ranks):
    """A rank whose process group store is a given in-process one."""

    def __init__(self, rank: int, store: dist.Store):
        super().__init__(rank, 2, torch.device("cpu"))
        self._store = store

    def store(self) -> dist.Store | None:
        return self._store


@pytest.fixture
def pair():
    """Rank 1's service over a block table of its own, and rank 0's reader; both stopped after the test."""
    store = dist.HashStore()
    asked: list[tuple[int, str, int, int]] = []

    def read(index: int, kind: str, step: int, writes: int) -> torch.Tensor:
        asked.append((index, kind, step, writes))
        if index == 9:
            raise OSError("the swap file of block 9 is unreadable")
        return torch.arange(4, dtype=torch.float32) + 10 * index + step

    owner, requester = StoreRanks(1, store), StoreRanks(0, store)
    service, reader = ReadService(owner, read), RemoteReader(requester)
    service.start()
    yield owner, service, reader, asked
    service.close()
    reader.close()


def test_a_read_is_answered_with_the_owners_values_and_leaves_no_file(pair):
    _, service, reader, asked = pair
    for index in (3, 5):  # two requests in turn: each answered, in order
        assert torch.equal(reader.read(1, index, "exp_avg", 2, 7), torch.arange(4.0) + 10 * index + 2)
    assert asked == [(3, "exp_avg", 2, 7), (5, "exp_avg", 2, 7)] and service.served == 2
    [directory] = reader._directories.values()
    assert os.listdir(directory) == []  # each file deleted once read
    reader.close()
    assert not os.path.exists(directory)


def test_a_file_too_large_for_shared_memory_goes_to_the_temporary_directory(pair, monkeypatch):
    _, _, reader, _ = pair
    monkeypatch.setattr(remote_reads, "_room_in_shared_memory", lambda nbytes: nbytes < 1000)
    assert torch.equal(reader.read(1, 3, "master", 0, 0, nbytes=16), torch.arange(4.0) + 30)
    assert torch.equal(reader.read(1, 3, "master", 0, 0, nbytes=10**12), torch.arange(4.0) + 30)
    assert sorted(reader._directories) == [False, True]
    assert reader._directories[True].startswith("/dev/shm/") and not reader._directories[False].startswith("/dev/shm/")


def test_an_owner_that_cannot_read_answers_with_its_error(pair):
    _, _, reader, _ = pair
    with pytest.raises(RuntimeError, match=r"rank 0 of 2: rank 1 could not read block 9 \(master\) for it: "
                                           r"OSError: the swap file of block 9 is unreadable"):
        reader.read(1, 9, "master", 0, 0)
    assert torch.equal(reader.read(1, 1, "master", 0, 0), torch.arange(4.0) + 10)  # the next one is served


def test_a_rank_that_failed_answers_with_its_failure(pair):
    owner, _, reader, asked = pair
    owner.fail("RuntimeError('out of memory')")
    with pytest.raises(RuntimeError, match=r"rank 1 could not read block 2 .*rank 1 failed: RuntimeError\('out of memory'\)"):
        reader.read(1, 2, "master", 0, 0)
    assert asked == []  # its state was not read


def test_a_request_nobody_answers_raises_naming_the_owner(monkeypatch):
    monkeypatch.setattr(remote_reads, "COLLECTIVE_TIMEOUT_S", 0.3)
    reader = RemoteReader(StoreRanks(0, dist.HashStore()))  # rank 1 runs no service
    try:
        with pytest.raises(RuntimeError, match=r"rank 1 did not answer the read of block 4 \(exp_avg_sq\): not within 0.3 s"):
            reader.read(1, 4, "exp_avg_sq", 1, 0)
    finally:
        reader.close()


def test_a_stopped_service_ends_its_thread():
    service = ReadService(StoreRanks(1, dist.HashStore()), lambda *args: torch.zeros(1))
    service.start()
    service.close()
    assert not service._thread.is_alive()
