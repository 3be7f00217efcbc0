"""The soak run: ``python -m tests.integration.soak_child STEPS EVERY``.

Trains the bundled example with ``tierstore train``'s embedded default config (fp32 master in host memory,
moments in swap files on the ``tmp`` path, weights fetched block by block) with a smaller batch (2 x 64
tokens) so many steps fit in CI time: what leaks, leaks per step, not per token. Every ``EVERY`` steps,
after the updates have landed, it prints one JSON line of what must stay flat: resident memory, the host
tier's bytes in use and its arena size (pinned on a GPU machine), open file descriptors, threads, and the
GPU tier's bytes in use, and on CUDA the allocator's reserved bytes.
"""

from __future__ import annotations

import json
import os
import sys
import time

import psutil
import torch

from runtime.bundled.data import ByteBatches, stdlib_text_bytes
from runtime.cli.train import build_model, default_config
from runtime.config.loader import load_config
from runtime.session import offload


def main(steps: int, every: int) -> int:
    """Train ``steps`` steps, sampling every ``every``."""
    cfg = load_config(default_config(), overrides={"train.batch_size": 2, "train.seq_len": 64})
    model, optimizer = offload(build_model(cfg), cfg)
    session = optimizer.session  # type: ignore[attr-defined]
    device = session.store.device
    data = ByteBatches(stdlib_text_bytes(), cfg.train.batch_size, cfg.train.seq_len, seed=cfg.seed)
    process = psutil.Process()
    start = time.perf_counter()
    try:
        for step in range(1, steps + 1):
            tokens, targets = data.next()
            model(tokens.to(device), targets.to(device)).backward()
            optimizer.step()
            optimizer.zero_grad()
            if step % every == 0:
                optimizer.synchronize()  # type: ignore[attr-defined]
                usage = session.store.usage()
                print(json.dumps({"step": step, "s": time.perf_counter() - start, "rss": process.memory_info().rss,
                                  "host_used": usage["host"]["used_nbytes"], "host_arena": usage["host"]["capacity_nbytes"],
                                  "gpu_used": usage["gpu"]["used_nbytes"], "fds": len(os.listdir("/proc/self/fd")),
                                  "threads": process.num_threads(),
                                  # the CUDA caching allocator's reservation (0 without CUDA)
                                  "gpu_reserved": torch.cuda.memory_reserved() if device.type == "cuda" else 0}),
                      flush=True)
    finally:
        session.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2])))
