"""DeepSpeed baselines for ``tierstore bench train`` (optional: runs only where ``deepspeed`` imports).

DeepSpeed is never a runtime dependency; the benchmark imports it inside the row's own process. Rows:
ZeRO-2 with the optimizer offloaded to CPU, ZeRO-3 with parameters and optimizer on CPU, and ZeRO-3 with
parameters on CPU and the optimizer on NVMe (the configuration DESIGN.md found working: 5 buffers, no
pipelined read/write). Same model, batch and dtype as the other rows.
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from typing import Any

import torch

from runtime.example_model import ExampleLM, ModelShape


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
    """The DeepSpeed config of one row."""
    zero: dict[str, Any]
    if row == "ds-zero2-cpu":
        zero = {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}, "overlap_comm": True,
                "contiguous_gradients": True}
    elif row == "ds-zero3-cpu":
        zero = {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
                "offload_optimizer": {"device": "cpu", "pin_memory": True}, "overlap_comm": True}
    elif row == "ds-zero3-nvme":
        if not nvme_dir:
            raise ValueError("ds-zero3-nvme needs --nvme-dir on a real disk (DeepSpeed opens files O_DIRECT)")
        zero = {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
                "offload_optimizer": {"device": "nvme", "nvme_path": nvme_dir, "pin_memory": True, "buffer_count": 5,
                                      "pipeline_read": False, "pipeline_write": False}}
    else:
        raise ValueError(f"unknown DeepSpeed row {row}")
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
    }
    if row == "ds-zero3-nvme":
        config["aio"] = {"block_size": 1 << 20, "queue_depth": 8, "thread_count": 1, "single_submit": False,
                         "overlap_events": True}
    return config


def run_deepspeed_row(row: str, shape: ModelShape, steps: int, batch: tuple[torch.Tensor, torch.Tensor],
                      micro_batch: int, nvme_dir: str | None) -> dict[str, Any]:
    """Train ``steps`` steps with DeepSpeed in this process; median step time after warm-up."""
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    import deepspeed

    torch.manual_seed(0)
    model = ExampleLM(shape)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds_config(row, micro_batch, nvme_dir))
    step_s, losses = [], []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = engine(*batch)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        torch.cuda.synchronize()
        step_s.append(time.perf_counter() - t0)
    warm = max(1, steps // 3)
    return {"step_s": statistics.median(step_s[warm:]), "loss_first": losses[0], "loss_last": losses[-1],
            "peak_gpu_nbytes": torch.cuda.max_memory_allocated(), "peak_gpu_reserved_nbytes": torch.cuda.max_memory_reserved()}
