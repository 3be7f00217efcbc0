"""The 8B workstation scenario through an unchanged HF ``Trainer``: the row to compare with examples/finetune_8b.py.

The model, tiers and work of ``finetune_8b.py`` (its flags: shape, ``--seq``, ``--micro-batch``, ``--global-batch``,
``--gpu-cap``, ``--host-budget``, ``--nvme-dir``, ``--set``, ...), trained by the stock ``transformers.Trainer``:
bf16, gradient checkpointing, ``per_device_train_batch_size`` = ``--micro-batch``, ``gradient_accumulation_steps`` =
``--global-batch / --micro-batch``, ``max_grad_norm`` 1.0 (so the config sets ``optimizer.user_grad_clip: true``),
the optimizer from ``offload()`` given as ``optimizers=(optimizer, None)``. The loss (``--loss``): Liger's fused
linear cross-entropy (``use_liger_kernel=True``) where ``liger_kernel`` imports and a GPU is there, else tierstore's
chunked loss (``runtime.integrations.hf_loss.use_chunked_loss``, ``--loss-piece`` tokens at a time); ``hf`` is HF's
own loss, whose logits for a whole micro-batch need micro-batch 1 under a 24 GiB cap.

It prints per optimizer step the line ``finetune_8b.py`` prints (loss, seconds, tokens/s, model TFLOP/s, peak GPU
memory, peak RSS), so the two rows compare.

    python examples/hf_trainer_8b.py --nvme-dir /var/tmp/ts-8b --steps 3          # on the GPU machine
    python examples/hf_trainer_8b.py --loss hf --micro-batch 1 --steps 3 ...      # HF's loss: micro-batch 1

Smaller shapes take the same flags, which is how the tests run it on the CPU. Needs the ``hf`` extra.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import sys
import tempfile
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from finetune_8b import (  # noqa: E402  (the scenario's own definitions)
    add_scenario_args,
    add_tier_args,
    check_scenario_args,
    llama_config,
    prepare_process,
    step_line,
    tierstore_config,
)

from runtime import offload  # noqa: E402
from runtime.bundled.data import ByteBatches, stdlib_text_bytes  # noqa: E402
from runtime.config.units import parse_size  # noqa: E402
from runtime.integrations.hf_loss import use_chunked_loss  # noqa: E402
from runtime.model.materialize import seeded_normal_init  # noqa: E402

LOSSES = ("auto", "liger", "chunked", "hf")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """finetune_8b.py's scenario and tier flags, and which loss the Trainer's model takes."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_scenario_args(parser)
    add_tier_args(parser)
    parser.add_argument("--loss", choices=LOSSES, default="auto",
                        help="liger: TrainingArguments(use_liger_kernel=True); chunked: use_chunked_loss(model, "
                             "--loss-piece); hf: HF's own loss; auto (default): liger where liger_kernel imports and a "
                             "GPU is there, else chunked")
    args = parser.parse_args(argv)
    check_scenario_args(parser, args)
    args.host_budget = parse_size(args.host_budget)
    if args.loss == "auto":
        args.loss = "liger" if torch.cuda.is_available() and importlib.util.find_spec("liger_kernel") else "chunked"
    return args


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    """The Llama of the given shape on the meta device, HF's own forward (the Trainer turns checkpointing on)."""
    from accelerate import init_empty_weights
    from transformers import LlamaForCausalLM

    with init_empty_weights(include_buffers=False):  # rotary tables are computed buffers: keep them real
        model = LlamaForCausalLM(llama_config(args))
    if args.loss == "chunked":
        use_chunked_loss(model, args.loss_piece)
    return model


def trainer_config(args: argparse.Namespace, cuda: bool) -> dict:
    """finetune_8b.py's config, the clipping left to the Trainer (``max_grad_norm``): ``user_grad_clip``."""
    config = tierstore_config(args, cuda)
    config["optimizer"].update({"grad_clip": None, "user_grad_clip": True})
    return config


def dataset(args: argparse.Namespace) -> list[dict[str, torch.Tensor]]:
    """finetune_8b.py's sequences of the bundled text, as the Trainer's rows (labels: the tokens, HF shifts them)."""
    data = ByteBatches(stdlib_text_bytes(1 << 24), batch_size=args.micro_batch, seq_len=args.seq, seed=0)
    rows = [row for _ in range(args.steps * args.global_batch // args.micro_batch) for row in data.next()[0]]
    return [{"input_ids": row, "labels": row.clone()} for row in rows]


def step_lines(args: argparse.Namespace, num_params: int) -> Any:
    """A TrainerCallback printing each optimizer step's line (``finetune_8b.step_line``) and keeping the losses."""
    from transformers import TrainerCallback

    class StepLines(TrainerCallback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.losses: list[float] = []
            self._start = self._seconds = 0.0
            self.clip_s = 0.0  # the Trainer's clip_grad_norm_ in the step (timed by timed_clip)

        def on_step_begin(self, *unused: Any, **kwargs: Any) -> None:
            if not self._start:  # the first step's first micro-batch; later steps are timed from the previous end
                self._start = time.perf_counter()

        def on_step_end(self, *unused: Any, **kwargs: Any) -> None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            # From the end of the previous step, not from this step's on_step_begin: the Trainer's own work between
            # steps (its data loader, logging) is part of what a user waits for, as finetune_8b.py's step times it.
            now = time.perf_counter()
            self._seconds, self._start = now - self._start, now

        def on_log(self, training_args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
            if logs and "loss" in logs:
                self.losses.append(float(logs["loss"]))
                print(f"{step_line(args, state.global_step, self.losses[-1], self._seconds, num_params)}, the Trainer's "
                      f"clip_grad_norm_ {self.clip_s:.3f} s", file=sys.stderr)
                self.clip_s = 0.0

        def timed_clip(self, clip: Any) -> Any:
            """``clip`` (the Trainer's accelerator.clip_grad_norm_, called as it was) with its seconds counted: what
            the Trainer's clip, which needs user_grad_clip, costs beside tierstore's own at the commit."""
            def timed(*call_args: Any, **call_kwargs: Any) -> Any:
                start = time.perf_counter()
                norm = clip(*call_args, **call_kwargs)
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                self.clip_s += time.perf_counter() - start
                return norm

            return timed

    return StepLines()


def checkpointing_args(arguments: type) -> dict[str, Any]:
    """Activation checkpointing of the decoder layers, non-reentrant, under the name this transformers gives it
    (``activation_checkpointing`` from 5.x on; ``gradient_checkpointing`` before, deprecated since)."""
    name = "activation_checkpointing" if "activation_checkpointing" in {f.name for f in dataclasses.fields(arguments)} \
        else "gradient_checkpointing"
    return {name: True, f"{name}_kwargs": {"use_reentrant": False}}


def main(argv: list[str] | None = None) -> int:
    """Offload, train ``--steps`` optimizer steps with the stock Trainer; 0 when the loss stayed finite and fell."""
    import transformers

    args = parse_args(argv)
    cuda = prepare_process(args)
    model = build_model(args)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"model: {num_params:,} parameters; sequence {args.seq}, {args.global_batch} sequences per step in "
          f"micro-batches of {args.micro_batch}; loss: {args.loss}; the stock transformers.Trainer", file=sys.stderr)
    model, optimizer = offload(model, trainer_config(args, cuda), init=seeded_normal_init)
    lines = step_lines(args, num_params)
    with tempfile.TemporaryDirectory() as out, optimizer.session:
        training = transformers.TrainingArguments(
            output_dir=out, per_device_train_batch_size=args.micro_batch,
            gradient_accumulation_steps=args.global_batch // args.micro_batch, max_steps=args.steps,
            learning_rate=args.lr, lr_scheduler_type="constant", max_grad_norm=1.0, bf16=cuda, use_cpu=not cuda,
            **checkpointing_args(transformers.TrainingArguments), use_liger_kernel=args.loss == "liger", logging_steps=1,
            save_strategy="no", report_to=[], seed=0, disable_tqdm=True)
        trainer = transformers.Trainer(model=model, args=training, train_dataset=dataset(args),
                                       optimizers=(optimizer, None), callbacks=[lines])
        trainer.accelerator.clip_grad_norm_ = lines.timed_clip(trainer.accelerator.clip_grad_norm_)
        trainer.train()
    losses = lines.losses
    ok = bool(losses) and all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}: {'finite and falling' if ok else 'NOT falling'}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
