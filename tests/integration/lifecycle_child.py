"""A user's training script for the lifecycle tests: ``python -m tests.integration.lifecycle_child MODE SWAP...``.

It trains the tiny model with master and moments in swap files and never calls ``session.close()``:

    noclose SWAP [SWAP...]  one session per swap path (``tmp``: a temporary directory), a few steps each, return
    loop SWAP               train until a signal ends it
    thread SWAP             a non-daemon thread trains 6 steps; the main thread returns once it has taken one
    pool SWAP               a process pool stays open (its manager thread is non-daemon), a session trains 3 steps
    daemon SWAP             a daemon thread trains until the process ends; the main thread returns after its first step
    worker SWAP             a thread pool's worker trains 3 steps; the pool is never shut down

Markers on stdout: ``SWAP <dir>`` (where the session's swap files are), ``STEP <n>`` after each step, ``END``.
"""

from __future__ import annotations

import sys
import threading

import torch

from runtime import offload
from runtime.bundled.data import ByteBatches, stdlib_text_bytes
from runtime.bundled.example_model import ExampleLM
from tests.integration.checkpoint_training import BATCH, SEQ, SHAPE, tiny_config
from tierstore import TierName


def session_for(swap: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A fresh offloaded tiny model whose master and moments live in swap files under ``swap``."""
    torch.manual_seed(0)
    model, optimizer = offload(ExampleLM(SHAPE), tiny_config(swap, master="nvme", moments="nvme"))  # type: ignore[arg-type]
    print(f"SWAP {optimizer.session.store.tiers[TierName.NVME].directory.path}", flush=True)  # type: ignore[attr-defined]
    return model, optimizer


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int | None) -> None:
    """``steps`` optimizer steps (None: until a signal), printing a marker after each."""
    data = ByteBatches(stdlib_text_bytes(1 << 20), BATCH, SEQ, seed=0)
    step = 0
    while steps is None or step < steps:
        tokens, targets = data.next()
        model(tokens, targets).backward()
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        print(f"STEP {step}", flush=True)


def main(argv: list[str]) -> int:
    """Run the mode; no session is ever closed here."""
    mode, swaps = argv[0], argv[1:]
    if mode == "noclose":
        sessions = [session_for(swap) for swap in swaps]  # kept alive to the end, as a script's globals are
        for model, optimizer in sessions:
            train(model, optimizer, 3)
    elif mode == "loop":
        train(*session_for(swaps[0]), None)
    elif mode == "pool":
        import concurrent.futures
        import os

        pool = concurrent.futures.ProcessPoolExecutor(max_workers=1)  # stops in its own exit hook, after tierstore's
        pool.submit(os.getpid).result()
        train(*session_for(swaps[0]), 3)
    elif mode in ("daemon", "worker"):
        import concurrent.futures

        first_step = threading.Event()

        def trainer(steps: int | None) -> None:
            model, optimizer = session_for(swaps[0])
            train(model, optimizer, 1)
            first_step.set()
            train(model, optimizer, steps)

        if mode == "daemon":
            threading.Thread(target=trainer, args=(None,), name="user-daemon", daemon=True).start()
            first_step.wait()
        else:
            concurrent.futures.ThreadPoolExecutor(max_workers=1).submit(trainer, 2).result()
    elif mode == "thread":
        first_step = threading.Event()

        def trainer() -> None:
            model, optimizer = session_for(swaps[0])
            train(model, optimizer, 1)
            first_step.set()
            train(model, optimizer, 5)
            print("THREAD END", flush=True)

        threading.Thread(target=trainer, name="user-trainer").start()
        first_step.wait()  # then return without joining it: Python joins it at exit
    print("END", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
