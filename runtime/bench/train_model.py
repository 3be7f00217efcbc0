"""The model a ``tierstore bench train`` row trains: its shape, how it is built, its batch and its loss.

Every row (plain PyTorch, tierstore, DeepSpeed) builds its model here, from one :class:`BenchModel`, and
computes its loss through :func:`batch_loss`, so rows differ only in where the training state lives.
Two model kinds: ``example`` (``runtime.bundled.example_model.ExampleLM``, multi-head attention only) and
``hf-llama`` (``transformers.LlamaForCausalLM`` built from a ``LlamaConfig``: no download, random init,
SDPA attention). Both use seed 0. The data is synthetic: uniform random tokens, the same for every row.
Nothing here times anything.
"""

from __future__ import annotations

import argparse
import json
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from runtime.bundled.example_model import PRESETS, ExampleLM, ModelShape

SEQ_LEN = 1024  # default sequence length of a bench row
MICRO_BATCH = 8  # default micro-batch of a bench row
MODEL_KINDS = ("example", "hf-llama")


@dataclass(frozen=True)
class BenchModel:
    """The shape of the benchmark model and of its batch."""

    kind: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied: bool
    seq: int = SEQ_LEN
    micro_batch: int = MICRO_BATCH
    # Activation checkpointing in every decoder layer (a row's -ckpt): each layer's forward runs again in the
    # backward, and only its input is kept. Same gradients; less activation memory, more compute.
    checkpointing: bool = False

    def __post_init__(self) -> None:
        if self.kind not in MODEL_KINDS:
            raise ValueError(f"--model {self.kind}: choose one of {', '.join(MODEL_KINDS)}")
        for name in ("hidden", "layers", "heads", "kv_heads", "ffn", "vocab", "seq", "micro_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.hidden % self.heads:
            raise ValueError(f"--hidden {self.hidden} is not a multiple of --heads {self.heads}; change one of them")
        if self.heads % self.kv_heads:
            raise ValueError(f"--heads {self.heads} is not a multiple of --kv-heads {self.kv_heads}; change one of them")
        if self.kind == "example" and self.kv_heads != self.heads:
            raise ValueError(f"--kv-heads {self.kv_heads} differs from --heads {self.heads}, and the example model has "
                             "no grouped-query attention; pass --model hf-llama (or drop --kv-heads)")

    @classmethod
    def from_preset(cls, preset: str, kind: str = "example", **overrides: Any) -> BenchModel:
        """The preset's shape (``runtime.bundled.example_model.PRESETS``), then every override that is not None;
        ``kv_heads`` defaults to the number of heads (multi-head attention)."""
        if preset not in PRESETS:
            raise ValueError(f"--preset {preset}: choose one of {', '.join(PRESETS)}")
        shape = PRESETS[preset]
        heads = overrides.get("heads") or shape.num_heads
        spec: dict[str, Any] = {"kind": kind, "hidden": shape.hidden_size, "layers": shape.num_layers, "heads": heads, "kv_heads": heads,
                "ffn": shape.ffn_size, "vocab": shape.vocab_size, "tied": shape.tie_embeddings}
        spec.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**spec)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> BenchModel:
        """The shape ``tierstore bench train``'s options ask for (``--preset`` then the explicit ones)."""
        return cls.from_preset(args.preset, args.model, hidden=args.hidden, layers=args.layers, heads=args.heads,
                               kv_heads=args.kv_heads, ffn=args.ffn, vocab=args.vocab, tied=args.tied, seq=args.seq,
                               micro_batch=args.micro_batch)

    def to_json(self) -> str:
        """This shape as JSON, for a row's child process."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> BenchModel:
        """The inverse of :meth:`to_json`."""
        return cls(**json.loads(text))

    @property
    def tokens_per_micro_batch(self) -> int:
        """Tokens one forward processes."""
        return self.seq * self.micro_batch

    def example_shape(self) -> ModelShape:
        """The ``ExampleLM`` shape of this spec."""
        return ModelShape(vocab_size=self.vocab, hidden_size=self.hidden, num_layers=self.layers, num_heads=self.heads,
                          ffn_size=self.ffn, max_seq_len=self.seq, tie_embeddings=self.tied)

    def describe(self) -> str:
        """One line for the table's header."""
        attention = f"{self.heads} heads" + (f" ({self.kv_heads} kv)" if self.kv_heads != self.heads else "")
        return (f"{self.kind}: hidden {self.hidden}, {self.layers} layers, {attention}, ffn {self.ffn}, vocab {self.vocab}"
                f"{', tied embeddings' if self.tied else ''}; seq {self.seq}, micro-batch {self.micro_batch}"
                f"{', activation checkpointing' if self.checkpointing else ''}")


def build_model(spec: BenchModel) -> nn.Module:
    """The model of ``spec`` in fp32 on the current default device, seeded with 0 (every row gets the same
    initial weights). Under ``torch.device("meta")`` nothing is allocated (for counting parameters)."""
    torch.manual_seed(0)
    if spec.kind == "example":
        return ExampleLM(spec.example_shape(), activation_checkpointing=spec.checkpointing)
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.ffn,
                         num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
                         max_position_embeddings=spec.seq, tie_word_embeddings=spec.tied, use_cache=False,
                         attn_implementation="sdpa")  # type: ignore[call-arg]  # every config takes it; 5.x's typed __init__ omits it
    model = LlamaForCausalLM(config)
    if spec.checkpointing:
        with warnings.catch_warnings():  # newer transformers renamed it; this name works from 4.35 on
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def count_params(model: nn.Module) -> int:
    """Trainable parameters of the model as built, each shared (tied) tensor counted once."""
    unique = {id(p): p.numel() for _, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
    return sum(unique.values())


def spec_num_params(spec: BenchModel) -> int:
    """Parameters of the model ``spec`` builds, counted on a meta-device copy (nothing allocated)."""
    with torch.device("meta"):
        return count_params(build_model(spec))


def make_batch(spec: BenchModel, device: torch.device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of one micro-batch (``micro_batch x seq`` tokens each). For ``hf-llama`` the
    targets are the inputs themselves: the model shifts labels by one position internally."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, spec.vocab, (spec.micro_batch, spec.seq + 1), generator=g)
    inputs = tokens[:, :-1]
    targets = inputs if spec.kind == "hf-llama" else tokens[:, 1:]
    return inputs.to(device), targets.to(device)


def batch_loss(spec: BenchModel, model: Callable[..., Any], batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The mean cross-entropy of one micro-batch. ``model`` is the module or anything that calls it with the
    same arguments (a DeepSpeed engine)."""
    inputs, targets = batch
    if spec.kind == "hf-llama":
        return model(input_ids=inputs, labels=targets).loss
    return model(inputs, targets)
