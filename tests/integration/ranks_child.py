"""One rank of a several-process training run (tests/integration/test_ranks.py), or the one process it is compared
with: the bundled example model trained through ``offload()`` on this rank's share of each global batch. Launched as
torchrun would (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` in the environment), so ``offload()``
joins the process group itself. With ``optimizer.user_grad_clip`` the loop clips each step with
``torch.nn.utils.clip_grad_norm_`` (the HF Trainer's way). Writes the losses, the clip's norms, and the final
weights (every rank reads them through the collective ``master_state_dict()``) to ``<out>/rank<R>.pt``."""

from __future__ import annotations

import json
import os
import sys

import torch

from runtime import offload
from runtime.bundled.example_model import ExampleLM, ModelShape

USER_CLIP = 0.05  # the loop's clip_grad_norm_ threshold where the config has optimizer.user_grad_clip: below the norms
SHAPE = ModelShape(vocab_size=256, hidden_size=32, num_layers=3, num_heads=4, ffn_size=64, max_seq_len=64)


def global_batches(steps: int, accumulation: int, global_batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The run's micro-batches of ``global_batch`` sequences each, the same on every rank (seeded)."""
    from runtime.bundled.data import ByteBatches, stdlib_text_bytes

    data = ByteBatches(stdlib_text_bytes(1 << 20), batch_size=global_batch, seq_len=32, seed=0)
    return [data.next() for _ in range(steps * accumulation)]


class PieceLossLM(ExampleLM):
    """The example model whose loss is taken ``piece`` tokens at a time, each piece's head and cross-entropy
    recomputed in the backward (a chunked loss, as ``runtime.integrations.hf_loss``'s): the head is acquired once a
    piece, one acquire after another."""

    def __init__(self, shape: ModelShape, piece: int):
        super().__init__(shape)
        self.piece = piece

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        from runtime.bundled.example_model import rotary_tables

        cos, sin = rotary_tables(tokens.shape[1], self.shape.hidden_size // self.shape.num_heads, tokens.device)
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        hidden, labels = self.norm(x).reshape(-1, self.shape.hidden_size), targets.reshape(-1)

        def piece_loss(h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(self.head(h).float(), t, reduction="sum")

        total = sum(checkpoint(piece_loss, hidden[start:start + self.piece], labels[start:start + self.piece],
                               use_reentrant=False) for start in range(0, labels.numel(), self.piece))
        return total / labels.numel()


def main(out: str, config: dict, steps: int, global_batch: int) -> None:
    """Train: rank R of N feeds rows [R*B/N, (R+1)*B/N) of each global micro-batch."""
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    accumulation = config.get("optimizer", {}).get("accumulation_steps", 1)
    torch.manual_seed(0)
    piece = config.pop("test_loss_piece", None)  # the test's, not offload()'s: a loss taken that many tokens a piece
    # the same initial values on every rank; the owners' are the ones kept
    model = ExampleLM(SHAPE) if piece is None else PieceLossLM(SHAPE, piece)
    mine = os.environ.get(f"RANKS_TEST_CONFIG_RANK{rank}")  # a test's setting for one rank only (a refused plan)
    if mine is not None:
        config = {**config, **json.loads(mine)}
    model, optimizer = offload(model, config)
    session = optimizer.session
    keys = sorted(str(key) for key in session.store.keys())  # the state this rank keeps
    cores = sorted(os.sched_getaffinity(0))
    fail = os.environ.get("RANKS_TEST_FAIL")  # "RANK:STEP:raise|kill": that rank fails in that step's backward
    if fail is not None and int(fail.split(":")[0]) == rank:
        fail_step, how = int(fail.split(":")[1]), fail.split(":")[2]

        def hook(module: torch.nn.Module, grad_in: object, grad_out: object) -> None:
            if state["step"] == fail_step:
                if how == "kill":
                    os._exit(9)
                raise RuntimeError(f"test failure on rank {rank} in the backward of step {fail_step}")

        model.layers[1].register_full_backward_hook(hook)
    state = {"step": 0}
    share = global_batch // world
    losses, norms = [], []
    user_clip = config.get("optimizer", {}).get("user_grad_clip", False)  # the loop clips, as the HF Trainer does
    try:
        for step in range(steps):
            state["step"] = step
            for x, y in global_batches(steps, accumulation, global_batch)[step * accumulation:(step + 1) * accumulation]:
                device = next(model.parameters()).device  # the compute device (a rank's GPU under NCCL)
                loss = model(x[rank * share:(rank + 1) * share].to(device), y[rank * share:(rank + 1) * share].to(device))
                optimizer.scale_loss(loss).backward()  # fp16: the loss scale (identity otherwise)
                losses.append(loss.item())
            if user_clip:
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), USER_CLIP)))
            optimizer.step()
            optimizer.zero_grad()
        lone = os.environ.get("RANKS_TEST_LONE_READ")  # "raise|kill": after training rank 1 fails, rank 0 reads alone
        if lone is not None and rank == 1:
            if lone == "kill":
                os._exit(9)
            raise RuntimeError("test failure on rank 1 after training")
        weights = session.master_state_dict()
        scaler = session.controller.scaler
        loss_scale = None if scaler is None else float(scaler.scale)
        gathered_ahead = session.controller.weights.gathered_ahead
        held_hits = session.controller.weights.held_hits
        kept_for_next_hits = session.controller.fetch.kept_for_next_hits
    finally:
        session.close()
    torch.save({"losses": losses, "norms": norms, "loss_scale": loss_scale, "weights": weights, "keys": keys,
                "cores": cores, "gathered_ahead": gathered_ahead, "held_hits": held_hits, "kept_for_next_hits": kept_for_next_hits,
                "params": {n: p.detach().clone() for n, p in model.named_parameters()}},
               os.path.join(out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
