"""Test tensors shared by the tierstore tests: every bit pattern, compared byte for byte."""

from __future__ import annotations

import torch


def random_tensor(dtype: torch.dtype, numel: int, seed: int = 0) -> torch.Tensor:
    """Random bits of every pattern (NaN payloads, subnormals) for float types; 0/1 for bool."""
    g = torch.Generator().manual_seed(seed)
    if dtype is torch.bool:
        return torch.randint(0, 2, (numel,), generator=g, dtype=torch.uint8).bool()
    itemsize = torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (numel * itemsize,), generator=g, dtype=torch.uint8).view(dtype)


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 CPU tensor (NaN-safe equality)."""
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
