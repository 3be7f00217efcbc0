"""``tierstore plan``: the memory plan of a config, and with ``--model`` of any HF causal LM, with a predicted step.

Owns: the command's flags, reading ``--model`` (a directory holding ``config.json``, or a named shape of
``runtime.planning.shapes``), building that model on the meta device (nothing is allocated), the config a model is
planned with (``--config`` or the documented default, then the flags on top), the rates the prediction uses (stated
flags, else this machine's measured ones where it has a GPU, else the documented defaults of a workstation) and the
output. Leaves out: the plan itself (``runtime.session.plan_model``'s checks, ``runtime.planning``) and the step-time
model (``runtime.planning.predict``).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime.config.units import approx_size
from runtime.planning.predict import ModelShape, Prediction, RowPlacement, StepRates, Work, activation_nbytes, predict_step

if TYPE_CHECKING:  # torch and the planning modules are imported when a plan is made: `tierstore --help` stays quick
    import torch

    from runtime.config.loader import TierstoreConfig
    from runtime.core.blocks import Block
    from runtime.planning.hostmem import HostMemory
    from runtime.planning.placement import ResolvedPlan

log = logging.getLogger(__name__)

# The stated rates of a typical workstation, used where none is given and this machine has no GPU to measure: one
# 24 GiB card of about 150 TFLOP/s in a large bf16 matmul (an RTX 4090's class) on PCIe 4.0 x16 (about 25 GB/s
# each way in practice), a 16-core desktop CPU (fused AdamW about 1.5 G parameters/s beside copies) and a PCIe 4.0
# NVMe drive (about 3 GB/s each way under the store's direct IO).
DEFAULT_GPU_MEMORY = "24GiB"
DEFAULT_GPU_TFLOPS = 150.0
DEFAULT_PCIE_GBPS = 25.0
DEFAULT_CPU_ADAM_GPARAMS = 1.5
DEFAULT_DISK_GBPS = 3.0
DEFAULT_SEQ = 2048
MATMUL_PROBE_N = 8192  # the square bf16 matmul timed for the GPU's rate

# Config keys a refusal may name, and the flag of this command that sets each.
KEY_FLAGS = {"tiers.gpu.budget": "--gpu-memory", "tiers.host.budget": "--host-memory",
             "tiers.nvme.path": "--nvme", "tiers.nvme.budget": "--nvme-size",
             "optimizer.accumulation_steps": "--accumulation"}


# The flags that only --model reads.
MODEL_FLAGS = ("--gpu-memory", "--host-memory", "--nvme", "--nvme-size", "--seq", "--micro-batch", "--accumulation",
               "--loss-piece", "--pcie", "--cpu-adam", "--disk", "--gpu-tflops")


def add_arguments(plan: argparse.ArgumentParser, size: Callable[[str], int], path: Callable[[str], Path],
                  at_least_one: Callable[[str], int]) -> None:
    """``tierstore plan``'s flags (``size``, ``path``, ``at_least_one``: the CLI's argument types)."""
    plan.add_argument("--config", type=path, metavar="FILE",
                      help="YAML config: tiers, placement and optimizer settings. Without --model it plans the config's "
                           "bundled example model (and is required); with --model it is optional, the default being "
                           "bf16 compute, fp32 master and moments, placement auto (docs/user-guide.md, Plan your model)")
    plan.add_argument("--model", metavar="M",
                      help="an HF causal LM: a directory holding its config.json, or a named shape (llama-3-8b, "
                           "llama-3-70b, qwen2.5-7b, qwen2.5-14b, qwen2.5-32b, mistral-7b, llama-3.2-1b, "
                           "llama-3.2-3b); built on the meta device, nothing allocated. Needs the hf extra")
    machine = plan.add_argument_group("the machine", "sizes for a machine you do not sit at (default: this one's, or "
                                                     "the config's)")
    machine.add_argument("--gpu-memory", type=size, metavar="SIZE",
                         help=f"GPU memory for the run (tiers.gpu.budget; default: the config's, else 90%% of what "
                              f"this machine's GPU has free, else {DEFAULT_GPU_MEMORY})")
    machine.add_argument("--host-memory", type=size, metavar="SIZE",
                         help="the machine's RAM (default: this machine's); the plan may pin all but 10%% or 2 GiB of it")
    machine.add_argument("--nproc", type=at_least_one, metavar="N", default=1,
                         help="plan a node of N GPUs trained by N processes (tierstore train --nproc N, torchrun "
                              "--nproc-per-node N): --gpu-memory is each GPU's, --host-memory and --nvme-size the "
                              "node's, shared by the ranks as the blocks they own; each rank's CPU updates get 1/N of "
                              "the cores. Prints the plan of the rank that keeps the most state and the node's totals")
    machine.add_argument("--nvme", type=path, metavar="PATH",
                         help="directory for swap files (tiers.nvme.path): moments that do not fit in host memory go "
                              "there; it must exist on this machine (its modes and free space are checked)")
    machine.add_argument("--nvme-size", type=size, metavar="SIZE",
                         help="disk space the swap files may take under --nvme (tiers.nvme.budget)")
    work = plan.add_argument_group("the work (with --model)")
    work.add_argument("--seq", type=at_least_one, metavar="N", help=f"tokens a sequence (default {DEFAULT_SEQ})")
    work.add_argument("--micro-batch", type=at_least_one, metavar="N", help="sequences a forward (default 1)")
    work.add_argument("--accumulation", type=at_least_one, metavar="N",
                      help="micro-batches an optimizer step (optimizer.accumulation_steps; default: the config's, 1)")
    work.add_argument("--loss-piece", type=at_least_one, metavar="N",
                      help="the training takes its loss N tokens at a time (a chunked loss: TrainingArguments("
                           "use_liger_kernel=True), runtime.integrations.hf_loss.use_chunked_loss(model, N), 1024 "
                           "for both), so only N tokens' logits exist at once; default: HF's own loss, the logits of "
                           "the whole micro-batch at once, which a large vocabulary makes the largest activation")
    rates = plan.add_argument_group("stated rates (with --model)",
                                    "for the prediction; default: measured here where this machine has a GPU, else "
                                    "a typical workstation's (the figures are then for the stated rates)")
    rates.add_argument("--pcie", type=float, metavar="GB/s",
                       help=f"host<->GPU copy rate each way, GB/s (default {DEFAULT_PCIE_GBPS:g}: PCIe 4.0 x16)")
    rates.add_argument("--cpu-adam", type=float, metavar="G/s",
                       help="CPU fused AdamW rate, billions of parameters a second, with copies running "
                            f"(default {DEFAULT_CPU_ADAM_GPARAMS:g}: a 16-core desktop)")
    rates.add_argument("--disk", type=float, metavar="GB/s",
                       help=f"swap disk rate for reads and for writes, GB/s (default {DEFAULT_DISK_GBPS:g}: a PCIe 4.0 "
                            "NVMe drive; measured under --nvme on a machine with a GPU)")
    rates.add_argument("--gpu-tflops", type=float, metavar="TFLOP/s",
                       help=f"the GPU's rate in a large bf16 matmul, TFLOP/s (default {DEFAULT_GPU_TFLOPS:g}); a "
                            "training step reaches a documented share of it")


class HFMissing(ValueError):  # a ValueError: the CLI prints it as one line, no traceback
    """transformers (the hf extra) is not installed."""


def load_hf_config(model: str) -> Any:
    """The HF config of ``--model``: ``config.json`` of a directory, or a named shape's keys."""
    from runtime.planning.shapes import named_shape

    try:
        from transformers import AutoConfig
    except ImportError:
        raise HFMissing("--model needs transformers: pip install -e '.[hf]'") from None
    directory = Path(model)
    if directory.is_dir():
        if not (directory / "config.json").is_file():
            raise ValueError(f"--model {model}: the directory holds no config.json")
        return AutoConfig.from_pretrained(directory, local_files_only=True)
    try:
        shape = named_shape(model)
    except KeyError as error:
        raise ValueError(f"--model {error.args[0]}") from None
    return AutoConfig.for_model(shape.model_type, **shape.hf_config())


def build_meta_model(hf_config: Any) -> torch.nn.Module:
    """The causal LM of ``hf_config`` with its parameters on the meta device, gradient checkpointing on."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    with warnings.catch_warnings():  # newer transformers renamed it; this name works from 4.35 on
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def model_shape(model: Any, hf_config: Any) -> ModelShape:
    """The ``ModelShape`` of a built HF causal LM."""
    num_params = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight.numel()  # an HF PreTrainedModel's
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return ModelShape(num_params=num_params, matmul_params=num_params - (0 if tied else embedding),
                      num_layers=hf_config.num_hidden_layers, attention_width=heads * head_dim,
                      hidden=hf_config.hidden_size, ffn=hf_config.intermediate_size, vocab=hf_config.vocab_size)


def default_model_config() -> dict[str, Any]:
    """The config a model is planned with when no ``--config`` is given: bf16 compute, fp32 master and moments,
    placement auto (moments spill to --nvme where host memory cannot hold them), clipping at 1.0."""
    return {"dtype": "bf16", "placement": {"weights": "host", "master": "host", "moments": "auto"},
            "optimizer": {"grad_clip": 1.0}}


def raw_config(args: argparse.Namespace) -> dict[str, Any]:
    """``--config``'s settings as written (checked first, so that a wrong one is refused with its line), or the
    default for a model."""
    import yaml

    from runtime.config.loader import load_config

    if args.config is None:
        return default_model_config()
    load_config(args.config)
    return yaml.safe_load(args.config.read_text()) or {}


def model_config(args: argparse.Namespace, raw: dict[str, Any], shape: ModelShape, work: Work, *,
                 gpu_here: bool) -> dict[str, Any]:
    """The config of ``--model``: ``raw`` (``raw_config``'s) with the flags on top, and where the activation reserve
    is ``auto`` the estimate of ``runtime.planning.predict.activation_nbytes`` in its place."""
    tiers = raw.setdefault("tiers", {})
    gpu, host, nvme = tiers.setdefault("gpu", {}), tiers.setdefault("host", {}), tiers.setdefault("nvme", {})
    if args.gpu_memory is not None:
        gpu["budget"] = args.gpu_memory
    elif not gpu_here and gpu.get("budget", "auto") == "auto":
        gpu["budget"] = DEFAULT_GPU_MEMORY
    if gpu.get("activation_reserve", "auto") == "auto":
        gpu["activation_reserve"] = activation_nbytes(shape, work)
    if args.host_memory is not None:
        host["budget"] = stated_host(args.host_memory).usable_nbytes
    if args.nvme is not None:
        nvme["path"] = str(args.nvme)
    if args.nvme_size is not None:
        nvme["budget"] = args.nvme_size
    raw.setdefault("optimizer", {})["accumulation_steps"] = work.accumulation
    return raw


def stated_host(nbytes: int) -> HostMemory:
    """``--host-memory`` as the ``HostMemory`` the plan is checked against."""
    from runtime.planning.hostmem import HostMemory

    return HostMemory(total_nbytes=nbytes, available_nbytes=nbytes, limit="--host-memory")


@dataclass
class ModelPlan:
    """What ``plan --model`` found: the plan (None where it did not fit), the refusal, the prediction."""

    description: str
    config: dict[str, Any]  # the config the plan was made with (``offload()`` takes it as it is)
    table: str | None
    refusal: str | None
    prediction: Prediction | None  # None where the plan did not fit
    rates: StepRates


def plan_model_dir(args: argparse.Namespace) -> ModelPlan:
    """``plan --model``'s work without printing (the GPU check script calls it in-process)."""
    import torch

    from runtime.config.loader import load_config
    from runtime.planning.memory_plan import PlanError
    from runtime.planning.settings import waits_for_commit

    hf_config = load_hf_config(args.model)
    model = build_meta_model(hf_config)
    shape = model_shape(model, hf_config)
    gpu_here = torch.cuda.is_available()
    raw = raw_config(args)
    accumulation = args.accumulation or int((raw.get("optimizer") or {}).get("accumulation_steps", 1))
    work = Work(seq=args.seq or DEFAULT_SEQ, micro_batch=args.micro_batch or 1, accumulation=accumulation,
                loss_piece_tokens=args.loss_piece)
    raw = model_config(args, raw, shape, work, gpu_here=gpu_here)
    cfg = load_config(raw)
    device = torch.device("cuda", torch.cuda.current_device()) if gpu_here else torch.device("cuda")
    rates = step_rates(args, cfg, gpu_here)
    description = (f"model {args.model} ({hf_config.model_type}): {shape.num_params:,} parameters, {shape.num_layers} "
                   f"layers; sequence {work.seq}, micro-batch {work.micro_batch}, accumulation {work.accumulation} "
                   f"({work.tokens:,} tokens a step); activations reserved "
                   f"{approx_size(int(cfg.tiers.gpu.activation_reserve)) if cfg.tiers.gpu.activation_reserve != 'auto' else 'auto'}")
    if args.nproc > 1:
        return plan_ranks(args, model, cfg, device, rates, description, raw)
    try:
        blocks, resolved = resolve(model, cfg, device, rates, args.host_memory)
    except PlanError as refusal:
        return ModelPlan(description, raw, None, with_flags(str(refusal)), None, rates)
    short = activations_refusal(blocks, resolved, cfg, device, work)
    if short is not None:
        return ModelPlan(description, raw, None, f"{short}\n{resolved.plan.table()}", None, rates)
    placement = row_placement(resolved, blocks, cfg)
    prediction = predict_step(placement, shape, work, rates, updates_after_backward=waits_for_commit(cfg))
    return ModelPlan(description, raw, resolved.plan.table(), None, prediction, rates)


def plan_ranks(args: argparse.Namespace, model: torch.nn.Module, cfg: TierstoreConfig, device: torch.device,
               rates: StepRates, description: str, raw: dict[str, Any]) -> ModelPlan:
    """``plan --model --nproc N``: each rank's plan (the blocks it owns, its share of the node's host and NVMe
    budgets and of the cores), refused where one rank's does not fit; the table of the rank keeping the most state,
    and the node's totals. No step time is predicted for several GPUs yet."""
    import dataclasses

    from runtime.planning.memory_plan import PlanError

    nproc = args.nproc
    rank_rates = dataclasses.replace(rates, cpu_adam_params_per_s=rates.cpu_adam_params_per_s / nproc)
    plans = []
    for rank in range(nproc):
        try:
            blocks, resolved = resolve(model, cfg, device, rank_rates, args.host_memory, rank=(rank, nproc))
        except PlanError as refusal:
            return ModelPlan(description, raw, None, with_flags(f"rank {rank} of {nproc}: {refusal}"), None, rates)
        plans.append(resolved.plan)
    busiest = max(range(nproc), key=lambda r: plans[r].host_nbytes)
    node = (f"node: {nproc} GPUs, one rank each; host {approx_size(sum(p.host_nbytes for p in plans))} pinned in all "
            f"(ranks {', '.join(approx_size(p.host_nbytes) for p in plans)}), NVMe "
            f"{approx_size(sum(p.nvme_nbytes for p in plans))}, GPU up to {approx_size(max(p.gpu_nbytes for p in plans))} "
            f"a rank; each rank's CPU updates on 1/{nproc} of the cores. The table: rank {busiest}'s")
    return ModelPlan(description + "\n" + node, raw, plans[busiest].table(), None, None, rates)


def resolve(model: torch.nn.Module, cfg: TierstoreConfig, device: torch.device, rates: StepRates,
            host_memory: int | None, rank: tuple[int, int] | None = None) -> tuple[list[Block], ResolvedPlan]:
    """``runtime.session.plan_model``'s plan and checks, with the stated rates and ``--host-memory``'s RAM; ``rank``:
    (rank, number of ranks) of a node of several GPUs, planned as ``offload()`` plans that rank (the blocks it owns,
    its share of the node's budgets and RAM)."""
    from runtime.core.blocks import build_blocks
    from runtime.model.recompute import recompute_refusal
    from runtime.planning.auto_placement import Rates
    from runtime.planning.memory_plan import check_fits
    from runtime.planning.ownership import owned_blocks, rank_config
    from runtime.planning.placement import resolve_plan

    blocks = build_blocks(model, cfg.blocks.min_block_size, list(cfg.blocks.modules) if cfg.blocks.modules else None)
    planned, share = blocks, 1.0
    if rank is not None:
        planned = owned_blocks(blocks, *rank)
        share = sum(b.numel for b in planned) / sum(b.numel for b in blocks)
        cfg = rank_config(cfg, blocks, planned, device)
    placement_rates = Rates(adam_params_per_s=rates.cpu_adam_params_per_s, h2d_bytes_per_s=rates.h2d_bytes_per_s,
                            d2h_bytes_per_s=rates.d2h_bytes_per_s)
    resolved = resolve_plan(planned, cfg, device, rates=placement_rates, recomputable=recompute_refusal(blocks) is None)
    memory = None if host_memory is None else stated_host(int(host_memory * share))
    check_fits(resolved.plan, cfg, device, memory=memory)
    return blocks, resolved


def activations_refusal(blocks: list[Block], resolved: ResolvedPlan, cfg: TierstoreConfig, device: torch.device,
                        work: Work) -> str | None:
    """Why the activations do not fit beside what the GPU must hold with every update on the CPU (``check_fits``
    leaves them out: ``offload()`` measures them in a step, here they are estimated), or None where they fit. Auto
    placement fills the rest of the budget only where there is room beside them."""
    from runtime.planning.block_plan import plan_of
    from runtime.planning.memory_plan import gpu_budget_nbytes

    reserve = cfg.tiers.gpu.activation_reserve
    if reserve == "auto":
        return None
    least = plan_of(blocks, cfg, resolved.homes, resolved.source, updated=frozenset(), streamed=0,
                    host_sums=resolved.placement.host_sums).gpu_nbytes
    budget = gpu_budget_nbytes(cfg, device)
    if least + int(reserve) <= budget:
        return None
    return (f"gpu: with every update on the CPU the plan holds {approx_size(least)} on the GPU, and a micro-batch of "
            f"{work.micro_batch} x {work.seq} tokens needs about {approx_size(int(reserve))} of activations "
            f"(tiers.gpu.activation_reserve), {approx_size(least + int(reserve))} together, more than the GPU memory, "
            f"{approx_size(budget)} (--gpu-memory); lower --micro-batch or --seq"
            + ("" if work.loss_piece_tokens else ", train with a chunked loss (--loss-piece 1024: Liger's or "
               "use_chunked_loss, the logits of 1024 tokens at a time)")
            + ", or use a GPU with more memory")


def row_placement(resolved: ResolvedPlan, blocks: list[Block], cfg: TierstoreConfig) -> RowPlacement:
    """The per-step traffic accounting's placement of a resolved plan (``runtime.bench.train_bound``'s, as the
    training benchmark reads it from a running session)."""
    from runtime.bench.train_bound import tierstore_placement
    from runtime.planning.auto_placement import gpu_streamed_blocks, gpu_updated_blocks
    from runtime.planning.moment_sizes import stored_moment_nbytes
    from runtime.planning.settings import compute_itemsize, cpu_threads, host_grad_dtype

    blocks = sorted(blocks, key=lambda b: b.index)
    placement = resolved.placement
    updated = gpu_updated_blocks(blocks, placement.gpu_update_fraction)
    streamed = gpu_streamed_blocks(blocks, placement.gpu_update_fraction, placement.gpu_stream_fraction)
    accumulation = cfg.optimizer.accumulation_steps
    row = tierstore_placement(block_numels=[b.numel for b in blocks], gpu_updated=updated, streamed=streamed,
                              weight_source=resolved.source.value, homes={k: v.value for k, v in resolved.homes.items()},
                              spilled=resolved.spilled_blocks, keep_nbytes=placement.keep_for_backward_nbytes,
                              compute_elem_nbytes=compute_itemsize(cfg), accumulation=accumulation,
                              cpu_threads=cpu_threads(cfg), prefetch_depth=cfg.prefetch.depth,
                              prefetch_budget_nbytes=cfg.prefetch.budget,
                              moment_nbytes=[stored_moment_nbytes(cfg.optimizer.moment_dtype, [s.numel for s in b.slots])
                                             for b in blocks])
    # Summed in host memory, every micro-batch sends its gradients out; else the sum leaves once a step.
    grad_nbytes = host_grad_dtype(cfg, placement.host_sums).itemsize * (accumulation if placement.host_sums else 1)
    return dataclasses.replace(row, grad_elem_nbytes=grad_nbytes)


def step_rates(args: argparse.Namespace, cfg: TierstoreConfig, gpu_here: bool) -> StepRates:
    """The rates of the prediction: each stated flag; else measured here where there is a GPU; else the defaults."""
    import torch

    measured: list[str] = []
    pcie = (args.pcie * 1e9,) * 2 if args.pcie is not None else None
    adam = args.cpu_adam * 1e9 if args.cpu_adam is not None else None
    matmul = args.gpu_tflops * 1e12 if args.gpu_tflops is not None else None
    disk = (args.disk * 1e9,) * 2 if args.disk is not None else None
    gpu_adam: dict[str, float] = {}
    if gpu_here:
        device = torch.device("cuda", torch.cuda.current_device())
        if pcie is None or adam is None:
            from runtime.planning.settings import cpu_threads
            from runtime.session import cpu_int8_kernel
            from runtime.update.rates import measure_rates

            # the CPU's update as the run would make it: its moment format, int8 through the kernel it would use
            here = measure_rates(device, cpu_threads=cpu_threads(cfg), pin=cfg.tiers.host.pin is not False,
                                 moment_dtype=cfg.optimizer.moment_dtype, int8_kernel=cpu_int8_kernel(cfg, device))
            if pcie is None:
                pcie, measured = (here.h2d_bytes_per_s, here.d2h_bytes_per_s), [*measured, "pcie"]
            if adam is None:
                adam, measured = here.adam_params_per_s, [*measured, "cpu_adam"]
        if matmul is None:
            matmul, measured = matmul_flops_per_s(device), [*measured, "gpu"]
        if disk is None and args.nvme is not None and Path(args.nvme).is_dir():
            from runtime.bench.train_bound import measure_disk_gbps

            read, write = measure_disk_gbps(str(args.nvme), total_nbytes=1 << 30)
            disk, measured = (read * 1e9, write * 1e9), [*measured, "disk"]
        from runtime.bench.train_bound import measure_gpu_adam_s_per_param

        gpu_adam["gpu_adam_params_per_s"] = 1 / measure_gpu_adam_s_per_param(32 << 20, device)
    pcie = pcie or (DEFAULT_PCIE_GBPS * 1e9,) * 2
    disk = disk or (DEFAULT_DISK_GBPS * 1e9,) * 2
    return StepRates(matmul_flops_per_s=matmul or DEFAULT_GPU_TFLOPS * 1e12, h2d_bytes_per_s=pcie[0],
                     d2h_bytes_per_s=pcie[1], cpu_adam_params_per_s=adam or DEFAULT_CPU_ADAM_GPARAMS * 1e9,
                     disk_read_bytes_per_s=disk[0], disk_write_bytes_per_s=disk[1], measured=tuple(measured), **gpu_adam)


def matmul_flops_per_s(device: torch.device, n: int = MATMUL_PROBE_N, repeats: int = 5) -> float:
    """FLOP/s of a square bf16 matmul of side ``n`` on ``device``, the median of ``repeats`` after a warm-up."""
    import torch

    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    times = []
    for run in range(repeats + 1):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(4):
            a @ b
        torch.cuda.synchronize(device)
        if run:
            times.append((time.perf_counter() - start) / 4)
    del a, b
    torch.cuda.empty_cache()
    return 2 * n ** 3 / statistics.median(times)


def with_flags(message: str) -> str:
    """A refusal's text with this command's flag beside each config key it names."""
    for key, flag in KEY_FLAGS.items():
        message = message.replace(key, f"{key} ({flag})")
    return message + ("\n  with tierstore plan --model: more --gpu-memory or --host-memory, a swap directory "
                      "(--nvme PATH --nvme-size SIZE) for the moments, or a smaller --micro-batch or --seq")


def main(args: argparse.Namespace) -> int:
    """``tierstore plan``: with ``--model`` the model's plan and predicted step, else ``--config``'s example model."""
    if args.model is None:
        given = [flag for flag in MODEL_FLAGS if getattr(args, flag.lstrip("-").replace("-", "_")) is not None]
        if given:
            raise ValueError(f"tierstore plan: {', '.join(given)} go with --model M; --config FILE alone plans the "
                             "config's example model with the config's own settings")
        if args.config is None:
            raise ValueError("tierstore plan: give --config FILE (the bundled example model) or --model M")
        return _plan_example(args)
    result = plan_model_dir(args)
    print(result.description)
    if result.refusal is not None:
        print(f"does not fit: {result.refusal}")
        return 1
    print(result.table)
    print("the plan fits")
    if result.prediction is None:  # several GPUs: no step time yet
        print("(no step time is predicted for several GPUs yet)")
        return 0
    print(f"rates: {result.rates.describe()}")
    if not result.rates.measured:
        print("  (the figures below are for these stated rates, not measured on this machine: it has no GPU, or "
              "every rate was given)")
    print(result.prediction.describe())
    return 0


def _plan_example(args: argparse.Namespace) -> int:
    """``tierstore plan --config FILE``: the plan of the config's example model (built on the meta device, so
    nothing is allocated), put through the same checks ``offload()`` runs before training allocates."""
    import torch

    from runtime.cli.train import build_model
    from runtime.config.loader import load_config
    from runtime.planning.settings import resolve_device
    from runtime.session import plan_model

    cfg = load_config(args.config)
    with torch.device("meta"):
        model = build_model(cfg)
    _, resolved, _ = plan_model(model, cfg, resolve_device(cfg))  # a refusal carries the table
    print(resolved.plan.table())
    print("the plan fits this machine")
    return 0
