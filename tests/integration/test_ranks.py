"""Several processes over gloo on the CPU (issue 42): N ranks at a per-rank batch B train as one process at N x B
(DDP's semantics: the mean gradient over ranks), each block's state kept on one rank only ([Note: block ownership]).
The ranks are separate processes started as torchrun starts them; offload() joins the process group itself."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

CHILD = Path(__file__).with_name("ranks_child.py")
ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(out: Path, world: int, config: dict, steps: int = 3, global_batch: int = 6,
          extra_env: dict[str, str] | None = None, child: Path = CHILD,
          extra_args: list[str] | None = None) -> list[subprocess.Popen]:
    """Start ``child`` (default ``ranks_child.py``) as ``world`` ranks (one process when 1), as torchrun would.
    Over NCCL (RANKS_TEST_DEVICE=cuda) each rank needs a GPU of its own: more ranks than this machine has GPUs is a
    skip naming both counts (never on the CPU, where gloo runs any number)."""
    if os.environ.get("RANKS_TEST_DEVICE", "cpu") == "cuda" and world > torch.cuda.device_count():
        pytest.skip(f"{world} ranks over NCCL need {world} GPUs; this machine has {torch.cuda.device_count()}")
    port = _free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(extra_env or {})}
        if world > 1:
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, str(child), str(out), json.dumps(config), str(steps),
                                       str(global_batch), *(extra_args or [])],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


def finish(procs: list[subprocess.Popen], timeout_s: float) -> list[str]:
    """Each rank's output, once all have ended (killed past ``timeout_s``)."""
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=timeout_s)[0])
    finally:
        for proc in procs:
            proc.kill()
    return outputs


def launch(out: Path, world: int, config: dict, steps: int = 3, global_batch: int = 6, timeout_s: float = 180.0) -> list[dict]:
    """Run ``ranks_child.py`` as ``world`` ranks (one process when 1) and return each rank's record."""
    procs = start(out, world, config, steps, global_batch)
    outputs = finish(procs, timeout_s)
    for rank, (proc, text) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, f"rank {rank} of {world} exited with {proc.returncode}:\n{text[-4000:]}"
    return [torch.load(out / f"rank{rank}.pt") for rank in range(world)]


LR = 1e-3
# RANKS_TEST_DEVICE=cuda runs the same tests over NCCL, one GPU per rank (3 ranks need 3 GPUs): the lent multi-GPU
# machines (tests/gpu_session.sh ranks).
DEVICE = os.environ.get("RANKS_TEST_DEVICE", "cpu")


def assert_nearly_equal(ours: torch.Tensor, theirs: torch.Tensor, what: str, fp16: bool = False) -> None:
    """fp32 on the CPU: equal up to the order in which the gradients' mean over ranks is summed. AdamW divides by
    the root of the second moment, so where a gradient element is near zero a difference in its last bit moves that
    element's update by a visible part of lr: each element within 5% of one step's lr, and on average within 1e-4
    of it (almost every element the same bits). A wrong mean (a missed micro-batch, an unscaled sum, one rank's
    gradient alone) is off by a whole lr step in most elements. ``fp16``: the ranks' gradients are fp16 (10-bit
    mantissa) before their mean is taken, so the near-zero elements swing by more: within half a step each, 1% of
    one on average (seen: 12% and 0.02%); one step updated where the other process skipped it is a whole step."""
    diff = (ours - theirs).abs()
    most, mean = (0.5, 1e-2) if fp16 else (0.05, 1e-4)
    assert diff.max() <= most * LR, f"{what}: differs by {diff.max():.3g} (more than {most:g} of lr {LR})"
    assert diff.mean() <= mean * LR, f"{what}: differs by {diff.mean():.3g} on average (more than {mean:g} of lr {LR})"


CONFIGS = {
    "plain": {"device": DEVICE, "dtype": "fp32", "optimizer": {"lr": 1e-3}},
    # each rank's .grad accumulates over the micro-batches; the step's last backward reduces the sum
    "clip-accum": {"device": DEVICE, "dtype": "fp32", "optimizer": {"lr": 1e-3, "grad_clip": 0.05, "accumulation_steps": 2}},
    # each rank updates the first half of its own blocks' parameters on the device, streams the next 30%
    "device-updates": {"device": DEVICE, "dtype": "fp32",
                       "optimizer": {"lr": 1e-3, "grad_clip": 0.05, "gpu_update_fraction": 0.5, "gpu_stream_fraction": 0.3}},
    # each micro-batch's gradient reduced onto the owner, summed in its host memory or, for the blocks it updates on
    # the device, there
    "device-host-sums": {"device": DEVICE, "dtype": "fp32",
                         "optimizer": {"lr": 1e-3, "grad_clip": 0.05, "gpu_update_fraction": 0.5, "gpu_stream_fraction": 0.3,
                                       "accumulation_steps": 2, "accumulate_on": "host"}},
    # the loop clips (clip_grad_norm_ below the norms, as the HF Trainer does): every rank sees every block's norm
    "user-clip": {"device": DEVICE, "dtype": "fp32",
                  "optimizer": {"lr": 1e-3, "grad_clip": None, "user_grad_clip": True, "accumulation_steps": 2}},
    # compact moments (issue 43's 70B on one node needs both): each owner's int8 moments, as one process's
    "int8-moments": {"device": DEVICE, "dtype": "fp32",
                     "optimizer": {"lr": 1e-3, "grad_clip": 0.05, "moment_dtype": "int8", "moment_kernel": "torch"}},
    # fp16 with a loss scale that overflows the first steps: the owner of an overflowing block sees it, every rank
    # skips those steps and backs its scale off alike
    "fp16-overflow": {"device": DEVICE, "dtype": "fp16",
                      "optimizer": {"lr": 1e-3, "grad_clip": 0.05, "loss_scale": {"initial": 2.0**18}}},
    # held blocks ([Note: held blocks are not broadcast again]): tierstore recomputes the layers (each layer's
    # recomputation finds it held by its backward) and the loss is taken 8 tokens a piece (the test's model, not a
    # setting of offload(): the head's acquires one after another, each after the first held since its forward)
    "held": {"device": DEVICE, "dtype": "fp32", "placement": {"activations": "recompute"}, "test_loss_piece": 8,
             "optimizer": {"lr": 1e-3, "grad_clip": 0.05, "accumulation_steps": 2}},
    # each micro-batch's gradient reduced onto the owner, summed in its host memory
    "host-sums": {"device": DEVICE, "dtype": "fp32",
                  "optimizer": {"lr": 1e-3, "grad_clip": 0.05, "accumulation_steps": 2, "accumulate_on": "host"}},
}


# the default suite's at 2 ranks; the other configs at 2 ranks and the last at 3 in the slow suite (CI runs both)
QUICK = ("plain", "device-host-sums", "held")


def _cases() -> list:
    slow = pytest.mark.slow
    return [pytest.param(name, 2, marks=() if name in QUICK else slow, id=f"2-{name}") for name in CONFIGS] + \
        [pytest.param("device-host-sums", 3, marks=slow, id="3-device-host-sums")]  # the most exchanges


@pytest.mark.slow
def test_holds_past_a_forward_end_where_the_ranks_paths_meet(tmp_path):
    """[Note: held blocks are not broadcast again]: a block held for the next acquire is let go where a forward
    begins (a loop skipped the backward) and is never evicted by the keep-for-backward queue; with the hold
    outliving either, a rank found the block gone at the acquire and raised. 2 ranks train as one process."""
    child = CHILD.with_name("ranks_holds_child.py")
    results = []
    for world in (1, 2):
        (tmp_path / str(world)).mkdir()
        procs = start(tmp_path / str(world), world, {}, child=child)
        for rank, (proc, text) in enumerate(zip(procs, finish(procs, 180.0), strict=True)):
            assert proc.returncode == 0, f"rank {rank} of {world} exited with {proc.returncode}:\n{text[-4000:]}"
        results.append([torch.load(tmp_path / str(world) / f"rank{rank}.pt") for rank in range(world)])
    [one], ranks = results
    for record in ranks:
        for run in ("skipped", "evicted"):
            assert record[run] == pytest.approx(one[run], rel=1e-5), run


@pytest.mark.parametrize(("name", "world"), _cases())
def test_ranks_train_as_one_process_at_the_global_batch(tmp_path, name, world):
    config = CONFIGS[name]
    (tmp_path / "one").mkdir()
    (tmp_path / "many").mkdir()
    [one] = launch(tmp_path / "one", 1, config)
    ranks = launch(tmp_path / "many", world, config)
    for rank, record in enumerate(ranks):
        assert record["weights"].keys() == one["weights"].keys()
        fp16 = config["dtype"] == "fp16"
        for param, value in one["weights"].items():
            assert_nearly_equal(record["weights"][param], value, f"rank {rank}, {param}", fp16)
        # close() hands every rank the whole trained model, as DDP's ranks each hold it
        for param, value in record["params"].items():
            assert_nearly_equal(value, one["weights"][param], f"rank {rank}, {param} after close()", fp16)
    # The loop's clip_grad_norm_ returned the same norm on every rank, the whole model's (one process's)
    for record in ranks:
        assert record["norms"] == ranks[0]["norms"]
        assert record["norms"] == pytest.approx(one["norms"], rel=1e-5)
    assert len(one["norms"]) == (3 if config["optimizer"].get("user_grad_clip") else 0)
    # fp16: the one process skipped overflowing steps (its scale backed off) and every rank's scale is the same
    if config["dtype"] == "fp16":
        assert one["loss_scale"] < config["optimizer"]["loss_scale"]["initial"]
        assert all(record["loss_scale"] == one["loss_scale"] for record in ranks)
    # After the first step (its trace learned), blocks' broadcasts start ahead of their acquire, overlapping compute
    assert all(record["gathered_ahead"] > 0 for record in ranks)
    if name == "held":  # 3 layers, 2 micro-batches, 3 steps; 3 rows x 32 tokens a rank: 12 pieces a micro-batch,
        # once the trace is known (steps 2 and 3) the forward's head acquires after the first are held for them
        for record in ranks:
            assert record["held_hits"] - record["kept_for_next_hits"] >= 3 * 2 * 3, record["held_hits"]
            assert record["kept_for_next_hits"] >= 2 * 2 * 11, record["kept_for_next_hits"]
    # One copy of the state (master and moments: a block's host gradient buffer depends on where its update runs,
    # which each rank's placement decides over its own blocks): each block's on exactly one rank
    def state(keys: list[str]) -> list[str]:
        return [key for key in keys if key.endswith((".master", ".exp_avg", ".exp_avg_sq"))]

    kept = [set(state(record["keys"])) for record in ranks]
    assert set().union(*kept) == set(state(one["keys"])) and sum(len(k) for k in kept) == len(state(one["keys"]))
    assert all(any(key.endswith(".master") for key in k) for k in kept)  # every rank owns some block
    # Each rank runs its updates on its own cores where there are enough to share
    if len(os.sched_getaffinity(0)) >= world and len(os.sched_getaffinity(0)) == os.cpu_count():
        cores = [set(record["cores"]) for record in ranks]
        assert all(not a & b for i, a in enumerate(cores) for b in cores[i + 1:]), cores
    # The training moved: the weights differ from the start by more than the tolerance
    torch.manual_seed(0)
    from runtime.bundled.example_model import ExampleLM
    from tests.integration.ranks_child import SHAPE
    start = dict(ExampleLM(SHAPE).named_parameters())
    assert any((start[n].detach() - v).abs().max() > 1e-3 for n, v in one["weights"].items())


@pytest.mark.slow
@pytest.mark.parametrize("how", ["raise", "kill"])
def test_a_rank_failing_mid_backward_ends_every_rank_and_leaves_no_swap_file(tmp_path, tmpfs_dir, how):
    """Rank 1 raises (or dies) in the backward of step 1: every rank ends, within the collective timeout per
    collective it was in, with an error naming the failure, and no swap file is left on disk."""
    config = {"device": DEVICE, "dtype": "fp32", "optimizer": {"lr": 1e-3}, "placement": {"moments": "nvme"},
              "tiers": {"nvme": {"path": str(tmpfs_dir)}}}
    started = time.monotonic()
    procs = start(tmp_path, 2, config, extra_env={"RANKS_TEST_FAIL": f"1:1:{how}", "TIERSTORE_COLLECTIVE_TIMEOUT_S": "15"})
    outputs = finish(procs, timeout_s=120)
    elapsed = time.monotonic() - started
    assert all(proc.returncode not in (0, None) for proc in procs), outputs
    assert elapsed < 100, f"the ranks took {elapsed:.0f} s to end"
    if how == "raise":  # the survivor's error names the rank that failed and why
        assert "test failure on rank 1" in outputs[1]
        assert "rank 1 failed: RuntimeError('test failure on rank 1 in the backward of step 1')" in outputs[0], \
            outputs[0][-3000:]
    assert "rank 0 of 2" in outputs[0] and "failed" in outputs[0], outputs[0][-3000:]
    left = [p for p in tmpfs_dir.rglob("*") if p.is_file()]
    assert not left, f"swap files left: {left}"


@pytest.mark.slow
@pytest.mark.parametrize("how", ["raise", "kill"])
def test_a_read_from_a_rank_that_failed_raises_naming_it(tmp_path, how):
    """After training, rank 1 raises (or dies) and rank 0 reads the whole model alone (as the HF Trainer saves):
    the reads of rank 1's blocks ask its read service ([Note: reads served by the owner]), which no longer answers;
    rank 0 raises naming rank 1 (and its cause, where it said one) at once, or after the timeout when it was killed."""
    started = time.monotonic()
    procs = start(tmp_path, 2, CONFIGS["plain"], extra_env={"RANKS_TEST_LONE_READ": how,
                                                            "TIERSTORE_COLLECTIVE_TIMEOUT_S": "5"})
    outputs = finish(procs, timeout_s=120)
    assert procs[0].returncode not in (0, None) and procs[1].returncode not in (0, None), outputs
    assert time.monotonic() - started < 100
    if how == "raise":  # its service answers with the failure, or the failure it published is read
        assert re.search(r"rank 0 of 2: rank 1 (did not answer|could not read) .*test failure on rank 1 after training",
                         outputs[0]), outputs[0][-3000:]
    else:
        assert "rank 0 of 2: rank 1 did not answer the read of block" in outputs[0], outputs[0][-3000:]
        assert "not within 5 s" in outputs[0], outputs[0][-3000:]


def test_what_several_processes_do_not_do_yet_is_refused_on_every_rank(tmp_path):
    """Weights kept on the GPU are refused before anything is allocated, on every rank, naming the setting."""
    config = {"device": DEVICE, "dtype": "fp16", "placement": {"weights": "gpu"}}
    procs = start(tmp_path, 2, config, extra_env={"TIERSTORE_COLLECTIVE_TIMEOUT_S": "15"})
    outputs = finish(procs, timeout_s=120)
    for proc, text in zip(procs, outputs, strict=True):
        assert proc.returncode != 0
        assert "with several processes (2 ranks)" in text and "placement.weights: gpu" in text
        assert "fp16" not in text.split("does not yet support")[-1].splitlines()[0]  # fp16 is not refused


def test_a_plan_refused_on_one_rank_stops_every_rank_before_anything_is_allocated(tmp_path):
    """Rank 1's host budget cannot hold its blocks: it refuses its plan, and rank 0, whose plan fits, stops too at
    once, naming rank 1 and why (not at its first exchange with rank 1, after the collective timeout)."""
    config = {"device": DEVICE, "dtype": "fp32", "optimizer": {"lr": 1e-3}}
    started = time.monotonic()
    too_small = {**config, "tiers": {"host": {"budget": "64KiB"}}}
    procs = start(tmp_path, 2, config, extra_env={"TIERSTORE_COLLECTIVE_TIMEOUT_S": "60",
                                                  "RANKS_TEST_CONFIG_RANK1": json.dumps(too_small)})
    outputs = finish(procs, timeout_s=120)
    assert all(proc.returncode not in (0, None) for proc in procs), outputs
    assert time.monotonic() - started < 50  # not the collective timeout
    assert "tiers.host.budget" in outputs[1], outputs[1][-2000:]
    assert "rank 1 of 2 refused its plan" in outputs[0] and "tiers.host.budget" in outputs[0], outputs[0][-2000:]
