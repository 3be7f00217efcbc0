"""CPU AdamW throughput per ``optimizer.moment_dtype``: parameters a second of ``adamw_update_block`` on the same
block, the same cores, in one run.

``python -m runtime.bench.adam_bench [--numel N] [--threads T] [--repeat R]`` prints one table: for each moment
format, the bytes a parameter moves (master read and written, gradient read, both moments read and written), the
median seconds of one update over the whole block, parameters a second, the effective GB/s, and the ratio to fp32
moments. The block is shaped like a transformer layer (four square matrices, three 8/3-wide ones, two norm weights),
scaled to ``--numel``; every format starts from the same master, gradient and moments (encoded from the same fp32
values); the formats take turns, round by round, after a warm-up round.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from dataclasses import dataclass

import torch

from runtime.update.adam import AdamWHyper
from runtime.update.moments import (
    MOMENT_DTYPES,
    PIECE_NUMEL_PER_THREAD,
    QUANT_BLOCK,
    MomentScratch,
    adamw_update_block,
    default_piece_numel,
    encode_moment,
    moment_nbytes,
    moment_storage,
)

log = logging.getLogger(__name__)

DEFAULT_NUMEL = 1 << 26  # 64 Mi parameters: 1 GiB of fp32 state, well past any cache


def layer_sizes(numel: int) -> list[int]:
    """Parameter sizes of a Llama-like layer whose total is close to numel: 4 d^2 + 3 (8/3) d^2 + 2 d."""
    hidden = max(64, int((numel / 12) ** 0.5) // 64 * 64)
    ffn = hidden * 8 // 3 // 64 * 64
    return [hidden * hidden] * 4 + [hidden * ffn] * 3 + [hidden, hidden]


@dataclass
class Row:
    """One moment format's measurement."""

    moment_dtype: str
    numel: int
    bytes_per_param: float
    seconds: float

    @property
    def params_per_s(self) -> float:
        """Parameters updated a second."""
        return self.numel / self.seconds

    @property
    def gbps(self) -> float:
        """Bytes moved a second, in GB (1e9)."""
        return self.numel * self.bytes_per_param / self.seconds / 1e9


def bytes_per_param(moment_dtype: str, sizes: list[int]) -> float:
    """Bytes one update moves a parameter: fp32 master read and written, fp32 gradient read, each moment read and
    written in its stored format (int8: codes and scales)."""
    return 4 * 2 + 4 + 2 * 2 * moment_nbytes(moment_dtype, sizes) / sum(sizes)


class Setup:
    """One moment format's block: master, stored moments encoded from the shared fp32 values, steps, scratch."""

    def __init__(self, moment_dtype: str, sizes: list[int], master: torch.Tensor, grad: torch.Tensor,
                 piece_numel: int | None = None):
        self.moment_dtype, self.sizes, self.grad, self.piece_numel = moment_dtype, sizes, grad, piece_numel
        self.master = master.clone()
        self.stored = []
        for kind, values in (("exp_avg", grad * 0.1), ("exp_avg_sq", grad * grad * 1e-3)):
            dtype, stored_numel = moment_storage(moment_dtype, sizes)
            buffer = torch.empty(stored_numel, dtype=dtype)
            encode_moment(values, moment_dtype, kind, sizes, buffer)
            self.stored.append(buffer)
        self.steps = [torch.full((), 10.0) for _ in sizes]
        self.hypers = [AdamWHyper(lr=1e-4)] * len(sizes)
        self.scratch = MomentScratch()

    def update_s(self) -> float:
        """Seconds of one in-place update of the whole block."""
        start = time.perf_counter()
        adamw_update_block(self.master, self.grad, self.stored[0], self.stored[1], self.sizes, [True] * len(self.sizes),
                           self.steps, self.hypers, self.moment_dtype, scratch=self.scratch,
                           piece_numel=self.piece_numel)
        return time.perf_counter() - start


def measure(moment_dtypes: list[str], sizes: list[int], repeat: int, seed: int = 0,
            piece_numel: int | None = None) -> list[Row]:
    """Median seconds of one in-place update of a block of ``sizes`` per moment format. The formats take turns,
    round by round, so a load that comes and goes on a shared machine falls on each of them alike; the first
    round is a warm-up (page faults, the scratch's first touch)."""
    gen = torch.Generator().manual_seed(seed)
    master = torch.randn(sum(sizes), generator=gen)
    grad = torch.randn(sum(sizes), generator=gen) * 1e-2
    setups = [Setup(moment_dtype, sizes, master, grad, piece_numel) for moment_dtype in moment_dtypes]
    times: dict[str, list[float]] = {moment_dtype: [] for moment_dtype in moment_dtypes}
    for attempt in range(repeat + 1):
        for setup in setups:
            seconds = setup.update_s()
            if attempt:
                times[setup.moment_dtype].append(seconds)
    return [Row(d, sum(sizes), bytes_per_param(d, sizes), statistics.median(times[d])) for d in moment_dtypes]


def format_table(rows: list[Row], threads: int, piece_numel: int) -> str:
    """The table: one line a moment format, with its ratio to fp32's parameters a second."""
    fp32 = next((r for r in rows if r.moment_dtype == "fp32"), rows[0])
    lines = [f"AdamW over {rows[0].numel / 1e6:.1f} M parameters, {threads} threads, pieces of {piece_numel} elements "
             "(bf16, int8), median of the runs",
             f"{'moment_dtype':<13}{'B/param':>8}{'ms/update':>11}{'Mparam/s':>10}{'GB/s':>7}{'x fp32':>8}"]
    for row in rows:
        lines.append(f"{row.moment_dtype:<13}{row.bytes_per_param:>8.2f}{row.seconds * 1e3:>11.1f}"
                     f"{row.params_per_s / 1e6:>10.0f}{row.gbps:>7.1f}{row.params_per_s / fp32.params_per_s:>8.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Measure every moment format on the same block and threads; print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=DEFAULT_NUMEL, help="parameters in the block (about)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads")
    parser.add_argument("--repeat", type=int, default=5, help="measured updates per format (after one warm-up)")
    parser.add_argument("--piece-numel", type=int, default=None,
                        help=f"elements a piece (a multiple of {QUANT_BLOCK}; default {PIECE_NUMEL_PER_THREAD} a thread)")
    parser.add_argument("--moment-dtype", action="append", choices=MOMENT_DTYPES,
                        help="measure only these (repeatable; default all)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        sizes = layer_sizes(args.numel)
        rows = measure(args.moment_dtype or list(MOMENT_DTYPES), sizes, args.repeat, piece_numel=args.piece_numel)
        piece_numel = args.piece_numel or default_piece_numel()
    finally:
        torch.set_num_threads(threads)  # a caller in the same process (a test) keeps its own
    print(format_table(rows, args.threads, piece_numel))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
