"""EventBus fan-out, and the bytes a store's events report against what actually moved through each tier."""

from __future__ import annotations

import logging
import threading
from collections import Counter
from pathlib import Path

import pytest
import torch

from tierstore import EventBus, StoreConfig, TensorMeta, TierStore, TransferEvent


def event(nbytes: int = 10, device_s: float | None = None) -> TransferEvent:
    return TransferEvent("read", "k", "nvme", "host", nbytes, 1.0, 1.5, device_s)


def test_subscribe_publish_unsubscribe() -> None:
    bus = EventBus()
    seen_a: list[TransferEvent] = []
    seen_b: list[TransferEvent] = []
    unsubscribe_a = bus.subscribe(seen_a.append)
    bus.subscribe(seen_b.append)
    first = event(1)
    bus.publish(first)
    unsubscribe_a()
    unsubscribe_a()  # twice is harmless
    bus.publish(event(2))
    assert seen_a == [first] and [e.nbytes for e in seen_b] == [1, 2]


def test_failing_listener_is_logged_and_others_still_run(caplog: pytest.LogCaptureFixture) -> None:
    bus = EventBus()
    seen: list[TransferEvent] = []

    def broken(_: TransferEvent) -> None:
        raise ValueError("profiler bug")

    bus.subscribe(broken)
    bus.subscribe(seen.append)
    with caplog.at_level(logging.ERROR, logger="tierstore.events"):
        bus.publish(event())
    assert len(seen) == 1 and "profiler bug" in caplog.text


def test_listener_may_unsubscribe_itself_while_being_called() -> None:
    bus = EventBus()
    calls: list[int] = []
    holder: dict = {}

    def once(e: TransferEvent) -> None:
        calls.append(e.nbytes)
        holder["unsubscribe"]()

    holder["unsubscribe"] = bus.subscribe(once)
    bus.publish(event(1))
    bus.publish(event(2))
    assert calls == [1]


def test_duration_prefers_the_device_time() -> None:
    assert event().duration_s == pytest.approx(0.5)
    assert event(device_s=0.125).duration_s == 0.125


def test_publish_from_many_threads_loses_nothing() -> None:
    bus = EventBus()
    total = Counter()
    lock = threading.Lock()

    def count(e: TransferEvent) -> None:
        with lock:
            total["nbytes"] += e.nbytes
            total["events"] += 1

    bus.subscribe(count)
    threads = [threading.Thread(target=lambda i=i: [bus.publish(event(i)) for _ in range(200)]) for i in range(1, 9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert total == Counter(events=8 * 200, nbytes=200 * sum(range(1, 9)))


def test_store_events_account_for_every_byte_moved(nvme_dir: Path, device: torch.device) -> None:
    """A scripted sequence of movements; the events' bytes per (kind, src, dst) must equal what the script
    moved, and each tier's inbound bytes must equal the sizes of the copies that landed there."""
    sizes = {"a": (torch.float32, 3001), "b": (torch.bfloat16, 70_000), "c": (torch.uint8, 4097)}
    metas = {key: TensorMeta(dtype, numel) for key, (dtype, numel) in sizes.items()}
    nbytes = {key: meta.nbytes for key, meta in metas.items()}
    seen: list[TransferEvent] = []
    config = StoreConfig(device=str(device), host_budget_nbytes=4 << 20, nvme_path=str(nvme_dir))
    with TierStore(config) as store:
        store.bus.subscribe(seen.append)
        store.register("a", metas["a"], "host", init=torch.ones(3001))
        store.register("b", metas["b"], "nvme", init=torch.ones(70_000, dtype=torch.bfloat16))
        store.register("c", metas["c"], "nvme")
        for key in ("a", "b", "c"):
            store.fetch(key, "gpu").wait()
        for key in ("a", "b"):
            store.mark_dirty(key, "gpu")
            store.evict(key, "gpu", "host").wait()
        store.evict("b", "host").wait()
        store.release("c", "gpu")
        store.fetch("c", "gpu").wait()  # host copy of c is still cached: one more h2d, no read
        assert store.state("c", "host").is_current
    by_path = Counter()
    for e in seen:
        assert e.nbytes == nbytes[e.key] and e.key in nbytes
        by_path[(e.kind, e.src_tier, e.dst_tier)] += e.nbytes
    assert by_path == {
        ("write", "host", "nvme"): nbytes["b"] + nbytes["b"],  # init b, evict b (zeros c: its header only)
        ("read", "nvme", "host"): nbytes["b"] + nbytes["c"],
        ("h2d", "host", "gpu"): nbytes["a"] + nbytes["b"] + 2 * nbytes["c"],
        ("d2h", "gpu", "host"): nbytes["a"] + nbytes["b"],
    }
