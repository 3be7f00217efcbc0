"""A step is a transaction: an exception in forward or backward that the user catches drops that step exactly
as plain PyTorch does when the user catches it and calls ``zero_grad()``; where a step can't be rolled back
(streaming updates already under way), the next step refuses and says how to recover.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from runtime import offload
from runtime.checkpoint.state import save_checkpoint
from tests.integration.test_parity import make_batches
from tests.integration.test_user_contract import assert_same, config, fresh_model, plain_model, plain_step
from tierstore import CopyState, TierName


class Planted(Exception):
    """The failure the tests plant."""


def plant(model: nn.Module, layer: int, where: str) -> dict[str, bool]:
    """Arm a failure in layer's forward or in its backward; returns the switch."""
    armed = {"on": False}

    def raise_in_backward(grad: torch.Tensor) -> torch.Tensor:
        raise Planted("backward")

    def hook(module: nn.Module, args: object, output: torch.Tensor) -> None:
        if not armed["on"]:
            return
        if where == "forward":
            raise Planted("forward")
        if output.requires_grad:
            output.register_hook(raise_in_backward)

    model.layers[layer].register_forward_hook(hook)
    return armed


def run(model: nn.Module, optimizer: torch.optim.Optimizer, armed: dict[str, bool], batches, fail_at: set[int],
        accumulation: int = 1, clip: float | None = None) -> None:
    """The user's loop: a failing micro-batch is caught, its step dropped with zero_grad(), training goes on."""
    for step in range(len(batches) // accumulation):
        try:
            for micro in range(accumulation):
                armed["on"] = (step, micro) in fail_at
                (model(*batches[step * accumulation + micro]) / accumulation).backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
        except Planted:
            pass
        finally:
            armed["on"] = False
        optimizer.zero_grad()


@pytest.mark.parametrize("where,layer", [("forward", 0), ("forward", 2), ("backward", 0), ("backward", 1), ("backward", 2)])
@pytest.mark.parametrize("mode", ["user_clip", "config_clip", "accumulation", "host_sums"])
@pytest.mark.quick_cases({"where": "forward", "layer": 2, "mode": "accumulation"}, {"where": "backward", "layer": 1})
def test_a_caught_failure_drops_the_step_exactly(tmp_path, where, layer, mode):
    accumulation = 2 if mode in ("accumulation", "host_sums") else 1
    clip = 0.05 if mode == "user_clip" else None
    fail_at = {(1, accumulation - 1), (3, 0)}
    batches = make_batches(5 * accumulation)
    plain, plain_opt = plain_model()
    armed = plant(plain, layer, where)
    plain_clip = 0.05 if mode == "config_clip" else clip
    run(plain, plain_opt, armed, batches, fail_at, accumulation, plain_clip)

    opt_cfg = {"user_grad_clip": True, "accumulation_steps": accumulation}
    if mode == "config_clip":
        opt_cfg = {"grad_clip": 0.05}
    if mode == "host_sums":  # a failure after micro-batch 0 was summed on the host drops that sum too
        opt_cfg["accumulate_on"] = "host"
    model = fresh_model()
    armed = plant(model, layer, where)
    model, optimizer = offload(model, config(tmp_path, **opt_cfg))
    with optimizer.session:
        run(model, optimizer, armed, batches, fail_at, accumulation, clip)
        assert_same(model.state_dict(), plain.state_dict())
        assert all(state.users == 0 for state in optimizer.session.controller.weights.states)


def test_without_zero_grad_the_next_forward_drops_the_failed_step(tmp_path):
    batches = make_batches(4)
    plain, plain_opt = plain_model()
    for index, batch in enumerate(batches):
        if index != 1:  # the plain loop skips the failed batch
            plain(*batch).backward()
            plain_opt.step()
            plain_opt.zero_grad()
    model = fresh_model()
    armed = plant(model, 1, "backward")
    model, optimizer = offload(model, config(tmp_path, grad_clip=100.0))
    with optimizer.session:
        for index, batch in enumerate(batches):
            armed["on"] = index == 1
            try:
                model(*batch).backward()
                optimizer.step()
                optimizer.zero_grad()
            except Planted:
                pass  # no zero_grad: the next forward drops what the failed backward left
        armed["on"] = False
        assert_same(model.state_dict(), plain.state_dict())


def test_streaming_updates_cut_by_a_failure_refuse_the_next_step(tmp_path):
    model = fresh_model()
    armed = plant(model, 0, "backward")  # the last layer of backward: every later block already updated
    model, optimizer = offload(model, config(tmp_path))  # no clipping: updates start as gradients land
    with optimizer.session:
        batch = make_batches(1)[0]
        armed["on"] = True
        with pytest.raises(Planted):
            model(*batch).backward()
        armed["on"] = False
        optimizer.zero_grad()
        with pytest.raises(RuntimeError, match="Restore the last checkpoint"):
            model(*batch)
        with pytest.raises(RuntimeError, match="Restore the last checkpoint"):
            optimizer.step()
        with pytest.raises(RuntimeError, match="Restore the last checkpoint"):  # never a mixed-step checkpoint
            save_checkpoint(optimizer.session, tmp_path / "ckpt")


def test_the_checkpoint_after_a_caught_failure_holds_one_step_everywhere(tmp_path):
    model = fresh_model()
    armed = plant(model, 1, "backward")
    model, optimizer = offload(model, config(tmp_path, user_grad_clip=True))
    with optimizer.session as session:
        run(model, optimizer, armed, make_batches(3), {(2, 0)})
        saved = save_checkpoint(session, tmp_path / "ckpt")
    meta = json.loads((saved / "meta.json").read_text())
    assert meta["step"] == 2
    assert {s for block in meta["blocks"] for s in block["param_steps"]} == {2.0}


def test_a_dropped_step_gives_back_streamed_state(tmp_path):
    """Updates that wait for the commit bring streamed blocks' state in during backward; a dropped step
    releases it, and training afterwards still equals the plain loop."""
    plain, plain_opt = plain_model()
    armed = plant(plain, 0, "backward")
    batches = make_batches(4)
    run(plain, plain_opt, armed, batches, {(1, 0)}, clip=0.05)
    model = fresh_model()
    armed = plant(model, 0, "backward")
    cfg = config(tmp_path, user_grad_clip=True, gpu_stream_fraction=0.6)
    cfg["placement"] = {"master": "host", "moments": "host"}  # streamed state lives in pinned host memory
    model, optimizer = offload(model, cfg)
    with optimizer.session as session:
        run(model, optimizer, armed, batches, {(1, 0)}, clip=0.05)
        assert_same(model.state_dict(), plain.state_dict())
        streamed = session.controller.gpu_streamed
        assert streamed
        assert all(session.store.state(session.blocks[i].key(kind), TierName.GPU) is CopyState.ABSENT
                   for i in streamed for kind in ("master", "exp_avg", "exp_avg_sq"))


def test_a_param_group_that_cannot_be_read_fails_step_before_anything_changes(tmp_path):
    """An lr whose float() raises (a scheduler's bad value) inside optimizer.step() with updates waiting for it:
    the groups are read once before anything is queued, so the step fails with nothing changed and the session
    goes on (it was marked broken, 'failed after some of its updates were queued', though none had been; found
    by a fuzz). The loop that catches it, fixes the lr and goes on equals the plain loop that skipped the batch."""
    class BadLR(float):
        def __float__(self) -> float:
            raise ValueError("bad lr")

    plain, plain_opt = plain_model()
    model, optimizer = offload(fresh_model(), config(tmp_path, user_grad_clip=True))
    batches = make_batches(3)
    with optimizer.session:
        for step, batch in enumerate(batches):
            before = optimizer.session.master_state_dict()
            model(*batch).backward()
            if step == 1:
                good = optimizer.param_groups[0]["lr"]
                optimizer.param_groups[0]["lr"] = BadLR(good)
                with pytest.raises(ValueError, match="bad lr"):
                    optimizer.step()
                optimizer.param_groups[0]["lr"] = good
                assert optimizer.session.controller.interrupted is None
                assert_same(optimizer.session.master_state_dict(), before)
                optimizer.zero_grad()
                continue
            optimizer.step()
            optimizer.zero_grad()
            plain_step(plain, plain_opt, batch)
        assert_same(model.state_dict(), plain.state_dict())


def test_step_or_a_save_after_a_backward_that_raised_say_to_drop_the_step(tmp_path):
    """After a caught exception in backward, step() and save_checkpoint said '0 backward pass(es)' and blamed the
    accumulation setting; they now say the backward did not finish and to call zero_grad() (found by a fuzz)."""
    model, optimizer = offload(fresh_model(), config(tmp_path, user_grad_clip=True))
    batch = make_batches(1)[0]
    with optimizer.session:
        handle = model.layers[1].register_full_backward_hook(lambda *_: (_ for _ in ()).throw(ValueError("planted")))
        with pytest.raises(ValueError, match="planted"):
            model(*batch).backward()
        handle.remove()
        with pytest.raises(RuntimeError, match=r"did not finish \(it raised\).*zero_grad"):
            optimizer.step()
        with pytest.raises(RuntimeError, match=r"did not finish \(it raised\); call optimizer.zero_grad"):
            save_checkpoint(optimizer.session, tmp_path / "ckpt")
        optimizer.zero_grad()
        offloaded = model(*batch)
        offloaded.backward()
        optimizer.step()
