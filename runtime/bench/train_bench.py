"""``tierstore bench train``: step time of the benchmark model, ours beside plain PyTorch and the bound.

Each row runs in its own process (a fresh GPU and a fresh pinned arena), all rows in one call, and one
table compares them. The bound of DESIGN.md, ``T_fwd + max(T_bwd, T_adam, T_pcie, T_nvme)``, is built from
terms measured in the same call: forward and backward of the model resident on the GPU (the plain row),
CPU fused AdamW over the same number of parameters with the runtime's thread count, and the PCIe and disk
bytes of one step over the bandwidth a raw copy reaches.

A tierstore row's step time is the median period between the ends of consecutive steps (no device sync in
between, as a training loop logging its loss runs); the plain and DeepSpeed rows sync at both ends of each
step, their work being synchronous with the step anyway. Each row also reports the CUDA allocator's
retries, cudaMalloc / cudaFree counts and peak reservation.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from runtime.example_model import PRESETS, ExampleLM, ModelShape

log = logging.getLogger(__name__)

ROWS = {
    "torch": "plain PyTorch, all on GPU, fused AdamW (fp32 masters)",
    "host": "tierstore: weights + optimizer on pinned host",
    "gpu-weights": "tierstore: weights on GPU, optimizer on pinned host",
    "nvme": "tierstore: weights + master on host, moments on NVMe",
    "nvme-auto": "tierstore: weights + master on host, moments in pinned RAM up to ds-zero3-nvme's peak RSS, the rest on NVMe",
    "host-accum8": "tierstore: weights + optimizer on host, accumulation 8",
    "torch-accum8": "plain PyTorch, accumulation 8",
    "ds-zero2-cpu": "DeepSpeed ZeRO-2, optimizer offloaded to CPU",
    "ds-zero3-cpu": "DeepSpeed ZeRO-3, params + optimizer offloaded to CPU",
    "ds-zero3-nvme": "DeepSpeed ZeRO-3, params on CPU, optimizer on NVMe (5 buffers, no pipelining)",
}
# Any tierstore row takes suffixes, in this order: -fNN: NN% of the parameters (the first blocks) updated on the GPU;
# -sNN: NN% (the next blocks) updated on the GPU over state streamed from host (optimizer.gpu_stream_fraction);
# -aN: the state of N streamed blocks brought in ahead of the block in backward (optimizer.gpu_stream_ahead);
# -tNN: NN CPU optimizer threads;
# -keep: every block's weights kept on the GPU from its forward to its backward (prefetch.keep_for_backward),
# -cap: the process's GPU memory capped at the peak the ds-zero2-cpu row reserved in the same call,
# -clip: global-norm clipping at 1.0 (optimizer.grad_clip),
# and -noseg: PyTorch's default allocator (our rows otherwise run with expandable_segments:True unless
# PYTORCH_CUDA_ALLOC_CONF is set).


def describe_row(row: str) -> str:
    """What a row runs, for the table."""
    base, fraction = split_row(row)
    text = ROWS[base]
    text += f", {fraction:.0%} of the update on the GPU" if fraction else ""
    options = row_options(row)[1]
    text += f", {options['s']}% updated on the GPU over state streamed from host" if "s" in options else ""
    text += f", {options['a']} streamed blocks ahead" if "a" in options else ""
    text += f", {options['t']} CPU optimizer threads" if "t" in options else ""
    text += ", weights kept for backward" if options.get("keep") else ""
    text += ", clipping at 1.0" if options.get("clip") else ""
    text += ", GPU memory capped at DeepSpeed ZeRO-2's peak" if options.get("cap") else ""
    return text + (", default CUDA allocator" if options.get("noseg") else "")


def row_options(row: str) -> tuple[str, dict[str, int | bool]]:
    """'host-f30-t15-keep-cap' -> ('host', {'f': 30, 't': 15, 'keep': True, 'cap': True}): the base row and
    its suffixes (-fNN GPU update share in percent, -sNN streamed GPU update share, -aN streamed blocks
    ahead, -tNN CPU optimizer threads, -keep, -cap, -noseg, -clip)."""
    parts = row.split("-")
    options: dict[str, int | bool] = {}
    while len(parts) > 1:
        last = parts[-1]
        if last in ("keep", "cap", "noseg", "clip"):
            options[last] = True
        elif last[:1] in ("f", "s", "a", "t") and last[1:].isdigit():
            options[last[0]] = int(last[1:])
        else:
            break
        parts.pop()
    return "-".join(parts), options


def split_row(row: str) -> tuple[str, float]:
    """'host-f50' -> ('host', 0.5): the base row and its GPU update share (other suffixes dropped)."""
    base, options = row_options(row)
    return base, int(options.get("f", 0)) / 100
SEQ_LEN = 1024
MICRO_BATCH = 8


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _batch(shape: ModelShape, device: torch.device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, shape.vocab_size, (MICRO_BATCH, SEQ_LEN + 1), generator=g)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def _torch_row(shape: ModelShape, steps: int, accumulation: int) -> dict[str, Any]:
    """Plain PyTorch: bf16 model + fp32 master weights on the GPU, fused AdamW; times fwd and bwd apart."""
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = ExampleLM(shape).to(device)
    params = list(model.parameters())
    masters = [p.detach().clone().float() for p in params]
    for m in masters:
        m.requires_grad_(True)
    model.to(torch.bfloat16)
    opt = torch.optim.AdamW(masters, lr=1e-4, weight_decay=0.01, fused=True)
    fwd_s, bwd_s, step_s = [], [], []
    batch = _batch(shape, device, 0)
    for step in range(steps):
        _sync()
        t0 = time.perf_counter()
        for _ in range(accumulation):
            ta = time.perf_counter()
            loss = model(*batch)
            _sync()
            tb = time.perf_counter()
            loss.backward()
            _sync()
            tc = time.perf_counter()
            fwd_s.append(tb - ta)
            bwd_s.append(tc - tb)
        for p, m in zip(params, masters):
            m.grad = p.grad.float()
            p.grad = None
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            torch._foreach_copy_(params, masters)
        _sync()
        step_s.append(time.perf_counter() - t0)
    warm = max(1, steps // 3)
    return {"step_s": statistics.median(step_s[warm:]), "fwd_s": statistics.median(fwd_s[warm:]),
            "bwd_s": statistics.median(bwd_s[warm:]), "loss": float(loss), "peak_gpu_nbytes": torch.cuda.max_memory_allocated()}


def _tierstore_row(shape: ModelShape, steps: int, config: dict[str, Any], accumulation: int) -> dict[str, Any]:
    from runtime import offload

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = ExampleLM(shape)
    config.setdefault("optimizer", {})["accumulation_steps"] = accumulation
    t_setup = time.perf_counter()
    model, opt = offload(model, config, record_intervals=True)
    setup_s = time.perf_counter() - t_setup
    session = opt.session
    disk = {"read": 0, "write": 0}

    def count_disk(event: Any) -> None:
        if event.kind in disk:
            disk[event.kind] += event.nbytes

    session.store.bus.subscribe(count_disk)
    batch = _batch(shape, device, 0)
    step_s, wait_update, wait_fetch = [], [], []
    disk_read, disk_write = [], []
    losses = []
    try:
        # A step's time is the period between the ends of consecutive steps, as a training loop that logs its
        # loss sees it: no device sync between steps, so copies still in flight at a step's end (state written
        # back, weights refreshed) run into the next step and are charged wherever they delay it.
        _sync()
        t0 = time.perf_counter()
        for step in range(steps):
            c = session.controller.stats
            u0, f0 = c.wait_update_s, c.wait_fetch_s
            r0, w0 = disk["read"], disk["write"]
            for _ in range(accumulation):
                loss = model(*batch)
                loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())  # the loss of this step's forward: a host sync on the GPU work
            t1 = time.perf_counter()
            step_s.append(t1 - t0)
            t0 = t1
            wait_update.append(c.wait_update_s - u0)
            wait_fetch.append(c.wait_fetch_s - f0)
            disk_read.append(disk["read"] - r0)
            disk_write.append(disk["write"] - w0)
        opt.synchronize()
        stats = session.controller.schedule.stats
        worker = session.controller.worker.stats
        pinned = session.store.tiers[list(session.store.tiers)[1]].capacity_nbytes
        spilled = len(session.controller.options.spilled_blocks)
    finally:
        session.close()
    warm = max(1, steps // 3)
    return {"step_s": statistics.median(step_s[warm:]), "setup_s": setup_s, "loss_first": losses[0], "loss_last": losses[-1],
            "wait_update_s": statistics.median(wait_update[warm:]), "wait_fetch_s": statistics.median(wait_fetch[warm:]),
            "hit_rate": stats.hit_rate, "adam_s_total": worker.adam_s, "jobs": worker.jobs,
            "peak_gpu_nbytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0,
            "pinned_nbytes": pinned, "disk_read_nbytes": statistics.median(disk_read[warm:]),
            "disk_write_nbytes": statistics.median(disk_write[warm:]), "spilled_blocks": spilled}


def peak_rss_nbytes() -> int:
    """This process's peak resident set so far (ru_maxrss, KiB on Linux)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss_nbytes() -> int:
    """This process's resident set now."""
    import psutil

    return int(psutil.Process().memory_info().rss)


def measure_adam_s(num_params: int, threads: int) -> float:
    """Seconds for one CPU fused AdamW step over num_params fp32 parameters (the whole model's worth of
    memory, so caches and NUMA behave as in training), median of three after a warm-up."""
    from runtime.adam import AdamWHyper, adamw_update

    torch.set_num_threads(threads)
    p, g, m, v = (torch.empty(num_params).uniform_(0.5, 1.0) for _ in range(4))
    steps = [torch.zeros(())]
    adamw_update([p], [g], [m], [v], steps, AdamWHyper())
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        adamw_update([p], [g], [m], [v], steps, AdamWHyper())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_pcie_gbps(nbytes: int = 1 << 30) -> tuple[float, float]:
    """Raw pinned copy bandwidth (H2D, D2H) in GB/s."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = []
    for to_dev in (True, False):
        best = float("inf")
        for _ in range(3):
            _sync()
            t0 = time.perf_counter()
            (dev.copy_(host, non_blocking=True) if to_dev else host.copy_(dev, non_blocking=True))
            _sync()
            best = min(best, time.perf_counter() - t0)
        out.append(nbytes / best / 1e9)
    return out[0], out[1]


def _row_config(row: str, nvme_dir: str | None) -> dict[str, Any]:
    row, options = row_options(row)
    base: dict[str, Any] = {"dtype": "bf16", "optimizer": {"grad_clip": 1.0 if options.get("clip") else None, "lr": 1e-4,
                                                           "gpu_update_fraction": int(options.get("f", 0)) / 100,
                                                           "cpu_threads": options.get("t", "auto"),
                                                           "gpu_stream_fraction": int(options.get("s", 0)) / 100},
                            "prefetch": {"depth": 2, "keep_for_backward": "4GiB" if options.get("keep") else 0}}
    if "a" in options:
        base["optimizer"]["gpu_stream_ahead"] = int(options["a"])
    if row in ("host", "host-accum8"):
        base["placement"] = {"weights": "host", "master": "host", "moments": "host"}
    elif row == "gpu-weights":
        base["placement"] = {"weights": "gpu", "master": "host", "moments": "host"}
    elif row in ("nvme", "nvme-auto"):
        base["placement"] = {"weights": "host", "master": "host", "moments": "nvme" if row == "nvme" else "auto"}
        base["tiers"] = {"nvme": {"path": nvme_dir or "tmp", "budget": "48GiB", "io_threads": 8}}
    return base


def run_row(row: str, preset: str, steps: int, nvme_dir: str | None, gpu_cap_nbytes: int | None = None,
            host_cap_nbytes: int | None = None) -> dict[str, Any]:
    """Run one row in this process. ``host_cap_nbytes``: the peak RSS this row's process may reach (the pinned
    arena is what is left of it after what the process holds before offload and the host-built model)."""
    result = _run_row(row, preset, steps, nvme_dir, gpu_cap_nbytes, host_cap_nbytes)
    result["peak_rss_nbytes"] = peak_rss_nbytes()
    result.update(allocator_counters())
    return result


def allocator_counters() -> dict[str, int]:
    """The CUDA caching allocator's counters for the whole row: how often it gave memory back to the driver
    to satisfy a request (each time a device-wide synchronize), cudaMalloc / cudaFree calls, peak reserved."""
    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats()
    return {"alloc_retries": int(stats.get("num_alloc_retries", 0)), "device_allocs": int(stats.get("num_device_alloc", 0)),
            "device_frees": int(stats.get("num_device_free", 0)), "peak_gpu_reserved_nbytes": torch.cuda.max_memory_reserved()}


def _run_row(row: str, preset: str, steps: int, nvme_dir: str | None, gpu_cap_nbytes: int | None,
             host_cap_nbytes: int | None) -> dict[str, Any]:
    shape = PRESETS[preset]
    accumulation = 8 if split_row(row)[0].endswith("accum8") else 1
    if gpu_cap_nbytes:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, gpu_cap_nbytes / total))
    if row.startswith("torch"):
        return _torch_row(shape, steps, accumulation)
    if row.startswith("ds-"):
        from runtime.bench.deepspeed_rows import run_deepspeed_row

        return run_deepspeed_row(row, shape, steps, _batch(shape, torch.device("cuda"), 0), MICRO_BATCH, nvme_dir)
    config = _row_config(row, nvme_dir)
    if gpu_cap_nbytes:
        config.setdefault("tiers", {}).setdefault("gpu", {})["budget"] = gpu_cap_nbytes
    if host_cap_nbytes:
        if torch.cuda.is_available():
            torch.cuda.init()  # the CUDA context's host memory counts against the cap too
        # Left for the arena: the cap less what the process holds now, the fp32 model the row builds on the
        # host next (its pages are freed only as the arena fills), and 1 GiB of margin.
        model_nbytes = 4 * shape.num_params
        config.setdefault("tiers", {}).setdefault("host", {})["budget"] = host_cap_nbytes - current_rss_nbytes() - model_nbytes - (1 << 30)
    return _tierstore_row(shape, steps, config, accumulation)


def main(args: argparse.Namespace) -> int:
    """Run every requested row in its own process, measure the bound's terms, print one table."""
    if not torch.cuda.is_available():
        raise ValueError("tierstore bench train times training on a GPU against plain PyTorch and DeepSpeed there, and "
                         "this machine has no CUDA device (torch.cuda.is_available() is False); run it on a GPU "
                         "machine (`tierstore train` trains on the CPU)")
    rows = list(ROWS) if args.rows == "all" else args.rows.split(",")
    unknown = [r for r in rows if split_row(r)[0] not in ROWS or (r.startswith("torch") and split_row(r)[1])]
    if unknown:
        raise ValueError(f"unknown rows {unknown}; choose from {list(ROWS)}")
    shape = PRESETS[args.preset]
    results: dict[str, Any] = {}
    for row in rows:
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            cmd = [sys.executable, "-m", "runtime.bench.train_bench", "--row", row, "--preset", args.preset,
                   "--steps", str(args.steps), "--out", out.name]
            if args.nvme_dir:
                cmd += ["--nvme-dir", args.nvme_dir]
            if row_options(row)[1].get("cap"):
                cap = results.get("ds-zero2-cpu", {}).get("peak_gpu_reserved_nbytes")
                if not cap:
                    results[row] = {"error": "needs the ds-zero2-cpu row earlier in the same call"}
                    continue
                cmd += ["--gpu-cap", str(cap)]
            if row == "nvme-auto":
                rss = results.get("ds-zero3-nvme", {}).get("peak_rss_nbytes")
                if not rss:
                    results[row] = {"error": "needs the ds-zero3-nvme row earlier in the same call"}
                    continue
                cmd += ["--host-cap", str(rss)]
            if row.startswith("ds-"):
                from runtime.bench.deepspeed_rows import deepspeed_available

                if not deepspeed_available():
                    results[row] = {"error": "deepspeed is not importable"}
                    continue
            log.info("running row %s", row)
            env = dict(os.environ)
            if row_options(row)[1].get("noseg"):
                env["PYTORCH_CUDA_ALLOC_CONF"] = ""
            elif not row.startswith(("torch", "ds-")):
                env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if proc.returncode != 0:
                print(f"row {row} failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
                results[row] = {"error": proc.stderr[-500:]}
                continue
            results[row] = json.loads(Path(out.name).read_text())
    from runtime.api import default_cpu_threads

    threads = default_cpu_threads()
    terms: dict[str, float] = {}
    if "torch" in results and "error" not in results["torch"]:
        terms["T_fwd"] = results["torch"]["fwd_s"]
        terms["T_bwd"] = results["torch"]["bwd_s"]
    terms["T_adam"] = measure_adam_s(shape.num_params, threads)
    if torch.cuda.is_available():
        h2d, d2h = measure_pcie_gbps()
        # Per step: the fp32 master of every block goes H2D twice (forward and backward), fp32 grads D2H once.
        terms["T_pcie"] = max(2 * 4 * shape.num_params / (h2d * 1e9), 4 * shape.num_params / (d2h * 1e9))
        terms["h2d_gbps"], terms["d2h_gbps"] = h2d, d2h
    if args.nvme_dir and any(r.startswith("nvme") for r in rows):
        from runtime.bench.store_bench import _dd_ceiling

        block = 64 << 20
        write_s, read_s, _ = _dd_ceiling(Path(args.nvme_dir), 32, block, direct=True, repeats=2)
        terms["disk_read_gbps"], terms["disk_write_gbps"] = 32 * block / read_s / 1e9, 32 * block / write_s / 1e9
    print(format_table(rows, results, terms, shape), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                                         "preset": args.preset, "terms": terms, "rows": results}, indent=2))
    return 0


def format_table(rows: list[str], results: dict[str, Any], terms: dict[str, float], shape: ModelShape) -> str:
    """The comparison table: s/step, tokens/s, ratio to the plain row and to the bound."""
    tokens = MICRO_BATCH * SEQ_LEN
    bound = None
    if {"T_fwd", "T_bwd", "T_adam"} <= terms.keys():
        bound = terms["T_fwd"] + max(terms["T_bwd"], terms["T_adam"], terms.get("T_pcie", 0.0))
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    width = max([14] + [len(r) + 2 for r in rows])
    lines = [f"bench train on {name}: {shape.num_params / 1e9:.2f}B params, seq {SEQ_LEN}, micro-batch {MICRO_BATCH}, bf16",
             "terms: " + ", ".join(f"{k} {v:.3f}" for k, v in terms.items()),
             f"bound T_fwd + max(T_bwd, T_adam, T_pcie) = {bound:.3f} s" if bound else "bound: needs the torch row",
             f"{'row':<{width}}{'s/step':>8}{'tok/s':>9}{'TFLOP/s':>9}{'vs torch':>10}{'vs bound':>10}{'GPU GiB':>9}"
             f"{'RSS GiB':>9}{'pinned':>8}  what"]
    base = results.get("torch", {}).get("step_s")
    base_accum = results.get("torch-accum8", {}).get("step_s")
    for row in rows:
        r = results.get(row, {})
        if "error" in r or "step_s" not in r:
            lines.append(f"{row:<{width}}{'failed':>8}  {failure_reason(r.get('error', 'no result'))}")
            continue
        accum = 8 if split_row(row)[0].endswith("accum8") else 1
        tps = tokens * accum / r["step_s"]
        reference = base_accum / accum if accum > 1 and base_accum else base
        vs_torch = f"{reference * accum / r['step_s']:.2f}x" if reference and not row.startswith("torch") else "-"
        vs_bound = f"{r['step_s'] / bound:.2f}" if bound and accum == 1 and not row.startswith(("torch", "ds-")) else "-"
        tflops = 6 * shape.num_params * tps / 1e12  # model FLOPs: 6 per parameter per token (no attention term)
        pinned = f"{r['pinned_nbytes'] / 2**30:.1f}" if r.get("pinned_nbytes") else "-"
        lines.append(f"{row:<{width}}{r['step_s']:>8.3f}{tps:>9.0f}{tflops:>9.1f}{vs_torch:>10}{vs_bound:>10}"
                     f"{r.get('peak_gpu_nbytes', 0) / 2**30:>9.1f}{r.get('peak_rss_nbytes', 0) / 2**30:>9.1f}{pinned:>8}  {describe_row(row)}")
    lines += [f"allocator {row}: {r['alloc_retries']} retries (cached memory given back under pressure), "
              f"{r['device_allocs']} cudaMalloc / {r['device_frees']} cudaFree, peak reserved {r['peak_gpu_reserved_nbytes'] / 2**30:.1f} GiB"
              for row in rows if "alloc_retries" in (r := results.get(row, {}))]
    lines += _versus_deepspeed(results)
    lines += _disk_efficiency(results, terms)
    return "\n".join(lines)


def failure_reason(error: str) -> str:
    """The line of a failed row's stderr that says why: the error's own message (a traceback's last line,
    or tierstore's ``error:`` line), not the frames above it."""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    for line in reversed(lines):
        if line.split(":")[0].endswith(("Error", "Exception")) or "error:" in line.lower():
            return line[:200]
    return lines[-1][:200] if lines else "failed without a message"


def _disk_efficiency(results: dict[str, Any], terms: dict[str, float]) -> list[str]:
    """For rows that touched the disk: the seconds the raw ceiling (dd, O_DIRECT, same directory, same call)
    needs to read and then write one step's bytes, over the measured step time."""
    if "disk_read_gbps" not in terms:
        return []
    out = []
    for row, r in results.items():
        if r.get("disk_read_nbytes") or r.get("disk_write_nbytes"):
            t_nvme = r["disk_read_nbytes"] / (terms["disk_read_gbps"] * 1e9) + r["disk_write_nbytes"] / (terms["disk_write_gbps"] * 1e9)
            out.append(f"disk {row}: {r['disk_read_nbytes'] / 1e9:.1f} GB read + {r['disk_write_nbytes'] / 1e9:.1f} GB written per step; "
                       f"T_nvme at the raw ceiling {t_nvme:.2f} s = {t_nvme / r['step_s']:.0%} of the step"
                       + (f"; moments of {r['spilled_blocks']} blocks spilled to NVMe" if r.get("spilled_blocks") else ""))
    return out


def _versus_deepspeed(results: dict[str, Any]) -> list[str]:
    """Tokens/s ratios of our rows over each DeepSpeed row of the same call."""
    out = []
    ours = {r: v["step_s"] for r, v in results.items() if not r.startswith(("torch", "ds-")) and "step_s" in v
            and not split_row(r)[0].endswith("accum8")}
    for ds_row, ds in results.items():
        if ds_row.startswith("ds-") and "step_s" in ds and ours:
            pairs = ", ".join(f"{r} {ds['step_s'] / s:.2f}x" for r, s in ours.items())
            out.append(f"tokens/s vs {ds_row} ({ds['step_s']:.3f} s/step): {pairs}")
    return out


def _child() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--row", required=True)
    parser.add_argument("--preset", default="1.35b")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", required=True)
    parser.add_argument("--nvme-dir")
    parser.add_argument("--gpu-cap", type=int)
    parser.add_argument("--host-cap", type=int)
    a = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    result = run_row(a.row, a.preset, a.steps, a.nvme_dir, a.gpu_cap, a.host_cap)
    Path(a.out).write_text(json.dumps(result))


if __name__ == "__main__":
    _child()
