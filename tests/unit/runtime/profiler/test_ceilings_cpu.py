"""The copy ceiling of a CPU-only run is measured as the store's copies run (issue 41: a CPU run's GPU -> pinned path
read 6.93 GB/s against a 1.66 GB/s ceiling): copies of the store's largest entry, not 256 MiB through DRAM, and the
best of torch's threads and one thread, since a copy split over the cores of a busy machine waits for the slowest."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from runtime.profiler import ceilings
from runtime.profiler.ceilings import CPU_PROBE_REPEATS, PCIE_PROBE_NBYTES, copy_probe_nbytes, measure_ceilings
from tierstore import StoreConfig, TensorMeta, TierStore

BLOCK = 3_164_160  # a layer of the bundled model in fp32: 3 MiB, the copies whose rate passed the old ceiling


def _store_with(*numels: int) -> TierStore:
    store = TierStore(StoreConfig(host_budget_nbytes=64 << 20))
    for i, numel in enumerate(numels):
        store.register(f"block{i}.master", TensorMeta(torch.uint8, numel), "host")
    return store


def test_the_cpu_probe_copies_as_much_as_the_store_s_largest_entry():
    with _store_with(4096, BLOCK, 100) as store:
        assert copy_probe_nbytes(store) == BLOCK
    with _store_with(100) as store:
        assert copy_probe_nbytes(store) == 4096  # a page at least
    with _store_with() as store:
        assert copy_probe_nbytes(store) == PCIE_PROBE_NBYTES  # nothing registered yet


def test_a_cpu_run_s_ceiling_is_the_best_of_its_threads_at_the_store_s_copy_size(monkeypatch):
    """The probe runs at the store's copy size on torch's threads and on one, many times, and keeps the faster: on a
    busy 2-core machine the two-thread copy read 0.2 GB/s and the one-thread copy 58."""
    asked: list[tuple[int, int, int]] = []

    def probe(device: torch.device, nbytes: int, repeats: int) -> tuple[float, float]:
        threads = torch.get_num_threads()
        asked.append((nbytes, repeats, threads))
        return (58.0, 40.0) if threads == 1 else (0.2, 90.0)  # each direction's best from another thread count

    monkeypatch.setattr(ceilings, "pcie_ceilings_gbps", probe)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with _store_with(BLOCK) as store:
            out = measure_ceilings(store)
        assert torch.get_num_threads() == 2  # restored
    finally:
        torch.set_num_threads(before)
    assert (out["h2d"], out["d2h"]) == (58.0, 90.0)
    assert [(n, r) for n, r, _ in asked] == [(BLOCK, CPU_PROBE_REPEATS)] * 2 and {t for _, _, t in asked} == {1, 2}


def test_a_gpu_probe_keeps_its_size(monkeypatch):
    """On a GPU the link's ceiling does not depend on the copy's size: the 256 MiB probe as before."""
    asked: list[Any] = []
    monkeypatch.setattr(ceilings, "pcie_ceilings_gbps", lambda device, nbytes, repeats: asked.append(nbytes) or (1.0, 1.0))
    monkeypatch.setattr(ceilings, "wait_for_idle_store", lambda store: True)

    class FakeStore:
        device = torch.device("cuda")
        tiers = type("Tiers", (), {"nvme": None})()

    measure_ceilings(FakeStore())  # type: ignore[arg-type]
    assert asked == [PCIE_PROBE_NBYTES]


@pytest.mark.parametrize("nbytes", [1 << 20])
def test_an_explicit_probe_size_is_kept(monkeypatch, nbytes):
    asked: list[tuple[int, int]] = []
    monkeypatch.setattr(ceilings, "pcie_ceilings_gbps",
                        lambda device, n, repeats: asked.append((n, repeats)) or (1.0, 1.0))
    with _store_with(BLOCK) as store:
        measure_ceilings(store, nbytes=nbytes, repeats=1)
    assert {n for n, _ in asked} == {nbytes} and {r for _, r in asked} == {1}
