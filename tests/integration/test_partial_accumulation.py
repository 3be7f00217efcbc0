"""``optimizer.step()`` after fewer backward passes than ``optimizer.accumulation_steps``: the HF Trainer's last
step of an epoch whose micro-batches the accumulation does not divide. Plain PyTorch steps with the gradients
summed so far; the offloaded step must too, bit for bit in fp32 on the CPU, whatever the gradients' path (summed
on the device or in host memory, updates streamed or waiting for the commit, blocks updated on the device)."""

from __future__ import annotations

import copy

import pytest
import torch

from runtime import offload
from runtime.bundled.example_model import ExampleLM
from tests.integration.reference_loop import ReferenceTrainer
from tests.integration.test_parity import SHAPE, assert_identical, make_batches

ACCUMULATION = 3
WINDOWS = [3, 1, 3, 2]  # micro-batches of each optimizer step: two short ones


@pytest.mark.parametrize("optimizer", [
    {"accumulate_on": "host", "grad_clip": None},  # updates stream as the gradients land
    {"accumulate_on": "host", "grad_clip": 0.05},  # updates wait for the commit (every step clips)
    {"accumulate_on": "gpu", "grad_clip": None},
    {"accumulate_on": "gpu", "grad_clip": 0.05},
    {"accumulate_on": "host", "grad_clip": 0.05, "gpu_update_fraction": 0.3, "gpu_stream_fraction": 0.3},
], ids=["host-stream", "host-clip", "gpu-stream", "gpu-clip", "host-device-updates"])
def test_a_short_last_window_steps_with_the_gradients_summed_so_far(optimizer):
    torch.manual_seed(0)
    model = ExampleLM(SHAPE)
    clip = optimizer["grad_clip"]
    reference = ReferenceTrainer(model, grad_clip=clip, accumulation_steps=ACCUMULATION)
    model, opt = offload(model, {"dtype": "fp32", "optimizer": {"accumulation_steps": ACCUMULATION, **optimizer}})
    controller = opt.session.controller
    assert (controller.sums is not None) == (optimizer["accumulate_on"] == "host")
    if "gpu_stream_fraction" in optimizer:  # on the CPU the 'device' updates run there too, through the same path
        assert controller.gpu_updated and controller.gpu_streamed
    batches = make_batches(sum(WINDOWS))
    ours, theirs = [], []
    with opt.session:
        begin = 0
        for size in WINDOWS:
            window = batches[begin : begin + size]
            begin += size
            for x, y in window:
                loss = model(x, y)
                ours.append(loss.item())
                loss.backward()
            opt.step()
            opt.zero_grad()
            theirs += reference.train_step(window)
        weights = opt.session.master_state_dict()
    assert ours == theirs
    assert_identical(weights, reference)
    if controller.sums is not None:  # the micro-batches before each window's last really went through host memory
        assert controller.sums.stats.nbytes > 0


# "gpu" alone as an id would mark a GPU test (tests/conftest.py)
@pytest.mark.parametrize("accumulate_on, fraction, own", [("host", 0.0, False), ("gpu", 0.0, False),
                                                          ("host", 0.3, False), ("host", 0.0, True)],
                         ids=["sums-in-host-memory", "sums-on-device", "host-sums-beside-device-updated-blocks",
                              "optimizer-clip-grad-norm"])
def test_clip_grad_norm_between_micro_batches_acts_on_the_sum_so_far(accumulate_on, fraction, own):
    """clip_grad_norm_ after the first of three micro-batches (the HF Trainer clips so before a short last step):
    the norm returned is the sum so far's and the clip scales it; the later micro-batches add to the scaled sum,
    as to a plain loop's .grad. Losses, norms and weights equal torch's fused AdamW loop, bit for bit; also where
    the blocks updated on the device keep their gradients there (the norms' list mixes both)."""
    torch.manual_seed(0)
    plain = ExampleLM(SHAPE)
    model = copy.deepcopy(plain)
    hyper = {"lr": 1e-3, "weight_decay": 0.01}
    plain_opt = torch.optim.AdamW(plain.parameters(), **hyper, fused=True)
    model, opt = offload(model, {"dtype": "fp32", "optimizer": {**hyper, "grad_clip": None, "user_grad_clip": True,
                                                                "accumulation_steps": ACCUMULATION,
                                                                "accumulate_on": accumulate_on,
                                                                "gpu_update_fraction": fraction,
                                                                "gpu_stream_fraction": 0.0}})
    assert bool(opt.session.controller.gpu_updated) == (fraction > 0)
    batches = make_batches(2 * ACCUMULATION)

    def clip(net, optimizer) -> float:  # own: the offloaded optimizer's clip_grad_norm_ instead of torch's
        if own and net is not plain:
            return optimizer.clip_grad_norm_(0.05).item()
        return torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05).item()

    with opt.session:
        for step in range(2):
            window = batches[step * ACCUMULATION : (step + 1) * ACCUMULATION]
            for net, optimizer in ((plain, plain_opt), (model, opt)):
                norms, losses = [], []
                for position, (x, y) in enumerate(window):
                    loss = net(x, y)
                    losses.append(loss.item())
                    loss.backward()
                    if position == 0:
                        norms.append(clip(net, optimizer))
                norms.append(clip(net, optimizer))
                optimizer.step()
                optimizer.zero_grad()
                if net is plain:
                    expected = (norms, losses)
                else:
                    assert (norms, losses) == expected
        weights = opt.session.master_state_dict()
    for name, param in plain.named_parameters():
        assert torch.equal(weights[name], param.detach()), name


def test_a_p_grad_kept_from_an_ended_step_is_refused_not_applied_to_the_next():
    """A p.grad stand-in kept from step 1's micro-batches, multiplied during step 2's: in plain PyTorch a dead
    tensor, so step 2 is unchanged. Here it is refused (it would have scaled step 2's live host sum), as is its
    norm, and also a stand-in kept past step() without accumulation; the training equals the plain loop's."""
    torch.manual_seed(0)
    model = ExampleLM(SHAPE)
    reference = ReferenceTrainer(model, grad_clip=None, accumulation_steps=2)
    model, opt = offload(model, {"dtype": "fp32", "optimizer": {"accumulation_steps": 2, "accumulate_on": "host",
                                                                "grad_clip": None, "user_grad_clip": True}})
    batches = make_batches(4)
    with opt.session:
        model(*batches[0]).backward()
        kept = next(model.parameters()).grad  # stands for the host sum of step 1
        kept.norm()  # served while step 1 accumulates
        model(*batches[1]).backward()
        opt.step()
        opt.zero_grad()
        model(*batches[2]).backward()
        with pytest.raises(RuntimeError, match="kept from a step that has ended"):
            kept.mul_(0.0)
        with pytest.raises(RuntimeError, match="kept from a step that has ended"):
            kept.norm()
        model(*batches[3]).backward()
        opt.step()
        opt.zero_grad()
        weights = opt.session.master_state_dict()
    reference.train_step(batches[:2])
    reference.train_step(batches[2:])
    assert_identical(weights, reference)


def test_under_fp16_loss_scaling_a_host_sum_between_micro_batches_is_not_clipped():
    """fp16: between micro-batches the host sum still carries the loss scale, so its norm would be the scaled one
    and a clip would shrink the step by the scale: refused, naming what to do instead."""
    torch.manual_seed(0)
    model, opt = offload(ExampleLM(SHAPE), {"dtype": "fp16", "optimizer": {
        "accumulation_steps": 2, "accumulate_on": "host", "grad_clip": None, "user_grad_clip": True,
        "loss_scale": {"initial": 1024.0}}})
    with opt.session:
        x, y = make_batches(1)[0]
        opt.scale_loss(model(x, y)).backward()
        with pytest.raises(RuntimeError, match="under fp16 loss scaling"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)


@pytest.mark.parametrize("accumulate_on", ["host", "gpu"], ids=["sums-in-host-memory", "sums-on-device"])
def test_state_reads_between_micro_batches_give_the_last_step_and_training_goes_on(accumulate_on):
    """A state_dict saved with an accumulation window open (an epoch's leftover micro-batches, a 'save best' after
    an evaluation mid-window) was refused ('a backward ran since the last optimizer.step()') while plain PyTorch
    saves the weights of the last step. It now reads them, as do optimizer.state_dict() and the masters; a write
    there is still refused; the window then ends exactly like the plain loop's."""
    torch.manual_seed(0)
    plain = ExampleLM(SHAPE)
    model = copy.deepcopy(plain)
    hyper = {"lr": 1e-3, "weight_decay": 0.01}
    plain_opt = torch.optim.AdamW(plain.parameters(), **hyper, fused=True)
    model, opt = offload(model, {"dtype": "fp32", "optimizer": {**hyper, "grad_clip": None,
                                                                "accumulation_steps": ACCUMULATION,
                                                                "accumulate_on": accumulate_on}})
    batches = make_batches(2 * ACCUMULATION)
    with opt.session:
        for i, (x, y) in enumerate(batches):
            for m in (plain, model):
                m(x, y).backward()
            if i % ACCUMULATION == 1:  # mid-window
                ours, theirs = model.state_dict(), plain.state_dict()
                assert ours.keys() == theirs.keys()
                assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
                masters = opt.session.master_state_dict()
                assert all(torch.equal(masters[k], theirs[k]) for k in masters)
                saved, plain_saved = opt.state_dict(), plain_opt.state_dict()
                for index, state in plain_saved["state"].items():
                    assert torch.equal(saved["state"][index]["exp_avg"], state["exp_avg"])
                with pytest.raises(RuntimeError, match="between the micro-batches of a step.*Reads work here"):
                    opt.load_state_dict(saved)
            if i % ACCUMULATION == ACCUMULATION - 1:
                for o in (plain_opt, opt):
                    o.step()
                    o.zero_grad()
        ours, theirs = model.state_dict(), plain.state_dict()
        assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
