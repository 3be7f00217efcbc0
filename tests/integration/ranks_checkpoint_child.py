"""One rank of a several-process run that saves or loads a checkpoint (tests/integration/test_ranks_checkpoint.py), or
the one process it is compared with. Launched as torchrun would (``test_ranks.start``), with a JSON plan in place of
ranks_child.py's config (the steps argument is not used, the global batch is):

- ``load``: a checkpoint root to load first (``resume_training``: every rank, the same root), or null; when the load
  fails, one training step is tried (the session refuses it) and nothing else is done;
- ``train``: optimizer steps, then ``save`` (a root, or null), then ``more`` steps;
- ``fail_save``: ``"RANK:raise|kill"``, that rank fails while it writes its files (after its first one is durable);
- ``per_rank_data``: each rank draws from its own data stream (seeded by its rank), not its rows of the global one;
- ``optimizer_round_trip``: read ``optimizer.state_dict()``, load it with ``exp_avg`` doubled, read it, load the
  original back and read it again (each collective).

The data is the global batch stream (``ByteBatches``, seeded, restored by the load); rank R of N trains on rows
[R*B/N, (R+1)*B/N) of each batch. Writes ``<out>/rank<R>.pt``: the final master weights (``master_state_dict()``),
the saved path, the optimizer's state_dicts, or the error the load or save raised (then exits with 3)."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch

from runtime import offload, save_checkpoint
from runtime.bundled.data import ByteBatches, stdlib_text_bytes
from runtime.bundled.example_model import ExampleLM
from runtime.checkpoint.state import resume_training
from tests.integration.ranks_child import SHAPE


def _moments(state_dict: dict[str, Any]) -> dict[int, dict[str, torch.Tensor]]:
    return {int(i): {k: v.clone() for k, v in entry.items()} for i, entry in state_dict["state"].items()}


def _round_trip(optimizer: Any) -> dict[str, Any]:
    """The optimizer's state, the state after loading it with exp_avg doubled, and after loading the original back."""
    original = optimizer.state_dict()
    doubled = {"param_groups": original["param_groups"],
               "state": {i: {**entry, "exp_avg": entry["exp_avg"] * 2} for i, entry in original["state"].items()}}
    optimizer.load_state_dict(doubled)
    after_doubled = optimizer.state_dict()
    optimizer.load_state_dict(original)
    return {"original": _moments(original), "doubled": _moments(after_doubled), "restored": _moments(optimizer.state_dict())}


def _failing_progress(rank: int, fail: str | None) -> Any:
    """A save's progress callback that makes this rank fail after its first block file, when ``fail`` names it."""
    if fail is None or int(fail.split(":")[0]) != rank:
        return None

    def progress(name: str) -> None:
        if name.startswith("block"):
            if fail.endswith("kill"):
                os._exit(9)
            raise OSError(f"test failure on rank {rank} while writing {name}")

    return progress


def main(out: str, plan: dict[str, Any], global_batch: int) -> None:
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    torch.manual_seed(0)
    model, optimizer = offload(ExampleLM(SHAPE), plan["config"])
    session = optimizer.session
    if plan.get("per_rank_data"):  # each rank all of its own stream of global_batch / world rows (seeded by rank)
        data = ByteBatches(stdlib_text_bytes(1 << 20), batch_size=global_batch // world, seq_len=32, seed=rank)
        rows = slice(None)
    else:
        data = ByteBatches(stdlib_text_bytes(1 << 20), batch_size=global_batch, seq_len=32, seed=0)
        share = global_batch // world
        rows = slice(rank * share, (rank + 1) * share)
    record: dict[str, Any] = {"keys": sorted(str(key) for key in session.store.keys()),
                              "homes": {str(key): session.store.record(key).home.name for key in session.store.keys()}}

    def train(steps: int) -> None:
        for _ in range(steps):
            x, y = data.next()
            device = next(model.parameters()).device  # the compute device (a rank's GPU under NCCL)
            model(x[rows].to(device), y[rows].to(device)).backward()
            optimizer.step()
            optimizer.zero_grad()

    try:
        if plan.get("load"):
            try:
                record["loaded_step"] = resume_training(session, plan["load"], data)
            except Exception as error:
                record["error"] = f"{type(error).__name__}: {error}"
                try:
                    train(1)
                except Exception as refusal:  # the session refuses to train until a load completes
                    record["train_error"] = f"{type(refusal).__name__}: {refusal}"
        if "error" not in record:
            train(plan.get("train", 0))
        if plan.get("save") and "error" not in record:
            try:
                record["saved"] = str(save_checkpoint(session, plan["save"], data,
                                                      progress=_failing_progress(rank, plan.get("fail_save"))))
            except Exception as error:
                record["error"] = f"{type(error).__name__}: {error}"
        if "error" not in record:
            train(plan.get("more", 0))
            if plan.get("optimizer_round_trip"):
                record["optimizer"] = _round_trip(optimizer)
            record["weights"] = session.master_state_dict()
    finally:
        session.close()
    torch.save(record, os.path.join(out, f"rank{rank}.pt"))
    if "error" in record:
        print(record["error"], flush=True)
        sys.exit(3)


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[4]))
