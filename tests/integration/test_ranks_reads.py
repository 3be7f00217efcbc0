"""Reads of the training state by one rank alone while the others go on, over gloo on the CPU ([Note: reads served by
the owner]): as the HF Trainer's saves read it on rank 0. The reads see one step's state, whole, whatever the other
ranks do next: their next step (where they wait for rank 0), a load of another state, a session closed and a new one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.integration.test_ranks import finish, start

CHILD = Path(__file__).with_name("ranks_reads_child.py")


def run(out: Path) -> dict:
    (out / "swap").mkdir()
    procs = start(out, 2, {}, child=CHILD, extra_env={"TIERSTORE_COLLECTIVE_TIMEOUT_S": "60"})
    outputs = finish(procs, timeout_s=240)
    for rank, (proc, text) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, f"rank {rank} exited with {proc.returncode}:\n{text[-4000:]}"
    return torch.load(out / "rank0.pt")


pytestmark = pytest.mark.slow


def test_reads_by_one_rank_alone_see_one_step_whole_whatever_the_others_do_next(tmp_path):
    record = run(tmp_path)  # two sessions in one process group: the second is served too
    # Session 1: the moments lived in swap files (bytes read from and written to them on rank 0)...
    read, written, on_disk = record["nvme"]
    assert read > 0 and written > 0 and on_disk > 0, record["nvme"]
    # ...and the reads alone while the others went on equal the same reads together
    (alone_optimizer, alone_weights), (optimizer, weights) = record["alone"], record["together"]
    assert alone_weights.keys() == weights.keys()
    for name, value in weights.items():
        assert torch.equal(alone_weights[name], value), name
    assert alone_optimizer["state"].keys() == optimizer["state"].keys()
    for index, entry in optimizer["state"].items():
        for kind in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(alone_optimizer["state"][index][kind], entry[kind]), (index, kind)
    # Session 2: the read alone while the others loaded another state holds its own step's, whole
    alone, first = record["alone-before-load"]["state"], record["first"]["state"]
    assert alone.keys() == first.keys() and alone
    for index, entry in alone.items():
        assert float(entry["step"]) == 2.0, (index, entry["step"])  # not the load's counters (1)
        assert not torch.equal(entry["exp_avg"], first[index]["exp_avg"]), index  # nor its moments
