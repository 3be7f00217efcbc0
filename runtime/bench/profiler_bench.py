"""Overhead of the swap-traffic profiler: training step time with the profiler listening against without, in
one process and one offload session, in alternating rounds: drift of the machine hits both sides alike, and
the order flips each round so neither side always runs second. (One session for both sides, not a process
each: two processes would also compare two pinned arenas and two allocator histories.)

On the headline configuration -- ``tierstore bench train``'s row host-s40-keep: weights and optimizer on
pinned host, 40% of the update on the GPU over state streamed from host, weights kept for backward; the 1.35B
benchmark model, sequence 1024, micro-batch 8 --::

    python -m runtime.bench.profiler_bench --row host-s40-keep --preset 1.35b --seq-len 1024 --batch-size 8 --steps 8 --rounds 3

Without ``--row``: all three tiers (weights and master on host, moments on NVMe in a temporary directory).
A step's time is the period between the ends of consecutive steps, with no device sync in between (the loss
read each step is the sync), as ``tierstore bench train`` times its rows; each round's first step, which
starts on a drained pipeline, is left out. Prints the median step time of each side, their ratio, the events
recorded per step, the time ``save()`` takes, and the last profiled round's traffic per path against the
ceilings measured in the same run. From Python: ``measure_profiler_overhead()``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import tempfile
import time
from typing import Any

import torch

from runtime.bench import synchronize
from runtime.bench.train_model import MODEL_KINDS
from runtime.bundled.example_model import PRESETS

log = logging.getLogger(__name__)

HEADLINE_ROW = "host-s40-keep"


def default_bench_config() -> dict[str, Any]:
    """All three tiers: weights and master on pinned host, moments on NVMe (a temporary directory)."""
    cuda = torch.cuda.is_available()
    return {"dtype": "bf16" if cuda else "fp32", "optimizer": {"grad_clip": None},
            "tiers": {"nvme": {"path": "tmp", "budget": "48GiB"}},
            "placement": {"weights": "host", "master": "host", "moments": "nvme"}}


def bench_config(row: str | None, nvme_dir: str | None = None) -> dict[str, Any]:
    """The config of ``tierstore bench train``'s tierstore row ``row`` (its own ``row_config``, with the
    accumulation it sets, so the two benches measure the same training), or :func:`default_bench_config`."""
    if row is None:
        return default_bench_config()
    from runtime.bench.train_rows import accumulation_of, is_tierstore, row_config, row_errors, row_options

    errors = row_errors([row])
    if errors:
        raise ValueError(errors[0])
    base, options = row_options(row)
    if not is_tierstore(row) or base == "nvme-auto" or options.get("cap"):
        raise ValueError(f"--row {row}: the profiler listens to a tierstore session, and this bench has no DeepSpeed "
                         f"row to take a memory cap from; choose a tierstore row without -cap (e.g. {HEADLINE_ROW})")
    config = row_config(row, nvme_dir)
    config.setdefault("optimizer", {})["accumulation_steps"] = accumulation_of(row)
    return config


def measure_profiler_overhead(preset: str = "small", *, steps: int = 8, rounds: int = 3, batch_size: int = 8,
                              seq_len: int = 256, model_kind: str = "example", config: dict[str, Any] | None = None,
                              row: str | None = None, nvme_dir: str | None = None) -> dict[str, Any]:
    """Median step time without and with the profiler, ``rounds`` x ``steps`` timed steps each, alternating;
    the model is ``tierstore bench train``'s (``preset``, ``model_kind``, ``seq_len``, ``batch_size``), the
    session's config ``config`` or ``row``'s (see :func:`bench_config`)."""
    from runtime import offload
    from runtime.bench.train_model import BenchModel, batch_loss, build_model, make_batch
    from runtime.profiler import Profiler, measure_ceilings

    if steps < 1 or rounds < 1:
        raise ValueError(f"steps and rounds must be >= 1, got {steps} and {rounds}")
    spec = BenchModel.from_preset(preset, model_kind, seq=seq_len, micro_batch=batch_size)
    config = config or bench_config(row, nvme_dir)
    accumulation = int(config.get("optimizer", {}).get("accumulation_steps", 1))
    model, optimizer = offload(build_model(spec), config)
    session = optimizer.session  # type: ignore[attr-defined]  # set by offload(), as in cli/train.py
    batch = make_batch(spec, session.store.device, 0)

    def run(num: int) -> list[float]:
        """num + 1 steps from a drained pipeline; the periods of the last num (see the module doc)."""
        optimizer.synchronize()
        synchronize()
        times: list[float] = []
        last = time.perf_counter()
        for i in range(num + 1):
            for _ in range(accumulation):
                loss = batch_loss(spec, model, batch)
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            loss.item()
            now = time.perf_counter()
            if i:
                times.append(now - last)
            last = now
        return times

    off: list[float] = []
    on: list[float] = []
    events = profiled_steps = 0
    save_s = 0.0
    summary: dict[str, Any] = {}
    try:
        run(2)  # warm-up: the schedule learns its trace, allocators settle
        optimizer.synchronize()  # the warm-up's write-backs land before the probes, not during them
        t0 = time.perf_counter()
        ceilings = measure_ceilings(session.store)
        ceilings_s = time.perf_counter() - t0
        for r in range(rounds):
            for side in ("off", "on") if r % 2 == 0 else ("on", "off"):
                if side == "off":
                    off += run(steps)
                    continue
                profiler = Profiler(session, ceilings).start()
                on += run(steps)
                optimizer.synchronize()  # the last step's copies land while the profiler still listens
                profiler.stop()
                raw = profiler.raw()
                events += len(raw.transfers) + len(raw.stalls) + len(raw.adam)
                profiled_steps += len(raw.marks)
                with tempfile.TemporaryDirectory() as out:
                    start = time.perf_counter()
                    profiler.save(out, plot=False)
                    save_s = max(save_s, time.perf_counter() - start)
                summary = profiler.summary()
    finally:
        session.close()
    off_s, on_s = statistics.median(off), statistics.median(on)
    return {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "preset": preset,
            "model": spec.describe(), "row": row, "seq_len": seq_len, "batch_size": batch_size, "steps": steps, "rounds": rounds,
            "allocator_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
            "off_step_s": off_s, "on_step_s": on_s, "ratio": on_s / off_s, "timed_steps": [len(off), len(on)],
            "events_per_step": events / max(1, profiled_steps), "save_s": save_s,
            "ceilings_gbps": ceilings, "ceilings_s": ceilings_s, "summary": summary}


def format_result(result: dict[str, Any]) -> str:
    """The measurement for a person: step times, ratio, and the last profiled round's traffic per path."""
    from runtime.profiler.report import paths_table

    what = result["row"] or "all three tiers (moments on NVMe)"
    lines = [f"profiler overhead on {result['device']}: {result['preset']} ({result['model']}), {what}, "
             f"{result['rounds']} rounds x {result['steps']} steps per side"
             + (f", PYTORCH_CUDA_ALLOC_CONF={result['allocator_conf']}" if result["allocator_conf"] else ""),
             f"step time: {result['off_step_s']:.4f} s off, {result['on_step_s']:.4f} s on, overhead ratio "
             f"{result['ratio']:.3f}; {result['events_per_step']:.0f} events/step; save {result['save_s']:.3f} s",
             "ceilings (GB/s, measured in this run in " + f"{result['ceilings_s']:.1f} s): "
             + ", ".join(f"{k} {v:.2f}" for k, v in result["ceilings_gbps"].items())]
    if result["summary"]:
        lines += ["", "last profiled round: " + paths_table(result["summary"])]
    return "\n".join(lines)


def main() -> None:
    """Command line: run the measurement and print it (JSON with --json)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--row", help=f"a tierstore row of tierstore bench train, e.g. {HEADLINE_ROW} (the headline "
                                      "configuration); then --preset, --seq-len and --batch-size default to that bench's")
    parser.add_argument("--preset", choices=sorted(PRESETS))
    parser.add_argument("--model", choices=MODEL_KINDS, default="example", help="as tierstore bench train's --model")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--nvme-dir", help="swap directory for rows that use one (default: a temporary one)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.row:
        from runtime.bench.train_model import MICRO_BATCH, SEQ_LEN
        from runtime.bench.train_rows import row_options

        defaults = {"preset": "1.35b", "seq_len": SEQ_LEN, "batch_size": MICRO_BATCH}
        if not row_options(args.row)[1].get("noseg"):
            # As tierstore bench train runs its tierstore rows, unless the caller set a config; it must be in
            # place before the first CUDA allocation.
            os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    else:
        defaults = {"preset": "small", "seq_len": 256, "batch_size": 8}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    result = measure_profiler_overhead(args.preset, steps=args.steps, rounds=args.rounds, batch_size=args.batch_size,
                                       seq_len=args.seq_len, model_kind=args.model, row=args.row, nvme_dir=args.nvme_dir)
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    else:
        print(format_result(result))


if __name__ == "__main__":
    main()
