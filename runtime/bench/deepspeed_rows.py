"""DeepSpeed baselines for ``tierstore bench train`` (optional: runs only where ``deepspeed`` imports).

DeepSpeed is never a runtime dependency; the benchmark imports it inside the row's own process. Rows:
ZeRO-2 with the optimizer offloaded to CPU, ZeRO-3 with parameters and optimizer on CPU, and ZeRO-3 with
parameters on CPU and the optimizer on NVMe, its aio tuned (8 MiB blocks, queue depth 8, 8 threads, 8
buffers). Read / write pipelining of the optimizer swapper stays off: DeepSpeed 0.19.8's pipelined
swapper fails ``assert new_alloc_buffers is not None`` (pipelined_optimizer_swapper.py). A ``-clip`` suffix
sets ``gradient_clipping: 1.0``. Same model, batch and dtype as the other rows (``runtime.bench.train_model``).
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from typing import Any

import torch

from runtime.bench.train_bound import STATE_NBYTES, RowPlacement
from runtime.bench.train_model import BenchModel, batch_loss, build_model, count_params, make_batch
from runtime.bench.train_rows import CLIP_NORM, row_options

BF16 = 2


def deepspeed_available() -> bool:
    """True when deepspeed imports in this interpreter."""
    try:
        import deepspeed  # noqa: F401
    except Exception:  # any import failure (missing, broken build) means: no DeepSpeed rows
        return False
    return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ds_config(row: str, micro_batch: int, nvme_dir: str | None) -> dict[str, Any]:
    """The DeepSpeed config of one row (``-clip`` allowed on each)."""
    base, options = row_options(row)
    zero: dict[str, Any]
    if base == "ds-zero2-cpu":
        zero = {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}, "overlap_comm": True,
                "contiguous_gradients": True}
    elif base == "ds-zero3-cpu":
        zero = {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
                "offload_optimizer": {"device": "cpu", "pin_memory": True}, "overlap_comm": True}
    elif base == "ds-zero3-nvme":
        if not nvme_dir:
            raise ValueError("ds-zero3-nvme needs --nvme-dir on a real disk (DeepSpeed opens files O_DIRECT)")
        # pipeline_read / pipeline_write stay off: DeepSpeed 0.19.8's pipelined optimizer swapper fails
        # `assert new_alloc_buffers is not None` (pipelined_optimizer_swapper.py) with them on.
        zero = {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
                "offload_optimizer": {"device": "nvme", "nvme_path": nvme_dir, "pin_memory": True, "buffer_count": 8,
                                      "pipeline_read": False, "pipeline_write": False}}
    else:
        raise ValueError(f"unknown DeepSpeed row {row}")
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "gradient_clipping": CLIP_NORM if options.get("clip") else 0.0,
        "steps_per_print": 10**9,
    }
    if base == "ds-zero3-nvme":
        # Several large IOs in flight on several threads, as a fio run with a queue depth reaches the disk's ceiling.
        config["aio"] = {"block_size": 8 << 20, "queue_depth": 8, "thread_count": 8, "single_submit": False,
                         "overlap_events": True}
    return config


def deepspeed_placement(row: str, num_params: int) -> RowPlacement:
    """What each DeepSpeed row must move per step, counted at the least it could be (for the bound): bf16
    gradients to host, the whole update on the CPU with every core; ZeRO-2 keeps bf16 weights on the GPU and
    copies the updated ones back; ZeRO-3 fetches its bf16 weights, counted once per step (it keeps those
    reused within ``stage3_max_reuse_distance`` from forward to backward, how many depends on the model), and
    its NVMe row reads and writes the fp32 master and both moments."""
    base = row_options(row)[0]
    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    common = {"num_params": num_params, "cpu_update_numel": num_params, "grad_elem_nbytes": BF16, "cpu_threads": threads}
    if base == "ds-zero2-cpu":
        return RowPlacement(**common, resident_numel=num_params, refresh_elem_nbytes=BF16)
    disk = STATE_NBYTES * num_params if base == "ds-zero3-nvme" else 0
    return RowPlacement(**common, fetch_elem_nbytes=BF16, kept_numel=num_params, disk_state_nbytes=disk)


def run_deepspeed_row(row: str, spec: BenchModel, steps: int, nvme_dir: str | None) -> dict[str, Any]:
    """Train ``steps`` steps with DeepSpeed in this process; median step time after warm-up, the global
    gradient norm of each measured step, and the row's placement for the bound."""
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    import deepspeed

    model = build_model(spec)
    num_params = count_params(model)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds_config(row, spec.micro_batch, nvme_dir))
    batch = make_batch(spec, torch.device("cuda"), 0)
    step_s, losses, norms = [], [], []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = batch_loss(spec, engine, batch)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        torch.cuda.synchronize()
        step_s.append(time.perf_counter() - t0)
        norm = engine.get_global_grad_norm()  # computed by the step whether or not it clips
        norms.append(None if norm is None else float(norm))
    warm = max(1, steps // 3)
    return {"step_s": statistics.median(step_s[warm:]), "loss_first": losses[0], "loss_last": losses[-1],
            "grad_norms": norms[warm:], "num_params": num_params,
            "placement": deepspeed_placement(row, num_params).as_dict(),
            "peak_gpu_nbytes": torch.cuda.max_memory_allocated(), "peak_gpu_reserved_nbytes": torch.cuda.max_memory_reserved()}
