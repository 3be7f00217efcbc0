"""Full fine-tuning of an 8B Llama on a 24 GiB GPU: the workstation scenario (issue 15), as a script.

An HF ``LlamaForCausalLM`` of the Llama-3-8B shape (hidden 4096, 32 layers, 32 heads, 8 KV heads, ffn 14336,
vocab 128256, untied) is built from a config with its parameters on the meta device (no download, random
init), filled block by block as it is offloaded: bf16 compute, fp32 master weights, full AdamW. The process's
GPU memory is capped (``--gpu-cap``, ``torch.cuda.set_per_process_memory_fraction``), tierstore's pinned
memory is at most ``--host-budget``, and the moments that do not fit there go to NVMe swap files under
``--nvme-dir`` (``placement.moments: auto``). Work: sequence ``--seq`` with activation checkpointing,
gradient accumulation to ``--global-batch`` sequences per optimizer step, global-norm clipping 1.0.

It prints the memory plan, a progress line per micro-batch, and per optimizer step the loss, tokens/s, model
TFLOP/s (6 x parameters x tokens per second; recompute not counted), peak GPU memory, peak RSS and NVMe
bytes; at the end, where the time went (the profiler's split).

    python examples/finetune_8b.py --plan-only                          # the plan, nothing allocated
    python examples/finetune_8b.py --nvme-dir /var/tmp/ts --steps 2     # train (on a GPU machine)
    python examples/finetune_8b.py --compute-bound                      # the floor: all on the GPU, no cap

Smaller shapes take the same flags (``--hidden --layers --heads --kv-heads --ffn --vocab``), which is how the
tests run it on the CPU. Needs the ``hf`` extra (transformers, accelerate).
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import sys
import tempfile
import time
import warnings

import torch
import yaml

from runtime import offload
from runtime.bundled.data import ByteBatches, stdlib_text_bytes
from runtime.config.units import approx_size, parse_size
from runtime.integrations.hf_loss import use_chunked_loss
from runtime.model.materialize import seeded_normal_init
from runtime.planning.memory_plan import PlanError
from runtime.profiler import Profiler, measure_ceilings


class PiecewiseLossLM(torch.nn.Module):
    """The causal LM called on tokens alone, its loss taken a piece of the sequence at a time by tierstore's chunked
    loss (``runtime.integrations.hf_loss.use_chunked_loss``): the logits of a 128k vocabulary for a whole micro-batch
    never exist at once (4 sequences of 4096 tokens: 8.4 GB in fp32, as much again for their gradient, more than the
    rest of a step under a 24 GiB cap). Each piece's logits are recomputed in backward, so the head runs once per
    piece in each pass. The loss is HF's: the mean over the shifted labels. (A module of its own so that the
    DeepSpeed baseline's engine, which calls it on tokens, takes the same loss.)"""

    def __init__(self, lm: torch.nn.Module, piece_tokens: int):
        super().__init__()
        self.lm = use_chunked_loss(lm, piece_tokens)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=input_ids, labels=input_ids).loss


LLAMA3_8B = {"hidden": 4096, "layers": 32, "heads": 32, "kv_heads": 8, "ffn": 14336, "vocab": 128256}


def llama_config(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """The HF ``LlamaConfig`` of the shape on the command line (untied, SDPA attention, no KV cache)."""
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.heads,
                       num_key_value_heads=args.kv_heads, intermediate_size=args.ffn, vocab_size=args.vocab,
                       max_position_embeddings=max(args.seq, 128), tie_word_embeddings=False,
                       attn_implementation="sdpa", use_cache=False)


def for_training(model: torch.nn.Module, args: argparse.Namespace) -> torch.nn.Module:
    """Checkpointing on (non-reentrant), wrapped in the piecewise loss unless ``--loss-piece 0``; train mode."""
    with warnings.catch_warnings():  # newer transformers renamed it; the name here works from 4.35 on
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    if args.loss_piece:
        return PiecewiseLossLM(model, args.loss_piece).train()
    return model.train()


def micro_batch_loss(model: torch.nn.Module, tokens: torch.Tensor, args: argparse.Namespace) -> torch.Tensor:
    """The micro-batch's mean loss: the piecewise loss's, or HF's own with ``--loss-piece 0``."""
    return model(tokens) if args.loss_piece else model(input_ids=tokens, labels=tokens).loss


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    """The Llama of the given shape, parameters on the meta device (buffers on the CPU), checkpointing on."""
    from accelerate import init_empty_weights
    from transformers import LlamaForCausalLM

    with init_empty_weights(include_buffers=False):  # rotary tables are computed buffers: keep them real
        model = LlamaForCausalLM(llama_config(args))
    return for_training(model, args)


def accumulation_steps(args: argparse.Namespace) -> int:
    """Micro-batches each rank runs per optimizer step: ``--global-batch`` sequences over the ranks' micro-batches."""
    return args.global_batch // (args.micro_batch * rank_and_world()[1])


def tierstore_config(args: argparse.Namespace, cuda: bool) -> dict:
    """The scenario's config: weights and master in pinned memory, moments there as far as the budget allows;
    then each ``--set`` on top."""
    # No streamed updates and no weights kept for backward: what auto placement gives them is what the budget
    # leaves beside the activation reserve, to the byte, and at the 8B shape that ran the second step out of memory
    # (call M5, H100: 23.6 GiB peak in step 1, no faster than without them). The step waits on the disk, not on
    # the CPU's updates or the weight fetches.
    config = {
        "dtype": "bf16" if cuda else "fp32",
        "optimizer": {"lr": args.lr, "grad_clip": 1.0, "accumulation_steps": accumulation_steps(args),
                      "gpu_stream_fraction": 0},
        "prefetch": {"keep_for_backward": 0},
        "placement": {"weights": "host", "master": "host", "moments": "auto"},
        "tiers": {"gpu": {"budget": args.gpu_cap, "activation_reserve": args.activation_reserve},
                  "host": {"budget": args.host_budget},
                  "nvme": {"path": args.nvme_dir, "budget": args.nvme_budget, "io_threads": args.io_threads,
                           "block_size": args.io_block}},
    }
    for setting in args.set:
        path, sep, value = setting.partition("=")
        if not sep or not path:
            raise SystemExit(f"--set {setting!r}: expected KEY=VALUE, e.g. prefetch.keep_for_backward=0")
        if path in SET_BY_FLAGS:  # two places for one setting would disagree (and the step lines read the flags)
            raise SystemExit(f"--set {setting!r}: {path} comes from {SET_BY_FLAGS[path]}; set it there")
        *sections, leaf = path.split(".")
        node = config
        for name in sections:
            node = node.setdefault(name, {})
            if not isinstance(node, dict):
                raise SystemExit(f"--set {setting!r}: {name} is a setting, not a section")
        if isinstance(node.get(leaf), dict):
            raise SystemExit(f"--set {setting!r}: {path} is a section; set one of its keys ({', '.join(node[leaf])})")
        try:
            node[leaf] = yaml.safe_load(value)
        except yaml.YAMLError as error:
            raise SystemExit(f"--set {setting!r}: the value is not YAML ({error}); quote strings, e.g. {path}='\"...\"'") from None
    return config


# Settings the script derives from its own flags: --set refuses them, naming the flag.
SET_BY_FLAGS = {
    "dtype": "the device (bf16 on a GPU, fp32 on the CPU)",
    "optimizer.lr": "--lr",
    "optimizer.accumulation_steps": "--global-batch / --micro-batch",
    "tiers.gpu.budget": "--gpu-cap",
    "tiers.gpu.activation_reserve": "--activation-reserve",
    "tiers.host.budget": "--host-budget",
    "tiers.nvme.path": "--nvme-dir",
    "tiers.nvme.budget": "--nvme-budget",
    "tiers.nvme.io_threads": "--io-threads",
    "tiers.nvme.block_size": "--io-block",
}


def add_scenario_args(parser: argparse.ArgumentParser) -> None:
    """The flags of the scenario's work, shared with the DeepSpeed baseline: shape (default Llama-3-8B's),
    sequence, batch, steps, loss pieces, learning rate, GPU cap."""
    for name, value in LLAMA3_8B.items():
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=value, help=f"model shape (default {value})")
    parser.add_argument("--seq", type=int, default=4096, help="sequence length (default 4096)")
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per forward (default 4)")
    parser.add_argument("--global-batch", type=int, default=64, help="sequences per optimizer step (default 64)")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps (default 2)")
    parser.add_argument("--loss-piece", type=int, default=1024,
                        help="tokens whose logits exist at once in the loss (default 1024: 0.5 GiB of fp32 logits of a "
                             "128k vocabulary; 0: HF's own loss, all at once)")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--gpu-cap", default="24GiB", help="GPU memory for the whole process (default 24GiB)")


def check_scenario_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse a global batch that micro-batches do not divide; sizes to bytes."""
    world = rank_and_world()[1]
    if args.global_batch % (args.micro_batch * world):
        parser.error(f"--global-batch {args.global_batch} is not a multiple of --micro-batch {args.micro_batch}"
                     + (f" times the {world} ranks" if world > 1 else ""))
    args.gpu_cap = parse_size(args.gpu_cap)


def add_tier_args(parser: argparse.ArgumentParser) -> None:
    """The flags of the tiers (the GPU's activation reserve, the pinned budget, the swap files) and ``--set``: what
    ``tierstore_config`` reads beside the scenario's flags, shared with examples/hf_trainer_8b.py."""
    parser.add_argument("--activation-reserve", default="auto",
                        help="GPU memory left for activations (tiers.gpu.activation_reserve; default auto: measured "
                             "from the first step, whose updates all run on the CPU; the first blocks then move to the "
                             "GPU, their state leaves host memory and fewer moments spill to disk). Set, the plan is "
                             "made with it from the start")
    parser.add_argument("--host-budget", default="100GiB", help="tierstore's pinned memory at most (default 100GiB)")
    parser.add_argument("--nvme-dir", default="tmp", help="directory for swap files ('tmp': a temporary one)")
    parser.add_argument("--nvme-budget", default="56GiB")
    parser.add_argument("--io-threads", type=int, default=8,
                        help="swap files read and written at once (tiers.nvme.io_threads; default 8). `tierstore bench "
                             "store --nvme-dir DIR --disk-sweep` shows which count and --io-block the disk serves fastest")
    parser.add_argument("--io-block", default="64MiB", help="largest single read or write (tiers.nvme.block_size)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="any other config setting, as a dotted path and a YAML value (repeatable), e.g. "
                             "--set optimizer.gpu_stream_fraction=0 --set prefetch.keep_for_backward=0; those the "
                             "flags above set (dtype, lr, accumulation, the tiers' budgets and paths) are refused")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; the shape defaults to Llama-3-8B's."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_scenario_args(parser)
    add_tier_args(parser)
    parser.add_argument("--plan-only", action="store_true", help="print the memory plan and whether it fits, then exit")
    parser.add_argument("--compute-bound", action="store_true",
                        help="no offload: time the same micro-batches with the whole model in bf16 on the GPU, uncapped "
                             "(about 2 x 2 bytes a parameter plus activations: 40 GB at 8B), then exit. The floor the "
                             "offloaded micro-batches are measured against")
    parser.add_argument("--trace", metavar="FILE",
                        help="profile micro-batches 2 and 3 of the last step with torch.profiler (the GPU's kernels and copies) and "
                             "write the Chrome trace to FILE (gzip if it ends in .gz)")
    args = parser.parse_args(argv)
    check_scenario_args(parser, args)
    args.host_budget = parse_size(args.host_budget)
    return args


def prepare_process(args: argparse.Namespace) -> bool:
    """Before anything touches CUDA: the swap directory made, the allocator set, the process's GPU memory capped,
    tierstore's progress logged. Returns whether a GPU is there."""
    if args.nvme_dir != "tmp":  # the README's command names a directory a fresh machine does not have yet: made private
        os.makedirs(args.nvme_dir, mode=0o700, exist_ok=True)
    # Under a hard cap the allocator's reserved memory is what counts: without expandable segments the 8B step
    # held 0.8-1.6 GiB reserved but unallocated when it ran out of memory (calls L7, L8). Read when CUDA's
    # allocator starts, so before anything touches CUDA; a value the user set wins. (It stays in the process's
    # environment: harmless on the CPU, where the tests call main() in-process.)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    cuda = torch.cuda.is_available()
    logging.basicConfig(level=logging.WARNING)
    # setup's progress, the spill, the placement measured from the first step, the reserve hint
    for name in ("runtime.session", "runtime.engine", "runtime.planning.measured_placement", "runtime.planning.peak_hint"):
        logging.getLogger(name).setLevel(logging.INFO)
    # the cap holds for everything the process allocates: tierstore's tiers and the activations
    if cuda:  # under torchrun, this rank's own GPU
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if cuda and not getattr(args, "compute_bound", False):
        index = torch.cuda.current_device()
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.gpu_cap / torch.cuda.get_device_properties(index).total_memory),
                                                   index)
    return cuda


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the number of ranks: torchrun --nproc-per-node N runs the scenario on N GPUs, each
    rank taking its part of every micro-batch (0 and 1 without torchrun)."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def say(line: str, end: str = "\n") -> None:
    """A line for the person running the example: rank 0's only, where several ranks run."""
    if rank_and_world()[0] == 0:
        print(line, end=end, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """Plan (and with --plan-only stop), then train; 0 when the plan fits and the loss stayed finite and fell."""
    args = parse_args(argv)
    cuda = prepare_process(args)
    model = build_model(args)
    num_params = sum(p.numel() for p in model.parameters())
    config = tierstore_config(args, cuda)
    world = rank_and_world()[1]
    say(f"model: {num_params:,} parameters (Llama, {args.layers} layers, hidden {args.hidden}, "
        f"{args.kv_heads} KV heads, vocab {args.vocab}); sequence {args.seq}, {args.global_batch} sequences per "
        f"step in micro-batches of {args.micro_batch}"
        + (f" on each of {world} ranks (GPU cap and micro-batches per GPU, host budget per node)" if world > 1 else "")
        + f"; GPU cap {approx_size(args.gpu_cap)}, host budget {approx_size(args.host_budget)}")
    if args.plan_only:
        return plan_only(model, config)
    if args.compute_bound:
        return compute_bound(args, num_params)
    start = time.perf_counter()
    model, optimizer = offload(model, config, init=seeded_normal_init)
    session = optimizer.session
    say(session.plan.table())
    say(f"setup (init, pin, write spilled moments) {time.perf_counter() - start:.1f} s")
    losses = train(model, optimizer, args, num_params)
    ok = bool(losses) and all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    say(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}: {'finite and falling' if ok else 'NOT falling'}")
    return 0 if ok else 1


def plan_only(model: torch.nn.Module, config: dict) -> int:
    """Print the plan the config resolves to on this machine and whether it fits (1 when it does not)."""
    from runtime.config.loader import load_config
    from runtime.planning.settings import resolve_device
    from runtime.session import plan_model

    cfg = load_config(config)
    try:
        _, resolved, _ = plan_model(model, cfg, resolve_device(cfg))
    except PlanError as refusal:
        print(f"does not fit this machine: {refusal}")
        return 1
    print(resolved.plan.table())
    print("fits this machine")
    return 0


def compute_bound(args: argparse.Namespace, num_params: int, warmup: int = 2, timed: int = 4) -> int:
    """Time ``timed`` micro-batches (after ``warmup``) of the same model, sequence and loss with every weight in
    bf16 on the GPU and nothing offloaded: the micro-batches' floor. Prints the forward's and the whole micro-batch's
    seconds and what a step's micro-batches would take at that rate."""
    from transformers import LlamaForCausalLM

    if not torch.cuda.is_available():
        raise SystemExit("--compute-bound needs a GPU")
    with torch.device("cuda"):
        model = for_training(LlamaForCausalLM._from_config(llama_config(args), torch_dtype=torch.bfloat16), args)
    data = ByteBatches(stdlib_text_bytes(1 << 24), batch_size=args.micro_batch, seq_len=args.seq, seed=0)
    forward_s = whole_s = 0.0
    tracer = None
    for micro in range(warmup + timed):
        if args.trace and micro in (warmup, warmup + 2):  # the first two timed micro-batches, as in train()
            tracer = _trace(tracer if micro == warmup + 2 else None, args.trace)
        tokens = data.next()[0].cuda()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = micro_batch_loss(model, tokens, args)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        loss.backward()
        torch.cuda.synchronize()
        if micro >= warmup:
            forward_s += t1 - t0
            whole_s += time.perf_counter() - t0
    per_micro = whole_s / timed
    step_s = per_micro * (args.global_batch // args.micro_batch)  # (not per_micro * global // micro: a float floor)
    tokens_per_s = args.global_batch * args.seq / step_s
    print(f"compute bound (bf16, all on the GPU, nothing offloaded): forward {forward_s / timed:.3f} s, forward + "
          f"backward {per_micro:.3f} s a micro-batch; the step's {args.global_batch // args.micro_batch} micro-batches "
          f"{step_s:.1f} s: {tokens_per_s:,.0f} tokens/s, {6 * num_params * tokens_per_s / 1e12:.1f} model TFLOP/s; "
          f"peak GPU {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB", file=sys.stderr)
    return 0


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, args: argparse.Namespace, num_params: int) -> list[float]:
    """The scenario's loop on the bundled text; prints progress and the profiler's split. Returns the step losses."""
    session = optimizer.session  # type: ignore[attr-defined]
    device = session.store.device
    rank, world = rank_and_world()
    # Every rank reads the same stream of micro-batches of all ranks' sequences and trains on its own rows.
    data = ByteBatches(stdlib_text_bytes(1 << 24), batch_size=args.micro_batch * world, seq_len=args.seq, seed=0)
    accumulation = accumulation_steps(args)
    disk = {"read": 0, "write": 0}

    def count_disk(event: object) -> None:
        kind = getattr(event, "kind", "")
        if kind in disk:
            disk[kind] += event.nbytes  # type: ignore[attr-defined]

    session.store.bus.subscribe(count_disk)
    losses: list[float] = []
    tracer = None
    try:
        with tempfile.TemporaryDirectory() as profile_dir:
            profiler = Profiler(session, measure_ceilings(session.store)).start()
            for step in range(1, args.steps + 1):
                t0, before = time.perf_counter(), dict(disk)
                summed = _sum_counters(session)
                total = torch.zeros((), device=device)
                for micro in range(1, accumulation + 1):
                    if args.trace and step == args.steps and micro in (2, 4):
                        tracer = _trace(tracer if micro == 4 else None, args.trace)
                    tokens, _ = data.next()
                    tokens = tokens[rank * args.micro_batch:(rank + 1) * args.micro_batch].to(device)
                    loss = micro_batch_loss(model, tokens, args)
                    (loss / accumulation).backward()
                    total += loss.detach()  # no .item() per micro-batch: it would wait for the GPU each time
                    say(f"\rstep {step}/{args.steps}: micro-batch {micro}/{accumulation}", end="")
                optimizer.step()
                optimizer.zero_grad()
                losses.append(_mean_over_ranks(total, world) / accumulation)
                seconds = time.perf_counter() - t0
                summed = [after - b for after, b in zip(_sum_counters(session), summed, strict=True)]
                line = step_line(args, step, losses[-1], seconds, num_params)  # a collective where several ranks run
                say(f"\r{line}, NVMe {(disk['read'] - before['read']) / 1e9:.1f} GB read / "
                    f"{(disk['write'] - before['write']) / 1e9:.1f} GB written" + (" (rank 0's)" if world > 1 else ""))
                if session.controller.sums is not None:
                    say(f"  host gradient sums: {summed[0]:.1f} s of CPU summing, the backward waited {summed[1]:.1f} s "
                        f"for a sum buffer, {summed[2] / 1e9:.1f} GB off the GPU" + (" (rank 0's)" if world > 1 else ""))
            optimizer.synchronize()  # type: ignore[attr-defined]
            profiler.stop()
            saved = profiler.save(profile_dir, trace=False, plot=False)
            if rank == 0:
                print((saved.directory / "report.txt").read_text())
    finally:
        session.close()
    return losses


def step_line(args: argparse.Namespace, step: int, loss: float, seconds: float, num_params: int) -> str:
    """An optimizer step's line: loss, seconds, tokens/s, model TFLOP/s (6 x parameters x tokens/s), peak GPU memory
    and RSS; examples/hf_trainer_8b.py prints the same, so the two rows compare."""
    cuda = torch.cuda.is_available()
    tokens_per_s = args.global_batch * args.seq / seconds
    peak_gpu = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    peak_held = torch.cuda.max_memory_reserved() / 2**30 if cuda else 0.0
    retries = torch.cuda.memory_stats().get("num_alloc_retries", 0) if cuda else 0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    world = rank_and_world()[1]
    if world > 1:  # the node's: every rank's peak, summed (a collective)
        rss = _mean_over_ranks(torch.tensor(rss, device=torch.cuda.current_device() if cuda else "cpu"), world) * world
    return (f"step {step}/{args.steps}: loss {loss:.4f}, {seconds:.1f} s, {tokens_per_s:,.0f} tokens/s, "
            f"{6 * num_params * tokens_per_s / 1e12:.1f} model TFLOP/s, peak GPU {peak_gpu:.1f} GiB ({peak_held:.1f} "
            f"held by the allocator, {retries} allocation retries so far)" + (" on rank 0" if world > 1 else "")
            + f", peak RSS {rss:.1f} GiB" + (f" (the node's {world} ranks)" if world > 1 else ""))


def _mean_over_ranks(value: torch.Tensor, world: int) -> float:
    """``value`` averaged over the ranks (a collective: every rank calls it); itself in one process."""
    if world <= 1:
        return float(value)
    total = value.detach().float().reshape(1).clone()
    torch.distributed.all_reduce(total)
    return float(total) / world


def _trace(running, path: str):  # type: ignore[no-untyped-def]
    """Start torch.profiler when ``running`` is None (the device's kernels and copies; the CPU's ops on a machine
    without CUDA); else stop it and write its Chrome trace."""
    cuda = torch.cuda.is_available()
    if running is None:
        from torch.profiler import ProfilerActivity, profile

        return profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]).__enter__()
    if cuda:
        torch.cuda.synchronize()
    running.__exit__(None, None, None)
    rank, world = rank_and_world()
    if world > 1:  # each rank its own file: FILE's name with .rank<N> before its extensions
        name, dot, ext = os.path.basename(path).partition(".")
        path = os.path.join(os.path.dirname(path), f"{name}.rank{rank}{dot}{ext}")
    running.export_chrome_trace(path)
    print(f"\ntrace of two micro-batches written to {path}", file=sys.stderr)
    return None


def _sum_counters(session) -> list[float]:  # type: ignore[no-untyped-def]
    """The host gradient sums' counters now (seconds summing, seconds waited for a buffer, bytes)."""
    sums = session.controller.sums
    return [0.0, 0.0, 0.0] if sums is None else [sums.stats.sum_s, sums.stats.staging_wait_s, float(sums.stats.nbytes)]


if __name__ == "__main__":
    sys.exit(main())
