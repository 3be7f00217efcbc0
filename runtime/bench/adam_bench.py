"""CPU AdamW throughput per ``optimizer.moment_dtype``: parameters a second of ``adamw_update_block`` on the same
block, the same cores, in one run.

``python -m runtime.bench.adam_bench [--numel N] [--threads T] [--repeat R]`` prints one table: for each moment
format (and bf16 and int8 with the compiled kernel, ``runtime.update.moment_kernel``, where it builds), the bytes a parameter
moves (master read and written, gradient read, both moments read and written), the median seconds of one update
over the whole block, parameters a second, the effective GB/s, and the ratio to fp32 moments. The block is shaped
like a transformer layer (four square matrices, three 8/3-wide ones, two norm weights), scaled to ``--numel``; every
format starts from the same master, gradient and moments (encoded from the same fp32
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
    Int8Kernel,
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
    """One row's measurement."""

    label: str
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


# Rows of the table: a label, a moment_dtype, and whether it runs the compiled kernel (bf16, int8: after the torch-ops
# rows, where the kernel builds).
KERNEL_ROWS = (("bf16 kernel", "bf16", True), ("int8 kernel", "int8", True))


class Setup:
    """One row's block: master, stored moments encoded from the shared fp32 values, steps, scratch."""

    def __init__(self, row: tuple[str, str, bool], sizes: list[int], master: torch.Tensor, grad: torch.Tensor,
                 piece_numel: int | None = None, kernel: Int8Kernel | None = None):
        self.label, self.moment_dtype, with_kernel = row
        self.sizes, self.grad, self.piece_numel = sizes, grad, piece_numel
        self.master = master.clone()
        self.stored = []
        for kind, values in (("exp_avg", grad * 0.1), ("exp_avg_sq", grad * grad * 1e-3)):
            dtype, stored_numel = moment_storage(self.moment_dtype, sizes)
            buffer = torch.empty(stored_numel, dtype=dtype)
            encode_moment(values, self.moment_dtype, kind, sizes, buffer)
            self.stored.append(buffer)
        self.steps = [torch.full((), 10.0) for _ in sizes]
        self.hypers = [AdamWHyper(lr=1e-4)] * len(sizes)
        self.scratch = MomentScratch(int8_kernel=kernel if with_kernel else None)

    def update_s(self) -> float:
        """Seconds of one in-place update of the whole block."""
        start = time.perf_counter()
        adamw_update_block(self.master, self.grad, self.stored[0], self.stored[1], self.sizes, [True] * len(self.sizes),
                           self.steps, self.hypers, self.moment_dtype, scratch=self.scratch,
                           piece_numel=self.piece_numel)
        return time.perf_counter() - start


def measure(rows: list[tuple[str, str, bool]], sizes: list[int], repeat: int, seed: int = 0,
            piece_numel: int | None = None, kernel: Int8Kernel | None = None) -> list[Row]:
    """Median seconds of one in-place update of a block of ``sizes`` per row (label, moment_dtype, kernel or not).
    The rows take turns, round by round, so a load that comes and goes on a shared machine falls on each of them
    alike; the first round is a warm-up (page faults, the scratch's first touch)."""
    gen = torch.Generator().manual_seed(seed)
    master = torch.randn(sum(sizes), generator=gen)
    grad = torch.randn(sum(sizes), generator=gen) * 1e-2
    setups = [Setup(row, sizes, master, grad, piece_numel, kernel) for row in rows]
    times: dict[str, list[float]] = {setup.label: [] for setup in setups}
    for attempt in range(repeat + 1):
        for setup in setups:
            seconds = setup.update_s()
            if attempt:
                times[setup.label].append(seconds)
    return [Row(s.label, sum(sizes), bytes_per_param(s.moment_dtype, sizes), statistics.median(times[s.label]))
            for s in setups]


def format_table(rows: list[Row], threads: int, piece_numel: int) -> str:
    """The table: one line a moment format, with its ratio to fp32's parameters a second."""
    fp32 = next((r for r in rows if r.label == "fp32"), rows[0])
    lines = [f"AdamW over {rows[0].numel / 1e6:.1f} M parameters, {threads} threads, pieces of {piece_numel} elements "
             "(bf16, int8), median of the runs",
             f"{'moment_dtype':<13}{'B/param':>8}{'ms/update':>11}{'Mparam/s':>10}{'GB/s':>7}{'x fp32':>8}"]
    for row in rows:
        lines.append(f"{row.label:<13}{row.bytes_per_param:>8.2f}{row.seconds * 1e3:>11.1f}"
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
    parser.add_argument("--no-kernel", action="store_true",
                        help="leave out the compiled kernel's rows (built on first use, cached after)")
    parser.add_argument("--moment-dtype", action="append", choices=MOMENT_DTYPES,
                        help="measure only these (repeatable; default all)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        sizes = layer_sizes(args.numel)
        wanted = [(d, d, False) for d in (args.moment_dtype or MOMENT_DTYPES)]
        kernel_rows = [row for row in KERNEL_ROWS if row[1] in [d for _, d, _ in wanted]]
        kernel = None if args.no_kernel or not kernel_rows else Int8Kernel.build()
        if kernel is not None:
            wanted.extend(kernel_rows)
        rows = measure(wanted, sizes, args.repeat, piece_numel=args.piece_numel, kernel=kernel)
        piece_numel = args.piece_numel or default_piece_numel()
    finally:
        torch.set_num_threads(threads)  # a caller in the same process (a test) keeps its own
    print(format_table(rows, args.threads, piece_numel))
    if kernel is not None:
        print(f"compiled kernel: {kernel.describe()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
