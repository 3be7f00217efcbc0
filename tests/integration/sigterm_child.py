"""A process that signals itself with SIGTERM at a chosen point, for the SIGTERM tests:
``python -m tests.integration.sigterm_child MODE ARGS...`` with ``SIGTERM_CHILD_AT`` in the environment.

Modes:

    api SWAP [cuda]          a user's script with no signal handler of its own: ``offload()`` the tiny model (master
                             and moments in swap files under SWAP, or ``tmp``), 3 steps, ``session.close()``; with
                             ``cuda``, on the GPU in bf16, the master in pinned memory and the moments on NVMe
    cli CONFIG CHECKPOINTS   ``tierstore train --config CONFIG --checkpoint-dir CHECKPOINTS --save-every 1``

``SIGTERM_CHILD_AT`` says when (the test's own switch, read here only: the runtime has no test-only path):

    N          at the N-th call of a Python function of runtime/ or tierstore/ in the main thread
    NAME:N     at the N-th such call of a function named NAME (``register:3``), or qualified so
               (``TierStore.close:1``, ``handle_signals.<locals>.leave:1``)
    count      never: at the end print ``COUNT calls first last``, the calls made and the first and last call at
               which SIGTERM had tierstore's handler (the span a SIGTERM must end cleanly with status 143)

The calls are counted by a ``sys.setprofile`` function (the main thread only, where signals are handled); at the
chosen one it prints ``KILL N handler`` (or ``KILL N default``: SIGTERM then had its default action) and sends the
signal to this process, which handles it at its next instruction, as one from outside would be.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import runtime
import tierstore

ROOTS = tuple(str(Path(package.__file__).parent) + os.sep for package in (runtime, tierstore))


def has_handler() -> bool:
    """SIGTERM has tierstore's handler (``runtime.core.signals``), not its default action."""
    return type(signal.getsignal(signal.SIGTERM)).__name__ == "_SignalHandler"


class SignalAtCall:
    """The profile function: counts the main thread's calls into runtime/ and tierstore/ and signals at the chosen one."""

    def __init__(self, at: str):
        self.name, _, nth = at.rpartition(":")
        self.nth = None if nth == "count" else int(nth)
        self.calls = 0
        self.first: int | None = None
        self.last: int | None = None

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or not frame.f_code.co_filename.startswith(ROOTS):
            return
        if self.name and self.name != (frame.f_code.co_qualname if "." in self.name else frame.f_code.co_name):
            return
        self.calls += 1
        if self.nth is None:
            if has_handler():
                self.first = self.first or self.calls
                self.last = self.calls
            return
        if self.calls == self.nth:
            sys.setprofile(None)
            print(f"KILL {self.calls} {'handler' if has_handler() else 'default'} {frame.f_code.co_qualname}", flush=True)
            os.kill(os.getpid(), signal.SIGTERM)

    def report(self) -> None:
        """Count mode: the calls made and the span with tierstore's handler."""
        sys.setprofile(None)
        if self.nth is None:
            print(f"COUNT {self.calls} {self.first} {self.last}", flush=True)


def script(swap: str, device: str = "cpu") -> None:
    """The user's script: offload, three steps, close."""
    import torch

    from runtime import offload
    from runtime.bundled.data import ByteBatches, stdlib_text_bytes
    from runtime.bundled.example_model import ExampleLM
    from tests.integration.checkpoint_training import BATCH, SEQ, SHAPE, tiny_config

    torch.manual_seed(0)
    data = ByteBatches(stdlib_text_bytes(1 << 16), BATCH, SEQ, seed=0)
    config = (tiny_config(swap, master="nvme", moments="nvme") if device == "cpu"
              else tiny_config(swap, master="host", moments="nvme", device=device, dtype="bf16"))
    model, optimizer = offload(ExampleLM(SHAPE), config)  # type: ignore[arg-type]
    for _ in range(3):
        tokens, targets = data.next()
        model(tokens.to(device), targets.to(device)).backward()
        optimizer.step()
        optimizer.zero_grad()
    optimizer.session.close()  # type: ignore[attr-defined]


def main(argv: list[str]) -> int:
    """Run the mode under the profile function."""
    counter = SignalAtCall(os.environ["SIGTERM_CHILD_AT"])
    mode = argv[0]
    sys.setprofile(counter)
    if mode == "api":
        script(*argv[1:])
        code = 0
    else:
        from runtime.cli.main import main as cli_main

        code = cli_main(["train", "--config", argv[1], "--checkpoint-dir", argv[2], "--save-every", "1"])
    counter.report()
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
