"""A chunked cross-entropy for HF causal LMs: the loss HF computes, without the logits of the whole batch.

``use_chunked_loss(model)`` makes ``model(input_ids=..., labels=...)`` return HF's ``.loss`` (the mean over the
labels that are not ``-100``, shifted one position as HF shifts them; with ``num_items_in_batch``, as the HF Trainer
passes it under gradient accumulation, the sum divided by that count) while the output head runs on
``piece_tokens`` tokens at a time. Each piece's logits are recomputed in the backward (activation checkpointing of
the head and the cross-entropy), so at most one piece's logits, and their gradient, exist at once: for a 128k
vocabulary, 4 sequences of 4096 tokens would hold 8.4 GB of fp32 logits and as much again for their gradient.
The output carries the loss and no logits. Without labels the model's own forward runs (logits for evaluation and
generation).

Each piece calls the output head as a module, so tierstore's module hooks fetch its block in the forward and again
in the piece's recomputation in the backward: it serves an offloaded model and a plain one alike. Owns nothing of
the engine; needs ``transformers`` only for the output class (the ``hf`` extra).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100  # HF's label for a position without a loss
DEFAULT_PIECE_TOKENS = 1024  # 0.5 GiB of fp32 logits of a 128k vocabulary
# Keyword arguments that belong to the loss, not to the base model's forward.
LOSS_KWARGS = ("num_items_in_batch", "ignore_index", "shift_labels")
_ORIGINAL_FORWARD = "_tierstore_original_forward"  # on a patched forward: the model's forward before the patch


def chunked_causal_lm_loss(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor | None = None, *,
                           shift_labels: torch.Tensor | None = None, num_items_in_batch: Any = None,
                           ignore_index: int = IGNORE_INDEX, piece_tokens: int = DEFAULT_PIECE_TOKENS) -> torch.Tensor:
    """HF's causal-LM loss of ``head(hidden)`` against ``labels``, taken ``piece_tokens`` tokens at a time.

    ``labels`` are shifted as HF shifts them (the last position of each sequence gets ``ignore_index``), or
    ``shift_labels`` are given already shifted. The loss is the fp32 cross-entropy summed over the positions whose
    label is not ``ignore_index``, divided by ``num_items_in_batch`` when given (the Trainer's count over all
    micro-batches of a step), else by the number of those positions."""
    if piece_tokens < 1:
        raise ValueError(f"piece_tokens is {piece_tokens}: give the number of tokens whose logits exist at once (>= 1)")
    if shift_labels is None:
        if labels is None:
            raise ValueError("chunked_causal_lm_loss needs labels or shift_labels")
        shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    flat = hidden.reshape(-1, hidden.shape[-1])  # a view: the base model's output is contiguous
    targets = shift_labels.reshape(-1).to(flat.device)
    if targets.numel() != flat.shape[0]:
        raise ValueError(f"{targets.numel()} labels for {flat.shape[0]} hidden states: labels must have the shape of "
                         "input_ids")
    piece = functools.partial(_piece_loss, head, ignore_index=ignore_index)
    total = flat.new_zeros((), dtype=torch.float32)
    for start in range(0, flat.shape[0], piece_tokens):
        stop = start + piece_tokens
        if torch.is_grad_enabled():
            # No randomness in a head and a cross-entropy: nothing to replay in the recomputation.
            total = total + checkpoint(piece, flat[start:stop], targets[start:stop], use_reentrant=False,
                                       preserve_rng_state=False)
        else:
            total = total + piece(flat[start:stop], targets[start:stop])
    if num_items_in_batch is None:
        return total / (targets != ignore_index).sum()
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def _piece_loss(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, *, ignore_index: int) -> torch.Tensor:
    """The summed fp32 cross-entropy of one piece; the head is called as a module, so its hooks run."""
    logits = head(hidden).float()
    return nn.functional.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="sum")


def use_chunked_loss(model: nn.Module, piece_tokens: int = DEFAULT_PIECE_TOKENS) -> nn.Module:
    """Make an HF causal LM's forward take its loss ``piece_tokens`` tokens at a time (this module's docstring).

    Call it before or after ``offload()``, before handing the model to ``transformers.Trainer``; the model is changed
    in place and returned. A second call changes ``piece_tokens``. The model must have an output head
    (``get_output_embeddings()``) over its base model's last hidden state (``base_model``), as ``*ForCausalLM``
    models of transformers have; a head with extra arithmetic in the model's forward (logit soft-capping, scaling)
    is not reproduced, so such models are refused."""
    if piece_tokens < 1:
        raise ValueError(f"piece_tokens is {piece_tokens}: give the number of tokens whose logits exist at once (>= 1)")
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    base = getattr(model, "base_model", None)
    if not isinstance(head, nn.Module) or not isinstance(base, nn.Module) or base is model:
        raise TypeError(f"use_chunked_loss needs an HF causal LM (a *ForCausalLM model with an output head and a base "
                        f"model); {type(model).__name__} has no get_output_embeddings() or base_model")
    config = getattr(model, "config", None)
    for setting in ("final_logit_softcapping", "logit_scale", "output_multiplier_scale"):
        if getattr(config, setting, None) not in (None, 1, 1.0):
            raise ValueError(f"{type(model).__name__} applies config.{setting} to its logits in its forward, which the "
                             "chunked loss does not reproduce: train it with HF's own loss")
    original = getattr(model.forward, _ORIGINAL_FORWARD, model.forward)
    forward = _chunked_forward(original, base, head, piece_tokens)
    setattr(forward, _ORIGINAL_FORWARD, original)
    model.forward = types.MethodType(forward, model)
    return model


def _chunked_forward(original: Callable[..., Any], base: nn.Module, head: nn.Module,
                     piece_tokens: int) -> Callable[..., Any]:
    """The patched forward: the base model, then the chunked loss; the original forward when there are no labels."""

    def forward(self: nn.Module, input_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                **kwargs: Any) -> Any:
        if labels is None and kwargs.get("shift_labels") is None:
            return original(input_ids=input_ids, **kwargs)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        loss_kwargs = {name: kwargs.pop(name) for name in LOSS_KWARGS if name in kwargs}
        kwargs.pop("logits_to_keep", None)  # logits are not returned: nothing to keep
        outputs = base(input_ids=input_ids, **kwargs)
        loss = chunked_causal_lm_loss(head, outputs[0], labels, piece_tokens=piece_tokens, **loss_kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=None, hidden_states=getattr(outputs, "hidden_states", None),
                                      attentions=getattr(outputs, "attentions", None))

    # Not functools.wraps: the Trainer reads this signature (its **kwargs is what makes it pass num_items_in_batch),
    # and a __wrapped__ would send inspect.signature to the original's.
    forward.__doc__ = original.__doc__
    return forward
