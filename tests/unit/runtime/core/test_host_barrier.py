"""``Ranks.host_barrier``: the ranks meet in the process group's store, no collective kernel
([Note: no GPU collective beside a pinning]). Two ``Ranks`` of one store, in threads of this process."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

from runtime.core import ranks as ranks_module
from runtime.core.ranks import Ranks


def _pair(monkeypatch: pytest.MonkeyPatch) -> tuple[Ranks, Ranks]:
    store = dist.HashStore()
    monkeypatch.setattr(Ranks, "store", lambda self: store)
    return Ranks(0, 2, torch.device("cpu"), serial=7), Ranks(1, 2, torch.device("cpu"), serial=7)


def test_a_rank_leaves_the_host_barrier_only_once_every_rank_came(monkeypatch):
    first, second = _pair(monkeypatch)
    for _ in range(2):  # a second barrier is a new meeting, not the first one's keys
        arrived: list[float] = []

        def late(arrived: list[float] = arrived) -> None:
            time.sleep(0.3)
            arrived.append(time.monotonic())
            second.host_barrier("the test's meeting")

        thread = threading.Thread(target=late)
        thread.start()
        first.host_barrier("the test's meeting")
        left = time.monotonic()
        thread.join()
        assert arrived and left >= arrived[0], "rank 0 left before rank 1 came"


def test_a_rank_that_failed_ends_the_others_wait_naming_it(monkeypatch):
    first, second = _pair(monkeypatch)
    second.fail("out of pinned memory in the test")
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 failed: out of pinned memory in the test"):
        first.host_barrier("the ranks' host memory pinned")
    assert time.monotonic() - started < 5
    assert first.broken is not None  # later collectives refuse at once


def test_a_rank_that_never_comes_ends_the_wait_at_the_timeout(monkeypatch):
    first, _ = _pair(monkeypatch)
    monkeypatch.setattr(ranks_module, "COLLECTIVE_TIMEOUT_S", 0.3)
    with pytest.raises(RuntimeError, match="the ranks' host memory pinned failed.*TIERSTORE_COLLECTIVE_TIMEOUT_S"):
        first.host_barrier("the ranks' host memory pinned")
