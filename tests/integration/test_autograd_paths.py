"""Backward passes other than ``loss.backward()`` on the training loss, through an offloaded model, next to the same
calls in a plain PyTorch loop with ``torch.optim.AdamW(fused=True)`` (fp32 on the CPU: equal means bit-identical).

- ``torch.autograd.grad`` of an input's gradient (a saliency map) accumulates into no parameter: it is no
  micro-batch of the step, and training goes on as if it had not run;
- gradients assigned to ``.grad`` by hand (from ``torch.autograd.grad(loss, params)``, or made elsewhere) are what
  the next ``optimizer.step()`` applies, as in torch; assigned where no step can apply them, refused;
- ``create_graph=True`` (a gradient penalty) is refused with an error that says so, before anything changed.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from runtime import offload
from runtime.engine.step_phase import StepPhase
from tests.integration.test_parity import make_batches
from tests.integration.test_user_contract import assert_same, config, fresh_model, plain_model

CLIP = 0.05  # binds on every step of these batches


def embeddings_kept(model: nn.Module) -> list[torch.Tensor]:
    """The embedding's output of each forward, appended by a forward hook (it writes nothing)."""
    kept: list[torch.Tensor] = []
    model.embed.register_forward_hook(lambda module, args, output: kept.append(output))
    return kept


def saliency(model: nn.Module, kept: list[torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    """The gradient of the top logits' sum with respect to the embeddings, in eval mode."""
    model.eval()
    logits = model(tokens)
    (grad,) = torch.autograd.grad(logits.max(-1).values.sum(), kept[-1])
    model.train()
    return grad


@pytest.mark.parametrize("optimizer", [{}, {"user_grad_clip": True}, {"accumulation_steps": 2}],
                         ids=["streaming", "user-clip", "between-micro-batches"])
def test_a_saliency_pass_is_no_step_and_training_goes_on_exactly(tmp_path, optimizer):
    """The offloaded model raised at the next forward ('ran forward after the last micro-batch's backward without
    optimizer.step()') and refused state_dict(): the saliency pass was taken for the step's backward."""
    plain, plain_opt = plain_model()
    model, opt = offload(fresh_model(), config(tmp_path, **optimizer))
    accumulation = optimizer.get("accumulation_steps", 1)
    plain_kept, kept = embeddings_kept(plain), embeddings_kept(model)
    with opt.session:
        for step, batch in enumerate(make_batches(3 * accumulation)):
            for m in (plain, model):
                m(*batch).backward()
            if step % accumulation == accumulation - 1:
                for o in (plain_opt, opt):
                    o.step()
                    o.zero_grad()
            if step == 1 or (accumulation > 1 and step == 2):  # between steps, or between micro-batches
                phase = opt.session.controller.phase
                assert torch.equal(saliency(model, kept, batch[0]), saliency(plain, plain_kept, batch[0]))
                assert opt.session.controller.phase is phase
                if phase is StepPhase.IDLE:
                    assert_same(model.state_dict(), plain.state_dict())
        assert_same(model.state_dict(), plain.state_dict())


@pytest.mark.parametrize("optimizer, clip", [({}, None), ({"user_grad_clip": True}, CLIP), ({"grad_clip": CLIP}, None),
                                             ({"accumulation_steps": 2}, None)],
                         ids=["streaming", "user-clip", "tierstore-clip", "accumulation"])
@pytest.mark.parametrize("source", ["autograd.grad", "by-hand"])
def test_gradients_assigned_to_grad_are_what_step_applies(tmp_path, optimizer, clip, source):
    """``p.grad = g`` with no backward since the last step, then ``optimizer.step()``: tierstore made no update at
    all (the step had seen no backward). Now the step applies them, as torch's AdamW does, with the loop's clip or
    tierstore's (``grad_clip``: the reference clips the same gradients)."""
    plain, plain_opt = plain_model()
    model, opt = offload(fresh_model(), config(tmp_path, **optimizer))
    with opt.session:
        for step, batch in enumerate(make_batches(3)):
            for m, o in ((plain, plain_opt), (model, opt)):
                if source == "autograd.grad":
                    grads = torch.autograd.grad(m(*batch), list(m.parameters()))
                else:
                    torch.manual_seed(step)
                    grads = [torch.randn_like(p) for p in m.parameters()]
                for p, g in zip(m.parameters(), grads, strict=True):
                    p.grad = g
                if clip is not None or (o is plain_opt and "grad_clip" in optimizer):
                    torch.nn.utils.clip_grad_norm_(m.parameters(), clip or optimizer["grad_clip"])
                o.step()
                o.zero_grad()
            assert opt.session.controller.optimizer_step == step + 1
            assert_same(model.state_dict(), plain.state_dict())


@pytest.mark.parametrize("checkpointing", ["tierstore-recompute", "model-checkpoint"])
def test_assigned_gradients_and_saliency_through_recomputed_layers(tmp_path, checkpointing):
    """The layers' forward recomputed inside a backward that is no micro-batch (activation checkpointing under
    torch.autograd.grad): its blocks are held as that backward's and let go at its end. They were held as a training
    backward's and never let go, and a parameter read after the step read freed memory (a segfault; found by a
    review). Steps from assigned gradients, a train-mode saliency pass and reads after each: bit for bit."""
    plain, plain_opt = plain_model()
    cfg = config(tmp_path)
    if checkpointing == "tierstore-recompute":
        cfg["placement"]["activations"] = "recompute"
    model = fresh_model()
    if checkpointing == "model-checkpoint":
        model.activation_checkpointing = plain.activation_checkpointing = True
    model, opt = offload(model, cfg)
    kept, plain_kept = embeddings_kept(model), embeddings_kept(plain)
    with opt.session:
        for batch in make_batches(3):
            for m, o in ((plain, plain_opt), (model, opt)):
                grads = torch.autograd.grad(m(*batch), list(m.parameters()))
                for p, g in zip(m.parameters(), grads, strict=True):
                    p.grad = g
                o.step()
                o.zero_grad()
            assert torch.equal(model.layers[1].qkv.weight.detach().clone(), plain.layers[1].qkv.weight.detach())
            logits, plain_logits = model(batch[0]), plain(batch[0])  # train mode: the layers recompute
            ours = torch.autograd.grad(logits.max(-1).values.sum(), kept[-1])[0]
            assert torch.equal(ours, torch.autograd.grad(plain_logits.max(-1).values.sum(), plain_kept[-1])[0])
            assert torch.equal(model.layers[2].down.weight.sum(), plain.layers[2].down.weight.sum())
        assert not any(opt.session.controller.in_backward_use(i) for i in range(len(opt.session.controller.blocks)))
        assert_same(model.state_dict(), plain.state_dict())


def test_a_gradient_assigned_after_the_last_backward_is_refused_not_ignored(tmp_path):
    """The backward reached only the last layer's parameters; a gradient assigned to the embedding before step() would
    never be applied (its block's update was decided without one), so it is refused; the step commits exactly."""
    plain, plain_opt = plain_model()
    model, opt = offload(fresh_model(), config(tmp_path))
    with opt.session:
        for step, batch in enumerate(make_batches(2)):
            for m in (plain, model):
                m(*batch).backward(inputs=list(m.layers[2].parameters()))
            if step == 0:
                with pytest.raises(RuntimeError, match="a gradient can't be assigned after the step's last backward"):
                    model.embed.weight.grad = torch.ones(model.embed.weight.shape)
                assert torch.Tensor.grad.__get__(model.embed.weight) is None
            for o in (plain_opt, opt):
                o.step()
                o.zero_grad()
        assert_same(model.state_dict(), plain.state_dict())


def test_a_gradient_only_backward_after_the_last_backward_is_refused_and_the_step_commits(tmp_path):
    """After the step's last backward the blocks' masters are being updated: a torch.autograd.grad through the
    retained graph would fetch them half-way, so it is refused, naming when to take it; the step commits exactly."""
    plain, plain_opt = plain_model()
    model, opt = offload(fresh_model(), config(tmp_path))
    kept = embeddings_kept(model)
    with opt.session:
        for step, batch in enumerate(make_batches(2)):
            plain(*batch).backward()
            loss = model(*batch)
            loss.backward(retain_graph=True)
            if step == 0:
                with pytest.raises(RuntimeError, match="accumulates into no parameter .* after the step's last backward"):
                    torch.autograd.grad(loss, kept[-1])
                assert opt.session.controller.phase is StepPhase.READY
            for o in (plain_opt, opt):
                o.step()
                o.zero_grad()
        assert_same(model.state_dict(), plain.state_dict())


@pytest.mark.parametrize("how", ["gradient-penalty", "backward", "parameter-only"])
def test_a_create_graph_backward_is_refused_and_changes_nothing(tmp_path, how):
    """Its graph reads the blocks' weights in a later backward, after their release: it segfaulted there. Refused at
    its first hook; the step in progress is untouched and training goes on exactly."""
    plain, plain_opt = plain_model()
    model, opt = offload(fresh_model(), config(tmp_path))
    kept = embeddings_kept(model)
    with opt.session:
        for step, batch in enumerate(make_batches(3)):
            if step == 1:
                loss = model(*batch)
                with pytest.raises(RuntimeError, match="create_graph=True .* higher-order gradients are not supported"):
                    if how == "gradient-penalty":
                        torch.autograd.grad(loss, kept[-1], create_graph=True)
                    elif how == "backward":
                        loss.backward(create_graph=True)
                    else:  # the first hook is a parameter's: its .grad (holding the graph) is dropped
                        model.layers[0].attn_norm.weight.pow(2).sum().backward(create_graph=True)
                assert opt.session.controller.phase is StepPhase.IDLE
                assert all(torch.Tensor.grad.__get__(p) is None for p in model.parameters())
                assert_same(model.state_dict(), plain.state_dict())
            for m, o in ((plain, plain_opt), (model, opt)):
                m(*batch).backward()
                o.step()
                o.zero_grad()
        assert_same(model.state_dict(), plain.state_dict())
