"""A small listener that totals the store's transfer events by path: the end-of-training swap summary."""

from __future__ import annotations

import threading
from collections import defaultdict

from runtime.profiler.names import path_names
from tierstore import TransferEvent


class TrafficCounter:
    """Bytes, transfer count and busy seconds per kind of transfer; paths named as ``device_type``'s are
    (``runtime.profiler.names``: no GPU on a CPU-only run)."""

    def __init__(self, device_type: str = "cuda") -> None:
        self.device_type = device_type
        self.nbytes: dict[str, int] = defaultdict(int)
        self.count: dict[str, int] = defaultdict(int)
        self.seconds: dict[str, float] = defaultdict(float)
        self._lock = threading.Lock()

    def __call__(self, event: TransferEvent) -> None:
        with self._lock:
            self.nbytes[event.kind] += event.nbytes
            self.count[event.kind] += 1
            self.seconds[event.kind] += event.duration_s

    def summary(self) -> str:
        """One line per path: total bytes, transfers, and the bandwidth while busy."""
        lines = ["swap traffic:"]
        for kind, name in path_names(self.device_type).items():
            nbytes = self.nbytes.get(kind, 0)
            busy = self.seconds.get(kind, 0.0)
            rate = f"{nbytes / busy / 1e9:6.2f} GB/s while busy" if busy > 0 else "-"
            lines.append(f"  {name:<16}{nbytes / 2**30:9.2f} GiB in {self.count.get(kind, 0):6d} transfers  {rate}")
        return "\n".join(lines)
