"""Training text every machine has without a download: the Python standard library's source, as bytes."""

from __future__ import annotations

import logging
import os
import sysconfig
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def stdlib_text_bytes(max_nbytes: int = 32 << 20) -> bytes:
    """Concatenated .py files of the standard library (sorted, so the corpus is the same on every run)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in _stdlib_sources(root):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_nbytes:
            break
    if total == 0:
        raise FileNotFoundError(f"no Python source found under {root}; the example corpus needs the standard library")
    return b"".join(chunks)[:max_nbytes]


def _stdlib_sources(root: Path) -> list[Path]:
    """The .py files under ``root``, sorted, without installed packages or the stdlib's tests. Those directories
    are pruned from the walk, not filtered after it: site-packages holds far more files than the stdlib (walking
    torch's took 1.9 s of the 2 a call took; the test suite builds this corpus dozens of times)."""
    paths: list[Path] = []
    for directory, subdirectories, files in os.walk(root, followlinks=True):
        subdirectories[:] = [d for d in subdirectories if d not in ("site-packages", "test")]
        paths += [Path(directory, name) for name in files if name.endswith(".py")]
    return sorted(paths)


class ByteBatches:
    """Random windows of a byte corpus as (tokens, next-token targets), from a seeded generator.

    ``position`` (batches drawn so far) and the generator state make the stream resumable exactly.
    """

    def __init__(self, corpus: bytes, batch_size: int, seq_len: int, seed: int = 0):
        if len(corpus) <= seq_len + 1:
            raise ValueError(f"corpus of {len(corpus)} bytes is shorter than seq_len + 1 = {seq_len + 1}")
        self.data = torch.frombuffer(bytearray(corpus), dtype=torch.uint8).to(torch.long)
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.generator = torch.Generator().manual_seed(seed)
        self.position = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One batch: tokens [B, T] and targets [B, T], int64 on the CPU."""
        starts = torch.randint(0, len(self.data) - self.seq_len - 1, (self.batch_size,), generator=self.generator)
        windows = torch.stack([self.data[s : s + self.seq_len + 1] for s in starts.tolist()])
        self.position += 1
        return windows[:, :-1], windows[:, 1:]
