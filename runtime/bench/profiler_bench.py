"""Overhead of the swap-traffic profiler: training step time with the profiler listening against without, in
one process and one offload session, in alternating rounds (so drift of the machine hits both sides alike).

    python -m runtime.bench.profiler_bench --preset small --steps 8 --rounds 3

or, from Python on the GPU machine, ``measure_profiler_overhead()``. Prints / returns the median step time of
each side, their ratio, the events recorded per step, and the time ``save()`` takes afterwards.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from typing import Any

import torch

from runtime.example_model import PRESETS, ExampleLM

log = logging.getLogger(__name__)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def default_bench_config() -> dict[str, Any]:
    """All three tiers: weights and master on pinned host, moments on NVMe (a temporary directory)."""
    cuda = torch.cuda.is_available()
    return {"dtype": "bf16" if cuda else "fp32", "optimizer": {"grad_clip": None},
            "tiers": {"nvme": {"path": "tmp", "budget": "48GiB"}},
            "placement": {"weights": "host", "master": "host", "moments": "nvme"}}


def measure_profiler_overhead(preset: str = "small", steps: int = 8, rounds: int = 3, batch_size: int = 8,
                              seq_len: int = 256, config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Median step time with and without the profiler, ``rounds`` x ``steps`` steps each, alternating."""
    from runtime import offload
    from runtime.profiler import Profiler

    shape = PRESETS[preset]
    seq_len = min(seq_len, shape.max_seq_len)
    torch.manual_seed(0)
    model, optimizer = offload(ExampleLM(shape), config or default_bench_config())
    session = optimizer.session
    device = session.store.device
    tokens = torch.randint(0, shape.vocab_size, (batch_size, seq_len + 1), device=device)
    x, y = tokens[:, :-1], tokens[:, 1:]

    def run(num: int) -> list[float]:
        times = []
        for _ in range(num):
            _sync()
            start = time.perf_counter()
            model(x, y).backward()
            optimizer.step()
            optimizer.zero_grad()
            _sync()
            times.append(time.perf_counter() - start)
        return times

    off: list[float] = []
    on: list[float] = []
    events = 0
    save_s = 0.0
    try:
        run(3)  # warm-up: the schedule learns its trace, allocators settle
        for _ in range(rounds):
            off += run(steps)
            profiler = Profiler(session).start()
            on += run(steps)
            profiler.stop()
            raw = profiler.raw()
            events += len(raw.transfers) + len(raw.stalls) + len(raw.adam)
            with tempfile.TemporaryDirectory() as out:
                t0 = time.perf_counter()
                profiler.save(out, plot=False)
                save_s = max(save_s, time.perf_counter() - t0)
    finally:
        session.close()
    off_s, on_s = statistics.median(off), statistics.median(on)
    return {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "preset": preset,
            "steps": steps, "rounds": rounds, "off_step_s": off_s, "on_step_s": on_s, "ratio": on_s / off_s,
            "events_per_step": events / (rounds * steps), "save_s": save_s}


def main() -> None:
    """Command line: run the measurement and print it (JSON with --json)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", choices=sorted(PRESETS))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    result = measure_profiler_overhead(args.preset, args.steps, args.rounds, args.batch_size, args.seq_len)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"profiler overhead on {result['device']} ({result['preset']}): {result['off_step_s']:.4f} s/step off, "
              f"{result['on_step_s']:.4f} s/step on, ratio {result['ratio']:.3f}; {result['events_per_step']:.0f} "
              f"events/step; save {result['save_s']:.3f} s")


if __name__ == "__main__":
    main()
