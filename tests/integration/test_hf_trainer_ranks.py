"""An unchanged HF Trainer over several processes (gloo on the CPU, started as torchrun starts them) trains as the
same Trainer in one process at the global batch: DDP's semantics, with tierstore reducing the gradients itself
(accelerate leaves the offloaded model unwrapped) and the Trainer's own clip (``max_grad_norm``) seeing every rank's
gradients); its saves (``save_model``, checkpoints with the optimizer's state) run on rank 0 alone and hold every
rank's blocks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the HF integration is an optional extra: pip install -e '.[hf]'")
accelerate = pytest.importorskip("accelerate")

from tests.integration.test_ranks import DEVICE, assert_nearly_equal, finish, start  # noqa: E402

CHILD = Path(__file__).with_name("hf_trainer_ranks_child.py")
# RANKS_TEST_DEVICE=cuda: one GPU per rank over NCCL (tests/gpu_session.sh ranks)
CONFIG = {"device": DEVICE, "dtype": "fp32", "placement": {"moments": "nvme"},
          "optimizer": {"lr": 1e-3, "grad_clip": None, "user_grad_clip": True, "accumulation_steps": 2,
                        "accumulate_on": "host"}}
STEPS = 3


def run(out: Path, world: int, *extra: str) -> list[dict]:
    out.mkdir()
    procs = start(out, world, CONFIG, steps=STEPS, global_batch=4, child=CHILD, extra_args=list(extra))
    outputs = finish(procs, timeout_s=300)
    for rank, (proc, text) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, f"rank {rank} of {world} exited with {proc.returncode}:\n{text[-4000:]}"
    return [torch.load(out / f"rank{rank}.pt") for rank in range(world)]


@pytest.mark.slow  # (17 s: two launches of the Trainer)
@pytest.mark.skipif(tuple(int(p) for p in accelerate.__version__.split(".")[:2]) < (1, 14),
                    reason="accelerate < 1.14 wraps every model in DDP under several processes (tierstore's refuses it)")
def test_an_unchanged_trainer_on_two_ranks_trains_as_one_process_at_the_global_batch(tmp_path):
    [one] = run(tmp_path / "one", 1)
    ranks = run(tmp_path / "many", 2, "save")
    assert len(one["logs"]) == STEPS
    for rank, record in enumerate(ranks):
        assert record["wrapped"] == "LlamaForCausalLM", f"rank {rank}: accelerate wrapped the model in {record['wrapped']}"
        # The Trainer's logged loss and clip norm: the whole global batch's, on every rank
        for (loss, norm), (one_loss, one_norm) in zip(record["logs"], one["logs"], strict=True):
            assert loss == pytest.approx(one_loss, rel=1e-4) and norm == pytest.approx(one_norm, rel=1e-5)
        for name, value in one["weights"].items():
            assert_nearly_equal(record["weights"][name], value, f"rank {rank}, {name}")
    assert any(norm > 1.0 for _, norm in one["logs"])  # the Trainer's default clip (1.0) acted
    # every rank saved together (each block from its owner, rank 0 writing): a plain model loads the weights
    loaded = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "many" / "saved"))
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, ranks[0]["weights"][name]), name
    assert json.loads((tmp_path / "many" / "saved" / "config.json").read_text())["num_hidden_layers"] == 3
    # The Trainer's own saves, made on rank 0 alone ([Note: reads served by the owner]): the final model, and the
    # checkpoint of step 2 with the optimizer's state, both as the one process's
    loaded = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "many" / "trainer-saved"))
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, ranks[0]["weights"][name]), name
    ours, theirs = (torch.load(tmp_path / run / "trainer" / "checkpoint-2" / "optimizer.pt") for run in ("many", "one"))
    assert ours["state"].keys() == theirs["state"].keys() and len(ours["state"]) == len(one["weights"])
    for index, state in theirs["state"].items():
        for kind in ("exp_avg", "exp_avg_sq"):
            diff = (ours["state"][index][kind] - state[kind]).abs().max()
            assert diff <= 1e-4 * state[kind].abs().max() + 1e-12, (index, kind, diff)
    # Resumed from that checkpoint on 2 ranks (each loads the model and the optimizer's state), the third step gives
    # the uninterrupted run's weights
    resumed = run(tmp_path / "resumed", 2, f"resume={tmp_path / 'many' / 'trainer' / 'checkpoint-2'}")
    for rank, record in enumerate(resumed):
        assert record["commits"] == 1, record["commits"]  # it resumed: one step trained here
        # the log of the checkpoint's two steps (the Trainer restores it), then the third step's, as before
        assert record["logs"][-1] == pytest.approx(ranks[0]["logs"][-1], rel=1e-5)
        for name, value in ranks[0]["weights"].items():
            assert_nearly_equal(record["weights"][name], value, f"resumed rank {rank}, {name}")
