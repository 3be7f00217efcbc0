"""A small offloaded session for the checkpoint tests: a two-layer model on the CPU, a byte corpus, a step loop."""

from __future__ import annotations

from pathlib import Path

import torch

from runtime import offload
from runtime.bundled.data import ByteBatches
from runtime.bundled.example_model import ExampleLM, ModelShape
from runtime.session import OffloadSession

SHAPE = ModelShape(vocab_size=256, hidden_size=16, num_layers=2, num_heads=2, ffn_size=32, max_seq_len=32)
CORPUS = bytes(range(256)) * 64


def make_session(swap: Path | None, shape: ModelShape = SHAPE, **placement: object) -> tuple[torch.nn.Module, object, OffloadSession]:
    """offload() of a fresh ExampleLM (seed 0) in fp32 on the CPU, no clip; ``swap``: the NVMe tier's directory;
    ``master`` / ``moments``: their placement (host by default), any other keyword an optimizer setting."""
    torch.manual_seed(0)
    config: dict = {"dtype": "fp32", "device": "cpu", "optimizer": {"grad_clip": None},
                    "placement": {"master": placement.pop("master", "host"), "moments": placement.pop("moments", "host")}}
    if swap is not None:
        config["tiers"] = {"nvme": {"path": str(swap)}}
    config["optimizer"].update(placement)
    model, optimizer = offload(ExampleLM(shape), config)
    return model, optimizer, optimizer.session


def step(model, optimizer, data: ByteBatches, n: int = 1) -> None:
    """``n`` training steps of the plain loop on the next batches of ``data``."""
    for _ in range(n):
        x, y = data.next()
        model(x, y).backward()
        optimizer.step()
        optimizer.zero_grad()
