"""Fork server for the checkpoint kill test: ``python -m tests.integration.checkpoint_kill_child``.

Importing torch costs seconds, so this process imports everything once and then, for each JSON command on
stdin, forks a child that trains the tiny model with offload (master and moments in swap files), saving a
checkpoint every step and printing markers the test acts on:

    PID <pid>          (the launcher) a child started; the test SIGKILLs that pid
    RESUMED <step>     the child loaded the latest checkpoint (step 0: started afresh)
    LOSS <step> <repr> the loss of a step, exactly
    SAVING <step>      a save is about to start (the test kills after a random delay)
    SAVED <step>       the save returned
    DONE               the child trained to the end
    EXIT <pid> <wait status>   (the launcher) the child is gone

No torch computation runs in this process before a fork: a child forked after OpenMP has run can hang.
Command fields: swap (dir), ckpt (dir or null), total (steps), resume (bool), file_delay_s (sleep after each
checkpoint file, so random kill times land inside the save).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch._dynamo  # noqa: F401  imported lazily by the first optimizer step: ~1.5 s per child otherwise

from runtime.bundled.data import stdlib_text_bytes
from tests.integration.checkpoint_training import tiny_config, train


def emit(text: str) -> None:
    """One line straight to the pipe: a single write, so lines of the launcher and a child never interleave."""
    os.write(1, (text + "\n").encode())


def run_child(command: dict[str, Any], corpus: bytes) -> None:
    """Train as the command says, printing the markers."""
    delay = float(command.get("file_delay_s", 0.0))
    ckpt = Path(command["ckpt"]) if command.get("ckpt") else None
    train(tiny_config(Path(command["swap"]), master="nvme", moments="nvme"), corpus, int(command["total"]),
          checkpoint_dir=ckpt, save_every=1 if ckpt else 0, resume=bool(command.get("resume")), keep_last=2,
          on_step=lambda step, loss: emit(f"LOSS {step} {loss!r}"),
          before_save=lambda step: emit(f"SAVING {step}"),
          after_save=lambda step, path: emit(f"SAVED {step}"),
          on_resume=lambda step: emit(f"RESUMED {step}"),
          progress=(lambda what: time.sleep(delay)) if delay > 0 else None,  # a slow disk: saves long enough to kill inside
          save_threads=1)
    emit("DONE")


def main() -> int:
    """Serve fork requests until stdin closes or says quit."""
    corpus = stdlib_text_bytes(1 << 20)
    emit("READY")
    for line in sys.stdin:
        command = json.loads(line)
        if command.get("op") == "quit":
            break
        Path(command["swap"]).mkdir(parents=True, exist_ok=True)
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                run_child(command, corpus)
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                sys.stderr.flush()
                os._exit(code)  # never return into the launcher's loop or run its exit handlers
        emit(f"PID {pid}")
        _, status = os.waitpid(pid, 0)
        emit(f"EXIT {pid} {status}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
