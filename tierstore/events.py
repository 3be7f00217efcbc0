"""Transfer events: what moved, between which tiers, how many bytes, when. Listeners subscribe to a bus."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TransferEvent:
    """One completed transfer.

    ``start_s`` / ``end_s`` are ``time.perf_counter()`` seconds of the host: when the transfer was issued and
    when its completion was first observed. ``device_s`` is the duration measured by CUDA events for
    copies on a stream (None for file IO and for the CPU fallback, where host times are exact).
    """

    kind: str  # "h2d", "d2h", "read", "write", "copy"
    key: str
    src_tier: str
    dst_tier: str
    nbytes: int
    start_s: float
    end_s: float
    device_s: float | None = None
    thread: str = ""

    @property
    def duration_s(self) -> float:
        """The transfer's duration: the device-measured time where there is one, else host wall time."""
        return self.device_s if self.device_s is not None else self.end_s - self.start_s


Listener = Callable[[TransferEvent], None]


class EventBus:
    """Fan-out of transfer events to subscribed listeners. Thread-safe; a failing listener is logged, not raised."""

    def __init__(self) -> None:
        self._listeners: list[Listener] = []
        self._lock = threading.Lock()

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Add a listener; returns a function that removes it."""
        with self._lock:
            self._listeners.append(listener)

        def unsubscribe() -> None:
            with self._lock:
                if listener in self._listeners:
                    self._listeners.remove(listener)

        return unsubscribe

    def publish(self, event: TransferEvent) -> None:
        """Deliver one event to every listener, in the publishing thread."""
        with self._lock:
            listeners = list(self._listeners)
        for listener in listeners:
            try:
                listener(event)
            except Exception:  # a profiler bug must never break a transfer
                log.exception("transfer event listener %r failed", listener)
