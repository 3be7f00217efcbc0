"""Train a model whose full training state does not fit on the GPU, with AdamW, through all three tiers.

The model is built on the meta device (it never exists whole on the host) and filled block by block;
the first blocks' optimizer state lives on the GPU (optimizer.gpu_update_fraction), the rest of the fp32
master in pinned host memory and the Adam moments in NVMe swap files. Prints the memory plan first, then
loss and step time per step, then where the time went (the profiler's stall split).

    python examples/train_oversized.py --hidden 5120 --layers 32 --ffn 13824 --nvme-dir /var/tmp/ts \\
        --gpu-update-fraction 0.5 --steps 4            # about 10.5B parameters

Sizes: ``--hidden/--layers/--ffn/--heads/--vocab``; run ``tierstore plan`` logic first with ``--plan-only``.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time

import torch

from runtime import offload
from runtime.bundled.example_model import ExampleLM, ModelShape
from runtime.model.materialize import seeded_normal_init
from runtime.profiler import Profiler, measure_ceilings


def main(argv: list[str] | None = None) -> int:
    """Build, offload and train; returns 0 when the loss stayed finite and went down."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=688)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--nvme-dir", default="tmp", help="directory for the moments' swap files ('tmp': a temporary one)")
    parser.add_argument("--nvme-budget", default="56GiB")
    parser.add_argument("--gpu-update-fraction", type=float, default=0.5)
    parser.add_argument("--plan-only", action="store_true", help="print the memory plan and exit")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    shape = ModelShape(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
                       ffn_size=args.ffn, max_seq_len=args.seq_len)
    cuda = torch.cuda.is_available()
    config = {"dtype": "bf16" if cuda else "fp32",
              "optimizer": {"grad_clip": None, "lr": args.lr, "gpu_update_fraction": args.gpu_update_fraction},
              "placement": {"weights": "host", "master": "host", "moments": "nvme"},
              "tiers": {"nvme": {"path": args.nvme_dir, "budget": args.nvme_budget, "io_threads": 8}}}
    print(f"model: {shape.num_params / 1e9:.2f}B parameters; full AdamW state {shape.num_params * 16 / 2**30:.1f} GiB "
          f"(bf16 weights + fp32 master + two fp32 moments + fp32 gradients)", file=sys.stderr)
    with torch.device("meta"):
        model = ExampleLM(shape)
    if args.plan_only:
        from runtime.config.loader import load_config
        from runtime.core.blocks import build_blocks
        from runtime.model.recompute import recompute_refusal
        from runtime.planning.placement import resolve_plan
        from runtime.planning.settings import resolve_device
        from runtime.session import machine_rates

        cfg = load_config(config)
        device = resolve_device(cfg)
        blocks = build_blocks(model, cfg.blocks.min_block_size)
        print(resolve_plan(blocks, cfg, device, rates=machine_rates(cfg, device),
                           recomputable=recompute_refusal(blocks) is None).plan.table())
        return 0
    start = time.perf_counter()
    model, optimizer = offload(model, config, init=seeded_normal_init)
    session = optimizer.session
    print(session.plan.table(), file=sys.stderr)
    print(f"setup (init, pin, write moments) {time.perf_counter() - start:.1f} s", file=sys.stderr)
    device = session.store.device
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, shape.vocab_size, (args.batch_size, args.seq_len + 1), generator=g).to(device)
    losses = []
    try:
        with tempfile.TemporaryDirectory() as profile_dir:
            profiler = Profiler(session, measure_ceilings(session.store)).start()
            for step in range(1, args.steps + 1):
                t0 = time.perf_counter()
                loss = model(tokens[:, :-1], tokens[:, 1:])
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                losses.append(loss.item())
                print(f"step {step}: loss {losses[-1]:.4f}  {time.perf_counter() - t0:.2f} s", file=sys.stderr)
            optimizer.synchronize()
            profiler.stop()
            saved = profiler.save(profile_dir, trace=False, plot=False)
            print((saved.directory / "report.txt").read_text())
    finally:
        session.close()
    ok = all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}: {'finite and decreasing' if ok else 'NOT decreasing'}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
