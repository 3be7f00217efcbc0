"""A small offloaded training loop with checkpoints, shared by the resume and kill tests (and the kill test's
child process). Every step draws from torch's, Python's and NumPy's global RNGs and from the data stream's
generator, so a resume that forgot any of them would not reproduce the uninterrupted losses."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from runtime import CheckpointRoot, load_checkpoint, offload, save_checkpoint
from runtime.bundled.data import ByteBatches
from runtime.bundled.example_model import ExampleLM, ModelShape

SHAPE = ModelShape(vocab_size=256, hidden_size=32, num_layers=3, num_heads=4, ffn_size=64, max_seq_len=64)
BATCH, SEQ = 2, 32


def tiny_config(swap_dir: Path | None, master: str = "host", moments: str = "host", **extra: Any) -> dict[str, Any]:
    """fp32 on the CPU; the given homes for master and moments; swap files under swap_dir."""
    config: dict[str, Any] = {"dtype": "fp32", "device": "cpu", "placement": {"master": master, "moments": moments},
                              "optimizer": {"grad_clip": None}}
    if swap_dir is not None:
        config["tiers"] = {"nvme": {"path": str(swap_dir)}}
    for name, value in extra.items():  # optimizer__gpu_update_fraction=0.5, dtype="fp16", optimizer={...}
        if "__" in name:
            section, key = name.split("__")
            config.setdefault(section, {})[key] = value
        elif isinstance(value, dict):
            config.setdefault(name, {}).update(value)
        else:
            config[name] = value
    return config


def tiny_cli_config(directory: Path, train_extra: str = "") -> Path:
    """``directory/tiny.yaml``: the tiny model on the CPU for ``tierstore train``, master on host, moments in
    swap files under ``directory/swap`` (created); ``train_extra``: more lines under ``train:``."""
    (directory / "swap").mkdir(parents=True, exist_ok=True)
    config = directory / "tiny.yaml"
    config.write_text(
        "device: cpu\ndtype: fp32\n"
        f"tiers:\n  nvme:\n    path: {directory / 'swap'}\n"
        "placement:\n  master: host\n  moments: nvme\n"
        "train:\n  batch_size: 2\n  seq_len: 32\n  log_every: 1\n"
        "  model: {hidden_size: 32, num_layers: 2, num_heads: 4, ffn_size: 64, max_seq_len: 64}\n" + train_extra)
    return config


def train(config: dict[str, Any], corpus: bytes, total_steps: int, *, checkpoint_dir: Path | None = None,
          save_every: int = 0, resume: bool = False, stop_after: int | None = None, keep_last: int = 3,
          on_step: Callable[[int, float], None] | None = None, before_save: Callable[[int], None] | None = None,
          after_save: Callable[[int, Path], None] | None = None, on_resume: Callable[[int], None] | None = None,
          progress: Callable[[str], None] | None = None, save_threads: int = 4) -> dict[int, float]:
    """Train (from a fresh seeded model, or resumed from checkpoint_dir) up to ``total_steps`` or
    ``stop_after``; returns the loss of each step run here. The checkpoint root is held (locked) for the
    run, as ``tierstore train`` holds it."""
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    model, optimizer = offload(ExampleLM(SHAPE), config)
    session = optimizer.session
    data = ByteBatches(corpus, BATCH, SEQ, seed=0)
    losses: dict[int, float] = {}
    root = CheckpointRoot(checkpoint_dir, resume=resume) if checkpoint_dir is not None else None
    try:
        start = load_checkpoint(session, root, data) if resume else 0
        if on_resume is not None:
            on_resume(start)
        for step in range(start + 1, min(total_steps, stop_after or total_steps) + 1):
            tokens, targets = data.next()
            loss = model(tokens.to(session.store.device), targets.to(session.store.device))
            losses[step] = loss.item()
            if on_step is not None:
                on_step(step, losses[step])
            noise = 0.01 * (torch.rand(()).item() + random.random() + float(np.random.rand()))
            optimizer.scale_loss(loss * (1.0 + noise)).backward()
            optimizer.step()
            optimizer.zero_grad()
            if checkpoint_dir is not None and save_every and step % save_every == 0:
                if before_save is not None:
                    before_save(step)
                path = save_checkpoint(session, root, data, keep_last=keep_last, progress=progress,
                                       threads=save_threads)
                if after_save is not None:
                    after_save(step, path)
    finally:
        session.close()
        if root is not None:
            root.close()
    return losses
