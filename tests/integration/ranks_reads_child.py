"""One rank of tests/integration/test_ranks_reads.py: reads of the training state made by rank 0 alone while the other
ranks go on ([Note: reads served by the owner]), as the HF Trainer's saves make them. Started as torchrun would; two
sessions one after the other in one process group (the second must be served too); writes what rank 0 read to
``<out>/rank<R>.pt``.

- Session 1, ``going-on``: moments in swap files; after each step rank 0 alone reads the optimizer's state and the
  weights while the others go on to their next step (and wait there for rank 0); the last reads equal the same reads
  made on every rank at the end.
- Session 2, ``load-after``: one step, every rank's ``optimizer.state_dict()``; a second step; rank 0 alone reads
  ``optimizer.state_dict()`` while the others go straight on to load the first state back: rank 0's holds the second
  step's state throughout (step counters and moments of one step), not the load's.
"""

from __future__ import annotations

import os
import sys

import torch

from runtime import offload
from runtime.bundled.example_model import ExampleLM
from tests.integration.ranks_child import SHAPE


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randint(0, 256, (2, 32), generator=generator), torch.randint(0, 256, (2, 32), generator=generator)


def main(out: str) -> None:
    rank = int(os.environ["RANK"])
    record: dict = {}
    for scenario in ("going-on", "load-after"):
        torch.manual_seed(0)
        device = os.environ.get("RANKS_TEST_DEVICE", "cpu")  # cuda: one GPU a rank over NCCL
        config = {"device": device, "dtype": "fp32", "optimizer": {"lr": 1e-3}}
        if scenario == "going-on":
            config.update(placement={"moments": "nvme"}, tiers={"nvme": {"path": os.path.join(out, "swap")}})
        model, optimizer = offload(ExampleLM(SHAPE), config)
        session = optimizer.session
        moved: dict[str, int] = {"read": 0, "write": 0}  # bytes through this rank's swap files
        session.store.bus.subscribe(lambda e, moved=moved: moved.__setitem__(e.kind, moved.get(e.kind, 0) + e.nbytes))

        def step(number: int, model: torch.nn.Module = model, optimizer: torch.optim.Optimizer = optimizer) -> None:
            x, y = batch(number)
            where = next(model.parameters()).device  # the compute device (this rank's GPU under NCCL)
            model(x.to(where), y.to(where)).backward()
            optimizer.step()
            optimizer.zero_grad()

        try:
            if scenario == "load-after":
                step(0)
                first = optimizer.state_dict()
                step(1)
                if rank == 0:
                    record["alone-before-load"], record["first"] = optimizer.state_dict(), first
                optimizer.load_state_dict(first)
            else:
                alone = []
                for number in range(3):
                    step(number)
                    if rank == 0:
                        alone.append((optimizer.state_dict(), session.master_state_dict()))
                record["alone"] = alone[-1] if alone else None  # (rank 0 only)
                record["together"] = (optimizer.state_dict(), session.master_state_dict())
                record["nvme"] = (moved["read"], moved["write"], session.store.usage()["nvme"]["used_nbytes"])
        finally:
            session.close()
    torch.save(record, os.path.join(out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
