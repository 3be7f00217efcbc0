"""GPU check of ``tierstore plan --model``'s predicted step time against measured steps (issue 41).

For three Llama-shaped configs (Llama-3.2-1B's and 3B's shapes, and Llama-3-8B's with 8 of its 32 layers) it writes a
config directory (``config.json``, nothing downloaded), runs ``plan --model DIR``'s prediction in this process under
a 24 GiB GPU cap, then trains a few steps of the same model the way ``tierstore train --model`` does: HF's
``AutoModelForCausalLM`` with random weights, bf16 compute, activation checkpointing, HF's own loss, the sequence,
micro-batch and accumulation planned, the plan's config given to ``offload()`` as it is. It prints one table:
predicted and measured step time (the median of the timed steps after the warm-up ones) and their ratio.

    python examples/plan_check.py                    # on one H200: about 5 minutes for all three
    python examples/plan_check.py --tiny --steps 2   # the CPU path (the tests run it)

Needs the ``hf`` extra (transformers, accelerate).
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

# name: (hidden, layers, heads, kv heads, ffn, vocab, tied)
SHAPES = {
    "llama-1b": (2048, 16, 32, 8, 8192, 128256, False),
    "llama-3b": (3072, 28, 24, 8, 8192, 128256, False),
    "llama-8b-8layers": (4096, 8, 32, 8, 14336, 128256, False),
}
TINY = {"tiny": (64, 2, 4, 2, 128, 256, False)}


def write_config(directory: Path, shape: tuple[int, int, int, int, int, int, bool], seq: int) -> None:
    """An HF ``LlamaConfig`` of ``shape`` saved to ``directory`` (its ``config.json``)."""
    from transformers import LlamaConfig

    hidden, layers, heads, kv_heads, ffn, vocab, tied = shape
    LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                intermediate_size=ffn, vocab_size=vocab, tie_word_embeddings=tied, max_position_embeddings=max(seq, 128),
                use_cache=False).save_pretrained(directory)


def predict(directory: Path, args: argparse.Namespace) -> Any:
    """``tierstore plan --model DIR``'s result, in this process."""
    from runtime.cli.main import build_parser
    from runtime.cli.plan import plan_model_dir

    argv = ["plan", "--model", str(directory), "--seq", str(args.seq), "--micro-batch", str(args.micro_batch),
            "--accumulation", str(args.accumulation), "--gpu-memory", args.gpu_cap]
    return plan_model_dir(build_parser().parse_args(argv))


def measure(directory: Path, config: dict[str, Any], args: argparse.Namespace) -> list[float]:
    """Seconds of each timed step (after ``--warmup`` steps) training the model of ``directory`` with ``config``."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from runtime import offload
    from runtime.model.materialize import seeded_normal_init

    with init_empty_weights(include_buffers=False):  # rotary tables are computed buffers: keep them real
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory, local_files_only=True))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    model, optimizer = offload(model, config, init=seeded_normal_init)
    session = optimizer.session  # type: ignore[attr-defined]
    device = session.store.device
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    times = []
    try:
        for step in range(args.warmup + args.steps):
            batches = [torch.randint(vocab, (args.micro_batch, args.seq), generator=generator)
                       for _ in range(args.accumulation)]
            _sync(device)
            start = time.perf_counter()
            for tokens in batches:
                tokens = tokens.to(device)
                loss = model(input_ids=tokens, labels=tokens).loss
                (loss / args.accumulation).backward()
            optimizer.step()
            optimizer.zero_grad()
            optimizer.synchronize()  # type: ignore[attr-defined]
            _sync(device)
            seconds = time.perf_counter() - start
            print(f"  step {step + 1}: {seconds:.2f} s, loss {loss.item():.3f}", file=sys.stderr)
            if step >= args.warmup:
                times.append(seconds)
    finally:
        session.close()
    del model, optimizer, session
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return times


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> int:
    """Predict and measure each shape; print the table. 0 when every ratio is within --tolerance."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="one tiny shape, short sequences (the CPU path)")
    parser.add_argument("--only", help="comma-separated names of the shapes to run (default: all)")
    parser.add_argument("--seq", type=int, default=2048, help="sequence length (default 2048)")
    parser.add_argument("--micro-batch", type=int, default=2, help="sequences a forward (default 2)")
    parser.add_argument("--accumulation", type=int, default=4, help="micro-batches a step (default 4)")
    parser.add_argument("--warmup", type=int, default=2, help="steps not timed (default 2: the first step's placement "
                                                              "settles, caches fill)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps (default 3)")
    parser.add_argument("--gpu-cap", default="24GiB", help="GPU memory of the process and the plan (default 24GiB)")
    parser.add_argument("--tolerance", type=float, default=0.15, help="largest |predicted / measured - 1| (default 0.15)")
    args = parser.parse_args(argv)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # before CUDA starts, as the example
    logging.basicConfig(level=logging.WARNING)
    from runtime.config.units import parse_size

    shapes = TINY if args.tiny else SHAPES
    if args.tiny:
        args.seq, args.micro_batch, args.accumulation = min(args.seq, 32), min(args.micro_batch, 2), min(args.accumulation, 2)
        args.warmup = min(args.warmup, 1)
    if args.only:
        shapes = {name: shapes[name] for name in args.only.split(",")}
    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, parse_size(args.gpu_cap) / total))
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for name, shape in shapes.items():
            directory = Path(root) / name
            write_config(directory, shape, args.seq)
            result = predict(directory, args)
            if result.prediction is None:
                print(f"{name}: the plan does not fit: {result.refusal}", file=sys.stderr)
                return 1
            print(f"{name}: {result.description}\n{result.table}\n{result.prediction.describe()}", file=sys.stderr)
            times = measure(directory, result.config, args)
            rows.append((name, result.prediction.step_s, statistics.median(times)))
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (no CUDA: predicted for stated rates)"
    print(f"plan --model: predicted vs measured step, {device}, sequence {args.seq}, micro-batch {args.micro_batch}, "
          f"accumulation {args.accumulation}, GPU cap {args.gpu_cap}")
    print(f"  {'model':<18}{'predicted s':>12}{'measured s':>12}{'ratio':>8}")
    for name, predicted, measured in rows:
        print(f"  {name:<18}{predicted:>12.3f}{measured:>12.3f}{predicted / measured:>8.2f}")
    return 0 if all(abs(p / m - 1) <= args.tolerance for _, p, m in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
