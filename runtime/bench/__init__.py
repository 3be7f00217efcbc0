"""Benchmarks behind ``tierstore bench``: each prints ratios measured in one run, never bare figures."""

from __future__ import annotations

import torch


def synchronize(device: torch.device | None = None) -> None:
    """Wait for the work queued on a GPU (the end of a timing): ``device``'s where it is a GPU, without one the current
    GPU's where there is one; nothing on the CPU."""
    if device is None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    elif device.type == "cuda":
        torch.cuda.synchronize(device)
