"""The collectives a run of several processes makes, timed on this host: a block's weights broadcast from its owner
(compute dtype) and its gradient reduced onto it (fp32), at the sizes of a model's blocks, alone and beside a
compute load on the compute stream, as a forward's or a backward's matrix products.

Why: on two H200s the 8B scenario's broadcasts ran at about 50 GB/s beside the compute, NCCL choosing its LL
protocol (docs/benchmarks.md, "Several GPUs of one host"); this measures the same calls without the model, so a
protocol (``NCCL_PROTO=Simple``), a channel count or a stream change can be compared in seconds. Run it under
torchrun, one process a GPU (gloo on the CPU runs too, for a check of the tool):

    torchrun --nproc-per-node 2 -m runtime.bench.collectives_bench --sizes 64,448,1024
    NCCL_PROTO=Simple torchrun --nproc-per-node 2 -m runtime.bench.collectives_bench

Rank 0 prints a row a call and size: seconds a call alone and its bandwidth (bytes / seconds: what one rank sends
or receives), the compute load's seconds alone, both together, and how much of the shorter one the overlap hid.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from runtime.bench import synchronize

MIB = 2**20


@dataclass
class Row:
    """One collective at one size: seconds a call alone, the compute load's seconds alone, both together."""

    call: str
    nbytes: int
    call_s: float
    compute_s: float
    both_s: float

    @property
    def gb_per_s(self) -> float:
        """Bytes a rank sends or receives a second, the call alone."""
        return self.nbytes / self.call_s / 1e9

    @property
    def hidden(self) -> float:
        """The share of the shorter of the two that running them together hid (1: the longer one's time alone)."""
        shorter = min(self.call_s, self.compute_s)
        return max(0.0, min(1.0, (self.call_s + self.compute_s - self.both_s) / shorter)) if shorter > 0 else 0.0


def _timed(device: torch.device, run: Callable[[], None], iters: int) -> float:
    """Seconds a run of ``run``, the mean of ``iters`` after one to warm up (the device waited for)."""
    run()
    synchronize(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        run()
    synchronize(device)
    return (time.perf_counter() - start) / iters


def measure(call: str, nbytes: int, device: torch.device, iters: int = 5, compute_n: int = 4096) -> Row:
    """Time ``call`` (``broadcast``: compute-dtype weights from rank 0; ``reduce``: fp32 gradients onto rank 0) of
    ``nbytes`` alone, a compute load of matrix products of ``compute_n`` alone, and both started together (the
    call asynchronous, on the process group's stream, the products on the current one). Every rank calls it."""
    dtype = torch.bfloat16 if call == "broadcast" else torch.float32
    if device.type == "cpu":
        dtype = torch.float32  # (gloo)
    tensor = torch.ones(nbytes // torch.empty((), dtype=dtype).element_size(), dtype=dtype, device=device)
    a = torch.randn(compute_n, compute_n, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32, device=device)

    def collective(async_op: bool = False) -> object:
        if call == "broadcast":
            return dist.broadcast(tensor, src=0, async_op=async_op)
        if call == "reduce":
            return dist.reduce(tensor, dst=0, op=dist.ReduceOp.SUM, async_op=async_op)
        raise ValueError(f"call {call!r}: broadcast or reduce")

    def compute() -> None:
        b = a
        for _ in range(8):
            b = a @ b
        b.sum()  # (kept: the products are the load, not their result)

    def alone() -> None:
        collective()

    def both() -> None:
        work = collective(async_op=True)
        compute()
        work.wait()  # type: ignore[attr-defined]

    call_s = _timed(device, alone, iters)
    compute_s = _timed(device, compute, iters)
    both_s = _timed(device, both, iters)
    return Row(call, nbytes, call_s, compute_s, both_s)


def table(rows: list[Row]) -> str:
    """The rows as the text rank 0 prints."""
    lines = [f"{'call':<10} {'MiB':>7} {'s a call':>9} {'GB/s':>7} {'compute s':>10} {'both s':>8} {'hidden':>7}"]
    for row in rows:
        lines.append(f"{row.call:<10} {row.nbytes / MIB:>7.1f} {row.call_s:>9.4f} {row.gb_per_s:>7.1f} "
                     f"{row.compute_s:>10.4f} {row.both_s:>8.4f} {row.hidden:>7.0%}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Join the process group from torchrun's environment, measure, print on rank 0."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="64,448,1024", help="MiB a call, comma-separated (default: a small block, "
                                                               "an 8B Llama layer in bf16, its head)")
    parser.add_argument("--calls", default="broadcast,reduce", help="broadcast, reduce or both (default)")
    parser.add_argument("--iters", type=int, default=5, help="timed calls a size (default 5, after one warm-up)")
    parser.add_argument("--compute-n", type=int, default=4096, help="the compute load's matrix size (default 4096)")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    try:
        rows = [measure(call, int(float(size) * MIB), device, args.iters, args.compute_n)
                for call in args.calls.split(",") for size in args.sizes.split(",")]
        if dist.get_rank() == 0:
            print(f"{dist.get_world_size()} ranks, {dist.get_backend()}, NCCL_PROTO={os.environ.get('NCCL_PROTO', '(NCCL picks)')}")
            print(table(rows))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
