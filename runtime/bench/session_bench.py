"""One GPU-machine run of the benchmark model for the profiler and checkpoint figures.

    python -m runtime.bench.session_bench --out DIR [--preset 1.35b] [--steps 6] [--checkpoint-dir DIR]

1. Trains the benchmark model in the headline configuration (``tierstore bench train``'s row host-s40-keep:
   weights and optimizer on pinned host, 40% of the update on the GPU over state streamed from host, weights
   kept for backward) with the profiler listening and saves the profile (report, Chrome trace, JSON summary,
   plot) under OUT/profile.
2. Times one checkpoint save, verification and load of that session's state, beside the disk's own
   sequential write and read (dd, O_DIRECT, fsync) of the same directory measured in the same run.

Everything it writes under --checkpoint-dir goes into one fresh private subdirectory it creates
(``session-bench-XXXXXXXX``, mode 0700), and that subdirectory is all it removes: a directory the user
named is never deleted, nor anything already in it.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from runtime import OffloadSession, offload
from runtime.bench.profiler_bench import HEADLINE_ROW
from runtime.bench.train_model import BenchModel, make_batch
from runtime.bench.train_rows import row_config
from runtime.bundled.example_model import PRESETS, ExampleLM
from runtime.checkpoint.state import bench_checkpoint
from runtime.profiler import Profiler, measure_ceilings

log = logging.getLogger(__name__)


def disk_ceiling(directory: Path, nbytes: int) -> dict[str, float]:
    """dd write (O_DIRECT, fsync) then read (O_DIRECT) of nbytes in directory (a private one of ours: dd
    opens its output by name); GB/s each."""
    target = directory / "ceiling.dd"
    count = max(1, nbytes // (64 << 20))
    start = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={target}", "bs=64M", f"count={count}", "oflag=direct", "conv=fsync"],
                   check=True, capture_output=True)
    write_s = time.perf_counter() - start
    start = time.perf_counter()
    subprocess.run(["dd", f"if={target}", "of=/dev/null", "bs=64M", f"count={count}", "iflag=direct"], check=True, capture_output=True)
    read_s = time.perf_counter() - start
    target.unlink()
    moved = count * (64 << 20)
    return {"write_GBps": moved / write_s / 1e9, "read_GBps": moved / read_s / 1e9, "nbytes": moved}


def checkpoint_figures(session: OffloadSession, checkpoint_dir: Path) -> tuple[dict[str, Any], dict[str, float]]:
    """One checkpoint save / verify / load of the session (``bench_checkpoint``) and the dd ceiling, both
    in a fresh private subdirectory of ``checkpoint_dir``: created here, and the only thing removed."""
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="session-bench-", dir=checkpoint_dir))
    try:
        ckpt = bench_checkpoint(session, work / "ckpt")
        return ckpt, disk_ceiling(work, min(int(ckpt["nbytes"]), 8 << 30))
    finally:
        shutil.rmtree(work)


def main() -> None:
    """Run the profile and checkpoint measurements, print a summary, write JSON under --out."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--preset", default="1.35b")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--checkpoint-dir", type=Path, default=Path("/var/tmp/tierstore-ckpt"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    shape = PRESETS[args.preset]
    torch.manual_seed(0)
    # The headline row's placement, set in full: under `auto` an 80 GB card takes the whole update and the profile
    # would show no swap traffic at all.
    config = row_config(HEADLINE_ROW, None)
    model, optimizer = offload(ExampleLM(shape), config)
    session = optimizer.session  # type: ignore[attr-defined]  # set by offload(), as in cli/train.py
    device = session.store.device
    batch = make_batch(BenchModel.from_preset(args.preset), device, 0)
    results: dict[str, object] = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    try:
        profiler = Profiler(session, measure_ceilings(session.store)).start()
        for _ in range(args.steps):
            loss = model(*batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            loss.item()
        optimizer.synchronize()
        profiler.stop()
        saved = profiler.save(args.out / "profile", trace=True, plot=True)
        results["profile_files"] = [str(f) for f in saved.files]
        results["profile_skipped"] = saved.skipped
        print((args.out / "profile" / "report.txt").read_text())
        ckpt, ceiling = checkpoint_figures(session, args.checkpoint_dir)
        results["checkpoint"] = ckpt
        results["disk"] = ceiling
        print(f"checkpoint of {ckpt['nbytes'] / 1e9:.1f} GB: save {ckpt['save_s']:.1f} s ({ckpt['save_GBps']:.2f} GB/s, "
              f"{ckpt['save_GBps'] / ceiling['write_GBps']:.2f} of dd write {ceiling['write_GBps']:.2f} GB/s), "
              f"verify {ckpt['verify_s']:.1f} s, load {ckpt['load_s']:.1f} s ({ckpt['load_GBps']:.2f} GB/s, "
              f"{ckpt['load_GBps'] / ceiling['read_GBps']:.2f} of dd read {ceiling['read_GBps']:.2f} GB/s; page cache may serve it)")
    finally:
        session.close()
    (args.out / "session_bench.json").write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
