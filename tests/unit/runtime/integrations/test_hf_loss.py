"""use_chunked_loss: an HF causal LM's loss taken a piece at a time equals HF's own loss, value and gradients, in
fp32 on the CPU, on a plain model and on an offloaded one."""

from __future__ import annotations

import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the HF integration is an optional extra: pip install -e '.[hf]'")

from runtime import offload  # noqa: E402
from runtime.integrations.hf_loss import chunked_causal_lm_loss, use_chunked_loss  # noqa: E402

VOCAB = 97


def tiny_llama(seed: int = 0, tied: bool = False) -> transformers.LlamaForCausalLM:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=64,
                                      tie_word_embeddings=tied)
    return transformers.LlamaForCausalLM(config)


def batch(with_ignored: bool) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (3, 50), generator=generator)
    labels = tokens.clone()
    if with_ignored:  # a prompt not trained on, and padding at the end of one sequence
        labels[:, :7] = -100
        labels[1, 40:] = -100
    return tokens, labels


def loss_and_grads(model: torch.nn.Module, tokens: torch.Tensor, labels: torch.Tensor, **kwargs: object):
    out = model(input_ids=tokens, labels=labels, **kwargs)
    out.loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    model.zero_grad()
    return out, grads


CASES = [pytest.param(False, None, id="plain-labels"), pytest.param(True, None, id="ignored-labels"),
         pytest.param(True, 211, id="num-items-in-batch")]


@pytest.mark.parametrize("with_ignored, num_items", CASES)
def test_the_chunked_loss_equals_hf_s_loss_and_gradients(with_ignored, num_items):
    """40 tokens a piece over 3 x 50 positions: 4 pieces, the last a short one; equal to HF's loss in fp32."""
    tokens, labels = batch(with_ignored)
    extra = {} if num_items is None else {"num_items_in_batch": torch.tensor(num_items)}
    expected, expected_grads = loss_and_grads(tiny_llama(), tokens, labels, **extra)
    model = use_chunked_loss(tiny_llama(), piece_tokens=40)
    out, grads = loss_and_grads(model, tokens, labels, **extra)
    assert out.logits is None  # the logits of the whole batch never existed
    torch.testing.assert_close(out.loss, expected.loss, rtol=1e-6, atol=1e-6)
    assert grads.keys() == expected_grads.keys()
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_the_head_runs_a_piece_at_a_time_and_again_in_the_backward():
    """No call of the head sees more than piece_tokens tokens; each piece runs in the forward and once more in the
    backward's recomputation."""
    model = use_chunked_loss(tiny_llama(), piece_tokens=64)
    seen: list[int] = []
    model.lm_head.register_forward_hook(lambda module, args, output: seen.append(args[0].shape[0]))
    tokens, labels = batch(False)
    model(input_ids=tokens, labels=labels).loss.backward()
    assert seen == [64, 64, 22] + [22, 64, 64]  # the backward recomputes the last piece first


def test_without_labels_the_model_s_own_forward_gives_logits():
    tokens, _ = batch(False)
    model = use_chunked_loss(tiny_llama(), piece_tokens=16)
    torch.testing.assert_close(model(input_ids=tokens).logits, tiny_llama()(input_ids=tokens).logits)


def test_the_trainer_sees_a_forward_that_takes_the_loss_s_keyword_arguments():
    """The Trainer passes num_items_in_batch only to a forward with **kwargs; a second call changes the pieces
    instead of wrapping the wrapper."""
    model = use_chunked_loss(use_chunked_loss(tiny_llama(), piece_tokens=8), piece_tokens=32)
    parameters = inspect.signature(model.forward).parameters
    assert any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    assert "input_ids" in parameters and "labels" in parameters
    seen: list[int] = []
    model.lm_head.register_forward_hook(lambda module, args, output: seen.append(args[0].shape[0]))
    with torch.no_grad():
        model(input_ids=batch(False)[0][:, :16], labels=batch(False)[0][:, :16])
    assert seen == [32, 16]


def test_a_model_without_a_head_or_with_soft_capped_logits_is_refused():
    with pytest.raises(TypeError, match="HF causal LM"):
        use_chunked_loss(torch.nn.Linear(4, 4))
    model = tiny_llama()
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        use_chunked_loss(model)
    with pytest.raises(ValueError, match="piece_tokens"):
        chunked_causal_lm_loss(torch.nn.Linear(4, 5), torch.zeros(1, 3, 4), torch.zeros(1, 3, dtype=torch.long),
                               piece_tokens=0)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("with_ignored, num_items", CASES[1:])
def test_on_an_offloaded_model_the_chunked_loss_equals_hf_s_on_the_plain_one(tmp_path, tied, with_ignored, num_items):
    """The head's block is fetched by tierstore's hooks in each piece and again in each piece's recomputation: the
    loss and every gradient equal HF's on the plain model (fp32, the CPU); the head tied to the embedding too."""
    tokens, labels = batch(with_ignored)
    extra = {} if num_items is None else {"num_items_in_batch": torch.tensor(num_items)}
    expected, expected_grads = loss_and_grads(tiny_llama(tied=tied), tokens, labels, **extra)
    model = tiny_llama(tied=tied)
    grads: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():  # registered before offload(): they run before tierstore's own hook,
        # while the gradient is still on the device (then it leaves for the pending step)
        param.register_post_accumulate_grad_hook(lambda p, name=name: grads.__setitem__(name, p.grad.detach().clone()))
    # min_block_size 1 byte: the head is a block of its own, so its fetch is the hooks' doing
    model, optimizer = offload(model, {"device": "cpu", "dtype": "fp32", "blocks": {"min_block_size": 1},
                                                       "optimizer": {"grad_clip": None, "user_grad_clip": True}})
    use_chunked_loss(model, piece_tokens=40)
    with optimizer.session:
        out = model(input_ids=tokens, labels=labels, **extra)
        out.loss.backward()
        optimizer.step()
        torch.testing.assert_close(out.loss, expected.loss, rtol=1e-6, atol=1e-6)
        assert grads.keys() == expected_grads.keys()
        for name, grad in expected_grads.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
