"""``tierstore bench train``: step time of a model of the user's shape, ours beside plain PyTorch, DeepSpeed
and each row's own lower bound.

Each row runs in its own process (a fresh GPU and a fresh pinned arena), all rows in one call, and one
table compares them. The model (``--model example|hf-llama`` and its shape, ``runtime.bench.train_model``)
is the same for every row; so is the batch. Rows and their suffixes are named in ``runtime.bench.train_rows``.

Each row's "of bound" is its lower bound over its measured step (``runtime.bench.train_bound``): under the
row's own placement, ``max(T_gpu, T_cpu_adam, T_h2d, T_d2h, T_nvme)``, each term the row's work on one
resource over a rate measured in the same call (forward and backward of the plain row, fused AdamW on the
GPU and on the CPU, raw pinned copies each way, the raw disk ceiling). A tierstore row reports the placement
its session resolved (so ``-auto`` rows are bounded by what the runtime chose) and the bytes it actually
moved per step, printed beside the accounting.

A tierstore row's step time is the median period between the ends of consecutive steps (no device sync in
between, as a training loop logging its loss runs); the plain and DeepSpeed rows sync at both ends of each
step, their work being synchronous with the step anyway. Each row also reports the CUDA allocator's
retries, cudaMalloc / cudaFree counts and peak reservation, and -clip rows the fraction of measured steps
whose clip coefficient was below 1 (steps that clip do different work from steps that do not).
"""

from __future__ import annotations

import argparse
import dataclasses
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

from runtime.bench import synchronize
from runtime.bench.train_bound import (
    Bound,
    Rates,
    RowPlacement,
    measure_cpu_adam_s_per_param,
    measure_disk_gbps,
    measure_gpu_adam_s_per_param,
    measure_pcie_gbps,
    plain_placement,
    row_bound,
    tierstore_placement,
)
from runtime.bench.train_model import BenchModel, batch_loss, build_model, count_params, make_batch, spec_num_params
from runtime.bench.train_rows import CLIP_NORM, ROWS, accumulation_of, describe_row, is_tierstore, row_config, row_errors, row_options
from runtime.config.units import approx_size
from runtime.planning.measured_placement import first_step_listener

log = logging.getLogger(__name__)

CLIP_EPS = 1e-6  # the clip coefficient is max_norm / (norm + eps), as torch and the runtime compute it
HOST_CAP_ROWS = ("ds-zero3-cpu", "ds-zero3-nvme")  # whose peak RSS caps nvme-auto, first found first


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def clipped_fraction(norms: list[float | None], max_norm: float = CLIP_NORM) -> float | None:
    """Fraction of steps whose clip coefficient ``max_norm / (norm + 1e-6)`` was below 1; None without norms."""
    known = [n for n in norms if n is not None]
    if not known:
        return None
    return sum(max_norm / (n + CLIP_EPS) < 1 for n in known) / len(known)


def _torch_row(spec: BenchModel, steps: int, accumulation: int, clip: bool) -> dict[str, Any]:
    """Plain PyTorch: bf16 model + fp32 master weights on the device, fused AdamW (after clip_grad_norm_ over
    the masters with ``clip``); times forward and backward apart."""
    device = _device()
    model = build_model(spec).to(device)
    num_params = count_params(model)
    params: list[torch.Tensor] = list(model.parameters())
    masters = [p.detach().clone().float().requires_grad_(True) for p in params]
    model.to(torch.bfloat16)
    opt = torch.optim.AdamW(masters, lr=1e-4, weight_decay=0.01, fused=True)
    fwd_s, bwd_s, step_s, norms = [], [], [], []
    batch = make_batch(spec, device, 0)
    for _ in range(steps):
        synchronize()
        t0 = time.perf_counter()
        for _ in range(accumulation):
            ta = time.perf_counter()
            loss = batch_loss(spec, model, batch)
            synchronize()
            tb = time.perf_counter()
            loss.backward()
            synchronize()
            tc = time.perf_counter()
            fwd_s.append(tb - ta)
            bwd_s.append(tc - tb)
        for p, m in zip(params, masters, strict=True):
            assert p.grad is not None  # every parameter of a bench model takes part in its loss
            m.grad = p.grad.float()
            p.grad = None
        if clip:
            norms.append(torch.nn.utils.clip_grad_norm_(masters, CLIP_NORM))  # read after the loop: no extra sync
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            torch._foreach_copy_(params, masters)
        synchronize()
        step_s.append(time.perf_counter() - t0)
    warm = max(1, steps // 3)
    return {"step_s": statistics.median(step_s[warm:]), "fwd_s": statistics.median(fwd_s[warm * accumulation:]),
            "bwd_s": statistics.median(bwd_s[warm * accumulation:]), "loss": loss.item(), "num_params": num_params,
            "grad_norms": [float(n) for n in norms[warm:]], "placement": plain_placement(num_params, accumulation).as_dict(),
            "peak_gpu_nbytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0}


def session_placement(session: Any, accumulation: int) -> RowPlacement:
    """The placement an offload session resolved (``-auto`` rows included), for the bound."""
    controller = session.controller
    options = controller.options
    blocks = sorted(session.blocks, key=lambda b: b.index)
    if [b.index for b in blocks] != list(range(len(blocks))):
        raise RuntimeError(f"block indices {[b.index for b in blocks]} are not 0..{len(blocks) - 1}")
    return tierstore_placement(block_numels=[b.numel for b in blocks], gpu_updated=controller.gpu_updated,
                               streamed=controller.gpu_streamed, weight_source=options.weight_source.value,
                               homes={k: v.value for k, v in options.homes.items()}, spilled=options.spilled_blocks,
                               keep_nbytes=options.keep_for_backward_nbytes,
                               compute_elem_nbytes=torch.empty((), dtype=options.compute_dtype).element_size(),
                               accumulation=accumulation, cpu_threads=options.cpu_threads,
                               prefetch_depth=options.prefetch_depth, prefetch_budget_nbytes=options.prefetch_budget_nbytes,
                               moment_nbytes=[session.store.record(b.key("exp_avg")).meta.nbytes for b in blocks])


def _tierstore_row(spec: BenchModel, steps: int, config: dict[str, Any], accumulation: int,
                   host_cap_nbytes: int | None, nopace: bool = False) -> dict[str, Any]:
    """Train through ``runtime.offload``. ``host_cap_nbytes``: the peak RSS the process may reach; the pinned
    arena gets what is left of it after what the process holds with the model built, less 1 GiB of margin."""
    from runtime import offload

    device = _device()
    model = build_model(spec)
    num_params = count_params(model)
    config.setdefault("optimizer", {})["accumulation_steps"] = accumulation
    if host_cap_nbytes:
        if torch.cuda.is_available():
            torch.cuda.init()  # the CUDA context's host memory counts against the cap too
        config.setdefault("tiers", {}).setdefault("host", {})["budget"] = host_cap_nbytes - current_rss_nbytes() - (1 << 30)
    t_setup = time.perf_counter()
    model, opt = offload(model, config, record_intervals=True)
    setup_s = time.perf_counter() - t_setup
    session = opt.session  # type: ignore[attr-defined]  # set by offload(), as in cli/train.py
    session.controller.pace_writebacks = not nopace
    moved = {"h2d": 0, "d2h": 0, "read": 0, "write": 0}

    def count(event: Any) -> None:
        if event.kind in moved:
            moved[event.kind] += event.nbytes

    session.store.bus.subscribe(count)
    batch = make_batch(spec, device, 0)
    step_s, wait_update, wait_fetch, losses = [], [], [], []
    per_step: dict[str, list[int]] = {kind: [] for kind in moved}
    try:
        # A step's time is the period between the ends of consecutive steps, as a training loop that logs its
        # loss sees it: no device sync between steps, so copies still in flight at a step's end (state written
        # back, weights refreshed) run into the next step and are charged wherever they delay it.
        synchronize()
        t0 = time.perf_counter()
        held_per_step, scale_per_step, kernel_per_step = [], [], []
        for _ in range(steps):
            c = session.controller.stats
            u0, f0, before = c.wait_update_s, c.wait_fetch_s, dict(moved)
            h0, s0, k0 = c.held_grads, session.controller.worker.stats.scale_s, session.controller.worker.stats.kernel_s
            for _ in range(accumulation):
                loss = batch_loss(spec, model, batch)
                loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())  # the loss of this step's forward: a host sync on the GPU work
            t1 = time.perf_counter()
            step_s.append(t1 - t0)
            t0 = t1
            wait_update.append(c.wait_update_s - u0)
            wait_fetch.append(c.wait_fetch_s - f0)
            held_per_step.append(c.held_grads - h0)
            # The worker's multiplies between the last step's end and this one's: mostly the last step's jobs (they
            # run after its step() returns); the final step's own are not counted.
            scale_per_step.append(session.controller.worker.stats.scale_s - s0)
            kernel_per_step.append(session.controller.worker.stats.kernel_s - k0)  # likewise
            for kind in moved:
                per_step[kind].append(moved[kind] - before[kind])
        opt.synchronize()
        controller = session.controller
        norms = list(controller.stats.grad_norms)[-steps:] if config["optimizer"].get("grad_clip") else []
        placement = session_placement(session, accumulation)
        pinned = session.store.tiers[list(session.store.tiers)[1]].capacity_nbytes
        spilled = len(controller.options.spilled_blocks)
        hit_rate, worker = controller.schedule.stats.hit_rate, controller.worker.stats
        writeback_waits = (controller.writebacks.waits, controller.writebacks.wait_s)
        hosted = controller.host_updated_blocks
        host_blocks, host_numel = len(hosted), sum(block.numel for block in hosted)
        notes = list(session.plan.notes or ())
        first_step = first_step_listener(controller.step_listeners)
        measured = first_step.measured_steps if first_step is not None else 0
    finally:
        session.close()
    # Warm-up: a third of the steps, and at least the steps auto placement measured before placing the state (two
    # with a recompute trial), all of them updated on the CPU; one step is always left to time.
    warm = min(max(1, steps // 3, measured), steps - 1)
    return {"step_s": statistics.median(step_s[warm:]), "setup_s": setup_s, "warm_steps": warm, "loss_first": losses[0],
            "loss_last": losses[-1],
            "num_params": num_params, "grad_norms": norms[warm:], "placement": placement.as_dict(),
            "wait_update_s": statistics.median(wait_update[warm:]), "wait_fetch_s": statistics.median(wait_fetch[warm:]),
            "hit_rate": hit_rate, "adam_s_total": worker.adam_s, "kernel_s_total": worker.kernel_s, "jobs": worker.jobs,
            "scale_s_total": worker.scale_s, "refresh_s_total": worker.refresh_s, "wait_inputs_s_total": worker.wait_inputs_s,
            "peak_gpu_nbytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0,
            "pinned_nbytes": pinned, "spilled_blocks": spilled, "placement_notes": notes, "steps_s": step_s,
            "writeback_waits": writeback_waits,  # forwards that waited for streamed state to go home, seconds
            # Host gradients held on the device until each commit ([Note: held gradients]) of the host_blocks, and
            # the worker's seconds multiplying by clip factors during each step (mostly the step before's jobs).
            "held_per_step": held_per_step, "host_blocks": host_blocks, "scale_s_per_step": scale_per_step,
            # The CPU's AdamW kernel seconds between step ends (mostly the step before's jobs) over the parameters
            # it updates a step (as placed at the end): its rate inside the step, beside the copies.
            "kernel_s_per_step": kernel_per_step, "host_numel": host_numel,
            # A mean, not a median: IO completing after its step's end is counted in the next one.
            "moved_nbytes": {kind: statistics.mean(values[warm:]) for kind, values in per_step.items()}}


def peak_rss_nbytes() -> int:
    """This process's peak resident set so far (ru_maxrss, KiB on Linux)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss_nbytes() -> int:
    """This process's resident set now."""
    import psutil

    return int(psutil.Process().memory_info().rss)


def allocator_counters() -> dict[str, int]:
    """The CUDA caching allocator's counters for the whole row: how often it gave memory back to the driver
    to satisfy a request (each time a device-wide synchronize), cudaMalloc / cudaFree calls, peak reserved."""
    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats()
    return {"alloc_retries": int(stats.get("num_alloc_retries", 0)), "device_allocs": int(stats.get("num_device_alloc", 0)),
            "device_frees": int(stats.get("num_device_free", 0)), "peak_gpu_reserved_nbytes": torch.cuda.max_memory_reserved()}


def run_row(row: str, spec: BenchModel, steps: int, nvme_dir: str | None, gpu_cap_nbytes: int | None = None,
            host_cap_nbytes: int | None = None) -> dict[str, Any]:
    """Run one row in this process (``tierstore bench train`` gives each its own)."""
    accumulation = accumulation_of(row)
    clip = bool(row_options(row)[1].get("clip"))
    if row_options(row)[1].get("ckpt"):
        spec = dataclasses.replace(spec, checkpointing=True)
    if gpu_cap_nbytes:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, gpu_cap_nbytes / total))
    if row.startswith("torch"):
        result = _torch_row(spec, steps, accumulation, clip)
    elif row.startswith("ds-"):
        from runtime.bench.deepspeed_rows import run_deepspeed_row

        result = run_deepspeed_row(row, spec, steps, nvme_dir)
    else:
        config = row_config(row, nvme_dir)
        if gpu_cap_nbytes:
            config.setdefault("tiers", {}).setdefault("gpu", {})["budget"] = gpu_cap_nbytes
        result = _tierstore_row(spec, steps, config, accumulation, host_cap_nbytes,
                                nopace=bool(row_options(row)[1].get("nopace")))
    result["clipped"] = clipped_fraction(result.pop("grad_norms", [])) if clip else None
    result["peak_rss_nbytes"] = peak_rss_nbytes()
    result.update(allocator_counters())
    return result


def _measured(results: dict[str, Any], base: str, key: str) -> tuple[int, str] | None:
    """``key`` of the first row of the call whose base row is ``base`` (-clip or not: it does not change memory;
    never a -ckpt row, whose activations take far less), with that row's name; None when no such row succeeded."""
    for row, result in results.items():
        base_row, options = row_options(row)
        if base_row == base and not options.get("ckpt") and result.get(key):
            return int(result[key]), row
    return None


def _host_cap(results: dict[str, Any]) -> tuple[int, str] | None:
    """nvme-auto's RSS cap: ds-zero3-cpu's peak RSS (the same host RAM as ZeRO-3 CPU offload, the rest on
    NVMe), else ds-zero3-nvme's; with the row it came from."""
    for base in HOST_CAP_ROWS:
        found = _measured(results, base, "peak_rss_nbytes")
        if found:
            return found
    return None


def _child_command(row: str, spec: BenchModel, args: argparse.Namespace, out: str,
                   results: dict[str, Any]) -> list[str] | str:
    """The command line of a row's process, or why the row cannot run."""
    cmd = [sys.executable, "-m", "runtime.bench.train_bench", "--row", row, "--spec", spec.to_json(),
           "--steps", str(args.steps), "--out", out]
    if args.nvme_dir:
        cmd += ["--nvme-dir", args.nvme_dir]
    if row_options(row)[1].get("cap"):
        cap = (args.gpu_cap, "--gpu-cap") if args.gpu_cap else \
            _measured(results, "ds-zero2-cpu", "peak_gpu_reserved_nbytes")
        if cap is None:
            return "needs the ds-zero2-cpu row (without -ckpt) earlier in the same call, or --gpu-cap"
        cmd += ["--gpu-cap", str(cap[0])]
    if row_options(row)[0] == "nvme-auto":
        host_cap = _host_cap(results)
        if host_cap is None:
            return "needs the ds-zero3-cpu (or ds-zero3-nvme) row (without -ckpt) earlier in the same call"
        cmd += ["--host-cap", str(host_cap[0])]
    if row.startswith("ds-"):
        from runtime.bench.deepspeed_rows import deepspeed_available

        if not deepspeed_available():
            return "deepspeed is not importable"
    return cmd


def run_rows(rows: list[str], spec: BenchModel, args: argparse.Namespace) -> dict[str, Any]:
    """Each row in its own process, in order; a row's result or its error."""
    results: dict[str, Any] = {}
    for row in rows:
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            cmd = _child_command(row, spec, args, out.name, results)
            host_cap = _host_cap(results)
            if isinstance(cmd, str):
                results[row] = {"error": cmd}
                continue
            log.info("running row %s", row)
            env = dict(os.environ)
            if row_options(row)[1].get("noseg"):
                env["PYTORCH_CUDA_ALLOC_CONF"] = ""
            elif is_tierstore(row):
                env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if proc.returncode != 0:
                print(f"row {row} failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
                results[row] = {"error": proc.stderr[-500:]}
                continue
            results[row] = json.loads(Path(out.name).read_text())
            if row_options(row)[0] == "nvme-auto" and host_cap is not None:
                results[row]["host_cap_from"] = host_cap[1]
            # Each row's figure as it lands: a run stopped before the table (a time limit) still shows it.
            steps_s = results[row].get("steps_s") or []
            log.info("row %s: %.3f s/step (steps: %s)", row, results[row]["step_s"], ", ".join(f"{x:.3f}" for x in steps_s))
    return results


def measure_rates(results: dict[str, Any], num_params: int, nvme_dir: str | None, default_threads: int) -> Rates:
    """The bound's rates, measured now (the rows' processes have ended: the GPU and the cores are free)."""
    # The fastest forward + backward of the plain rows: the compute term of a lower bound may not carry the
    # noise of one row's measurement (its own clipping or accumulation does not change fwd and bwd). Not a -ckpt
    # row's, whose backward includes a recomputed forward: the bound of a -ckpt row then leaves that out (a
    # lower bound still, looser), and no other row's bound gains a recompute it never does.
    plain = min((r for row, r in results.items()
                 if row.startswith("torch") and not row_options(row)[1].get("ckpt") and "fwd_s" in r),
                key=lambda r: r["fwd_s"] + r["bwd_s"], default=None)
    placements = [RowPlacement(**r["placement"]) for r in results.values() if "placement" in r]
    threads = sorted({p.cpu_threads or default_threads for p in placements if p.cpu_update_numel})
    log.info("measuring the bound's rates: CPU AdamW at %s threads, GPU AdamW, pinned copies, disk", threads)
    cpu = {t: measure_cpu_adam_s_per_param(num_params, t) for t in threads}
    disk: tuple[float | None, float | None] = (None, None)
    if nvme_dir and any(p.disk_state_nbytes for p in placements):
        disk = measure_disk_gbps(nvme_dir)
    cuda = torch.cuda.is_available()
    h2d, d2h = measure_pcie_gbps() if cuda else (None, None)
    return Rates(fwd_s=plain["fwd_s"] if plain else None, bwd_s=plain["bwd_s"] if plain else None,
                 gpu_adam_s_per_param=measure_gpu_adam_s_per_param(num_params, _device()),
                 cpu_adam_s_per_param=cpu, h2d_gbps=h2d, d2h_gbps=d2h, disk_read_gbps=disk[0], disk_write_gbps=disk[1])


def main(args: argparse.Namespace) -> int:
    """Run every requested row in its own process, measure the bound's rates, print one table."""
    if not torch.cuda.is_available():
        raise ValueError("tierstore bench train times training on a GPU against plain PyTorch and DeepSpeed there, and "
                         "this machine has no CUDA device (torch.cuda.is_available() is False); run it on a GPU "
                         "machine (`tierstore train` trains on the CPU)")
    rows = list(ROWS) if args.rows == "all" else args.rows.split(",")
    errors = row_errors(rows)
    if errors:
        raise ValueError("unusable rows: " + "; ".join(errors))
    spec = BenchModel.from_args(args)
    num_params = spec_num_params(spec)
    results = run_rows(rows, spec, args)
    from runtime.planning.settings import default_cpu_threads

    threads = default_cpu_threads()
    rates = measure_rates(results, num_params, args.nvme_dir, threads)
    bounds = {row: row_bound(RowPlacement(**r["placement"]), rates, threads, r.get("moved_nbytes"))
              for row, r in results.items() if "placement" in r}
    print(format_table(rows, results, bounds, rates, spec, num_params), flush=True)
    if args.json:
        args.json.write_text(json.dumps({
            "device": torch.cuda.get_device_name(), "model": json.loads(spec.to_json()), "num_params": num_params,
            "rates": rates.__dict__, "bounds": {row: {"terms": b.terms, "seconds": b.seconds, "accounted": b.traffic.__dict__,
                                                      "nbytes": b.nbytes} for row, b in bounds.items()},
            "rows": results}, indent=2))
    return 0


def format_table(rows: list[str], results: dict[str, Any], bounds: dict[str, Bound], rates: Rates, spec: BenchModel,
                 num_params: int) -> str:
    """The comparison table: s/step, tokens/s, ratio to the plain row, fraction of the row's bound reached,
    clipped steps; then each row's bound with its terms and bytes, allocator counters, DeepSpeed ratios."""
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    width = max([14] + [len(r) + 2 for r in rows])
    lines = [f"bench train on {name}: {_count(num_params)} params ({spec.describe()}), bf16",
             "rates: " + _describe_rates(rates),
             "of bound = bound / s/step, bound = max(T_gpu, T_cpu_adam, T_h2d, T_d2h, T_nvme) under the row's placement "
             "(terms below); clipped = share of measured steps with clip coefficient < 1",
             f"{'row':<{width}}{'s/step':>8}{'tok/s':>9}{'TFLOP/s':>9}{'vs torch':>10}{'of bound':>10}{'clipped':>9}"
             f"{'GPU GiB':>9}{'RSS GiB':>9}{'pinned':>8}  what"]
    base = results.get("torch", {}).get("step_s")
    base_accum = results.get("torch-accum8", {}).get("step_s")
    for row in rows:
        r = results.get(row, {})
        if "error" in r or "step_s" not in r:
            lines.append(f"{row:<{width}}{'failed':>8}  {failure_reason(r.get('error', 'no result'))}")
            continue
        accum = accumulation_of(row)
        tps = spec.tokens_per_micro_batch * accum / r["step_s"]
        reference = base_accum / accum if accum > 1 and base_accum else base
        vs_torch = f"{reference * accum / r['step_s']:.2f}x" if reference and not row.startswith("torch") else "-"
        bound = bounds[row].seconds if row in bounds else None
        of_bound = f"{bound / r['step_s']:.2f}" if bound else "-"
        clipped = f"{r['clipped']:.0%}" if r.get("clipped") is not None else "-"
        tflops = 6 * r.get("num_params", num_params) * tps / 1e12  # model FLOPs: 6 per parameter per token (no attention term)
        pinned = f"{r['pinned_nbytes'] / 2**30:.1f}" if r.get("pinned_nbytes") else "-"
        lines.append(f"{row:<{width}}{r['step_s']:>8.3f}{tps:>9.0f}{tflops:>9.1f}{vs_torch:>10}{of_bound:>10}{clipped:>9}"
                     f"{r.get('peak_gpu_nbytes', 0) / 2**30:>9.1f}{r.get('peak_rss_nbytes', 0) / 2**30:>9.1f}{pinned:>8}"
                     f"  {describe_row(row)}")
    lines += [_bound_line(row, bounds[row], results[row]) for row in rows if row in bounds]
    lines += [f"placement {row}: {note.strip()}" for row in rows for note in results.get(row, {}).get("placement_notes", [])
              if row_options(row)[1].get("auto")]
    lines += [f"held gradients {row}: {r['held_per_step']} of {r['host_blocks']} host blocks (as placed at the end) a "
              f"step; the host's clip multiply between step ends {', '.join(f'{x * 1e3:.0f}' for x in r['scale_s_per_step'])} ms"
              for row in rows if "held_per_step" in (r := results.get(row, {})) and row_options(row)[1].get("clip")]
    lines += [_time_line(row, r, warm=r.get("warm_steps", max(1, len(r["kernel_s_per_step"]) // 3))) for row in rows
              if "kernel_s_per_step" in (r := results.get(row, {})) and r["host_numel"]]  # no CPU updates: no line
    lines += [f"allocator {row}: {r['alloc_retries']} retries (cached memory given back under pressure), "
              f"{r['device_allocs']} cudaMalloc / {r['device_frees']} cudaFree, "
              f"peak reserved {r['peak_gpu_reserved_nbytes'] / 2**30:.1f} GiB"
              for row in rows if "alloc_retries" in (r := results.get(row, {}))]
    return "\n".join(lines + versus_deepspeed(results))


def _time_line(row: str, result: dict[str, Any], warm: int) -> str:
    """Where a tierstore row's measured steps waited, and the CPU's AdamW kernel inside them (medians of the steps
    after warm-up): ``time host-clip: the forward waited 12 ms a step for updates, 0 for weights; CPU AdamW
    kernel 180 ms a step for 0.622B parameters (3.46 G params/s in the step)``."""
    kernel = statistics.median(result["kernel_s_per_step"][warm:] or result["kernel_s_per_step"])
    numel = result["host_numel"]
    rate = f" ({numel / kernel / 1e9:.2f} G params/s in the step)" if kernel > 0 and numel else ""
    return (f"time {row}: the forward waited {result['wait_update_s'] * 1e3:.0f} ms a step for updates, "
            f"{result['wait_fetch_s'] * 1e3:.0f} for weights; CPU AdamW kernel {kernel * 1e3:.0f} ms a step for "
            f"{_count(numel)} parameters{rate}")


def _count(numel: int) -> str:
    return f"{numel / 1e9:.3f}B" if numel >= 10**8 else f"{numel / 1e6:.2f}M"


def _describe_rates(rates: Rates) -> str:
    parts = []
    if rates.fwd_s is not None and rates.bwd_s is not None:
        parts.append(f"T_fwd {rates.fwd_s:.3f} s, T_bwd {rates.bwd_s:.3f} s (plain row)")
    else:
        parts.append("T_fwd / T_bwd not measured (no torch row)")
    if rates.gpu_adam_s_per_param is not None:
        parts.append(f"GPU AdamW {1e-9 / rates.gpu_adam_s_per_param:.1f} G params/s")
    parts += [f"CPU AdamW {1e-9 / s:.2f} G params/s at {t} threads" for t, s in sorted(rates.cpu_adam_s_per_param.items())]
    if rates.h2d_gbps is not None and rates.d2h_gbps is not None:
        parts.append(f"pinned H2D {rates.h2d_gbps:.1f} / D2H {rates.d2h_gbps:.1f} GB/s")
    if rates.disk_read_gbps is not None and rates.disk_write_gbps is not None:
        parts.append(f"disk read {rates.disk_read_gbps:.2f} / write {rates.disk_write_gbps:.2f} GB/s")
    return ", ".join(parts)


def _bound_line(row: str, bound: Bound, result: dict[str, Any]) -> str:
    """A row's bound, its terms and the bytes they count; beside them what a tierstore row moved (the bound
    uses the smaller where it moved less than the accounting)."""
    t = bound.traffic
    moved = result.get("moved_nbytes")

    def size(accounted: int, kind: str) -> str:
        if moved is None:
            return approx_size(accounted)
        note = ", used" if bound.nbytes[kind] < accounted else ""
        return f"{approx_size(accounted)} (moved {approx_size(int(moved[kind]))}{note})"

    text = (f"bound {row}: {bound.describe()}; per step: H2D {size(t.h2d_nbytes, 'h2d')}, D2H {size(t.d2h_nbytes, 'd2h')}, "
            f"{_count(t.cpu_update_numel)} params updated on the CPU, {_count(t.gpu_update_numel)} on the GPU")
    if t.disk_read_nbytes or (moved and (moved["read"] or moved["write"])):
        text += f", disk read {size(t.disk_read_nbytes, 'read')} / write {size(t.disk_write_nbytes, 'write')}"
    if result.get("spilled_blocks"):
        text += f"; moments of {result['spilled_blocks']} blocks spilled to NVMe"
    return text


def failure_reason(error: str) -> str:
    """The line of a failed row's stderr that says why: the error's own message (a traceback's last line,
    or tierstore's ``error:`` line), not the frames above it."""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    for line in reversed(lines):
        if line.split(":")[0].endswith(("Error", "Exception")) or "error:" in line.lower():
            return line[:200]
    return lines[-1][:200] if lines else "failed without a message"


def versus_deepspeed(results: dict[str, Any]) -> list[str]:
    """Tokens/s ratios of our rows over each DeepSpeed row of the same call, and nvme-auto against the row
    whose peak RSS capped it (the same host RAM, the rest spilled to NVMe)."""
    out = []
    ours = {r: v["step_s"] for r, v in results.items() if is_tierstore(r) and "step_s" in v and accumulation_of(r) == 1}
    for ds_row, ds in results.items():
        if ds_row.startswith("ds-") and "step_s" in ds and ours:
            pairs = ", ".join(f"{r} {ds['step_s'] / s:.2f}x" for r, s in ours.items())
            out.append(f"tokens/s vs {ds_row} ({ds['step_s']:.3f} s/step): {pairs}")
    for row, r in results.items():
        paired = results.get(r.get("host_cap_from", ""), {})
        if "step_s" in r and "step_s" in paired:
            out.append(f"{row} vs {r['host_cap_from']} at the same host RAM ({row} capped at {r['host_cap_from']}'s peak "
                       f"RSS {paired['peak_rss_nbytes'] / 2**30:.1f} GiB, reached {r['peak_rss_nbytes'] / 2**30:.1f} GiB): "
                       f"{paired['step_s'] / r['step_s']:.2f}x the tokens/s")
    return out


def _child() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--row", required=True)
    parser.add_argument("--spec", required=True, help="the model's shape, BenchModel.to_json()")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", required=True)
    parser.add_argument("--nvme-dir")
    parser.add_argument("--gpu-cap", type=int)
    parser.add_argument("--host-cap", type=int)
    a = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    result = run_row(a.row, BenchModel.from_json(a.spec), a.steps, a.nvme_dir, a.gpu_cap, a.host_cap)
    Path(a.out).write_text(json.dumps(result))


if __name__ == "__main__":
    _child()
