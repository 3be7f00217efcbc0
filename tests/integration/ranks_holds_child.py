"""One rank of a run whose blocks are held past their forward in two ways that once broke the ranks' agreement on
a held block ([Note: held blocks are not broadcast again]), or the one process it is compared with. Two sessions
one after the other, in this process:

1. a tied embedding and head (one block, used first and last in the forward) and a loop that skips a step's backward
   (a non-finite loss, say): the head's forward ends holding the block for the next acquire, which the trace expects
   to be its backward; the next forward begins instead and releases it;
2. a tied head with a bias of its own (two blocks released by one forward's end) under a keep-for-backward budget
   that the second of them overruns, evicting the first, which was just held for the next acquire.

Writes each session's losses to ``<out>/rank<R>.pt``."""

from __future__ import annotations

import os
import sys

import torch
from torch import nn

from runtime import offload
from runtime.bundled.example_model import ExampleLM, ModelShape

SHAPE = ModelShape(vocab_size=256, hidden_size=32, num_layers=3, num_heads=4, ffn_size=64, max_seq_len=64,
                   tie_embeddings=True)


class BiasedHead(ExampleLM):
    """The tied example model with a bias on its head and no final norm: the head's weight and bias in two blocks."""

    def __init__(self) -> None:
        super().__init__(SHAPE)
        self.norm = nn.Identity()
        self.head = nn.Linear(SHAPE.hidden_size, SHAPE.vocab_size, bias=True)
        self.head.weight = self.embed.weight


def train(model: nn.Module, config: dict, steps: int, skip: int | None) -> list[float]:
    """``steps`` steps of one fixed batch (the same on every rank: the ranks' mean is one process's); the forward of
    step ``skip`` is not followed by a backward or a step."""
    model, optimizer = offload(model, config)
    generator = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, SHAPE.vocab_size, (2, 16), generator=generator) for _ in range(2))
    losses = []
    try:
        for step in range(steps):
            loss = model(x, y)
            losses.append(loss.item())
            if step == skip:
                continue
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    finally:
        optimizer.session.close()
    return losses


def main(out: str) -> None:
    rank = int(os.environ.get("RANK", "0"))
    plain = {"device": os.environ.get("RANKS_TEST_DEVICE", "cpu"), "dtype": "fp32", "optimizer": {"lr": 1e-3}}
    torch.manual_seed(0)
    skipped = train(ExampleLM(SHAPE), plain, steps=4, skip=2)
    torch.manual_seed(0)
    # 156,416 bytes: room for the head's weight block and not for its bias block beside it
    evicted = train(BiasedHead(), {**plain, "prefetch": {"depth": 0, "keep_for_backward": 156416}}, steps=3, skip=None)
    torch.save({"skipped": skipped, "evicted": evicted}, os.path.join(out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
