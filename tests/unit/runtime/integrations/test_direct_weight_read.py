"""A loss that reads the output head's weight directly, outside the head's forward, as Liger's fused linear
cross-entropy does (``TrainingArguments(use_liger_kernel=True)``: ``LigerForCausalLMLoss(hidden_states,
lm_head_weight=self.lm_head.weight, ...)``; the head's module forward, where tierstore's hooks fetch its block, never
runs): on an offloaded model it trains exactly like the same loss on the plain model.

The mechanism is the parameter guard's read path (``runtime.model.param_guard``): a torch call on an offloaded
parameter whose block no pass holds fetches the block's current weights first, and the block stays on the device
until the next forward begins, so its backward reads the same bytes; the gradient autograd accumulates into
``lm_head.weight.grad`` reaches tierstore through the parameter's post-accumulate-grad hook like any other. Liger
itself needs triton and CUDA (tests/integration/test_hf_trainer_liger.py, marked gpu); these stand-ins take its
shape on the CPU.
"""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers", reason="the HF integration is an optional extra: pip install -e '.[hf]'")

from runtime import offload  # noqa: E402

VOCAB = 97


class FusedLinearCrossEntropy(torch.autograd.Function):
    """Liger's shape: the head's product, the loss and both gradients in the forward; the backward only scales the
    gradients kept, never reading the weight again."""

    @staticmethod
    def forward(ctx, hidden, weight, targets):  # type: ignore[no-untyped-def]
        with torch.enable_grad():
            h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
            loss = nn.functional.cross_entropy((h @ w.t()).float(), targets, reduction="sum")
            grad_hidden, grad_weight = torch.autograd.grad(loss, (h, w))
        count = (targets != -100).sum()
        ctx.save_for_backward(grad_hidden / count, grad_weight / count)
        return loss.detach() / count

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad, grad_weight * grad, None


def fused_forward(self, input_ids=None, labels=None, **kwargs):  # type: ignore[no-untyped-def]
    """Liger's patched forward, in short: the base model, then the loss given ``self.lm_head.weight``."""
    hidden = self.model(input_ids=input_ids).last_hidden_state
    targets = nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].reshape(-1)
    loss = FusedLinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), self.lm_head.weight, targets)
    return transformers.modeling_outputs.CausalLMOutputWithPast(loss=loss)


def linear_forward(self, input_ids=None, labels=None, **kwargs):  # type: ignore[no-untyped-def]
    """The head's weight read outside its module by plain autograd: saved in the forward, read again in the backward."""
    hidden = self.model(input_ids=input_ids).last_hidden_state
    logits = nn.functional.linear(hidden, self.lm_head.weight).float()
    targets = nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].reshape(-1)
    return transformers.modeling_outputs.CausalLMOutputWithPast(
        loss=nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets))


def tiny_llama() -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
        vocab_size=VOCAB, max_position_embeddings=64, tie_word_embeddings=False))


def train(model: nn.Module, optimizer: torch.optim.Optimizer, forward) -> None:  # type: ignore[no-untyped-def]
    """Two steps of two micro-batches."""
    model.forward = types.MethodType(forward, model)
    generator = torch.Generator().manual_seed(3)
    for _ in range(2):
        for _ in range(2):
            tokens = torch.randint(0, VOCAB, (2, 40), generator=generator)
            (model(input_ids=tokens, labels=tokens).loss / 2).backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("forward", [fused_forward, linear_forward], ids=["liger-shaped", "autograd-saved"])
@pytest.mark.parametrize("accumulate_on", ["gpu", "host"])
@pytest.mark.quick_cases({"forward": fused_forward, "accumulate_on": "host"}, {"forward": linear_forward, "accumulate_on": "gpu"})
def test_a_loss_reading_the_head_s_weight_directly_trains_like_the_plain_model(forward, accumulate_on):
    plain = tiny_llama()
    train(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.0), forward)
    # min_block_size 1 byte: the head is a block of its own, which only the read path fetches
    model, optimizer = offload(tiny_llama(), {
        "device": "cpu", "dtype": "fp32", "blocks": {"min_block_size": 1},
        "optimizer": {"lr": 1e-2, "weight_decay": 0.0, "grad_clip": None, "accumulation_steps": 2,
                      "accumulate_on": accumulate_on}})
    with optimizer.session:
        assert any(block.name == "lm_head" for block in optimizer.session.blocks)
        train(model, optimizer, forward)
        weights = model.state_dict()
    for name, param in plain.named_parameters():
        torch.testing.assert_close(weights[name], param.detach(), rtol=1e-6, atol=1e-6, msg=name)
