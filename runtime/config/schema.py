"""The tierstore config schema: frozen dataclasses whose fields carry their own validation spec.

Every leaf field stores ``metadata={"doc": ..., "spec": <Spec>}``; every nested section stores
``metadata={"doc": ..., "section": <dataclass>}``. :mod:`runtime.config.loader` walks this metadata to
validate user input, to dump a config and to generate ``docs/config.md``, so a field is declared
exactly once, here. Nothing in this module reads YAML or touches the file system.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from runtime.config.units import (
    BoolSpec,
    ChoiceSpec,
    FloatListSpec,
    FloatSpec,
    IntSpec,
    PathSpec,
    PatternListSpec,
    SizeSpec,
    Spec,
    describe_value,
    format_size,
)

__all__ = [
    "REFERENCE_INTRO",
    "BlocksConfig",
    "GpuTierConfig",
    "HostTierConfig",
    "LossScaleConfig",
    "ModelConfig",
    "NvmeTierConfig",
    "OptimizerConfig",
    "PlacementConfig",
    "PrefetchConfig",
    "ProfileConfig",
    "TiersConfig",
    "TierstoreConfig",
    "TrainConfig",
    "Problem",
    "consistency_problems",
    "join_path",
    "reference_tables",
    "schema_paths",
    "unknown_key_message",
]


def _leaf(spec: Spec, default: object, doc: str, example: object = None) -> Any:
    """Declare a leaf field: its spec, default and doc (and an example for error hints)."""
    return field(default=default, metadata={"doc": doc, "spec": spec, "example": example})


def _section(cls: type, doc: str) -> Any:
    """Declare a nested section field whose default is the section with all its defaults."""
    return field(default_factory=cls, metadata={"doc": doc, "section": cls})


MOMENT_DTYPES = ("fp32", "bf16", "int8")  # optimizer.moment_dtype (runtime.update.moment_formats stores each)
# optimizer.moment_kernel: `auto` runs the compiled kernel where it builds, `torch` never, `compiled` always (a run
# refuses to start where it cannot build; runtime.update.moment_kernel)
MOMENT_KERNELS = ("auto", "torch", "compiled")
_STATE_TIER = ("auto", "host", "nvme")  # optimizer state: on the GPU only through optimizer.gpu_update_fraction
_STATE_NOTE = ("Optimizer state is not placed on the GPU this way: optimizer.gpu_update_fraction updates the first "
               "blocks on the GPU, their master and moments there.")


@dataclass(frozen=True)
class GpuTierConfig:
    """The GPU tier: device memory the runtime may use for weights, gradients and states."""

    budget: int | Literal["auto"] = _leaf(
        SizeSpec(min_nbytes=1, auto=True), "auto",
        "Bytes of device memory tierstore may hold. `auto`: 90% of the device memory free at "
        "start, and of what the process may still allocate under a "
        "`torch.cuda.set_per_process_memory_fraction` cap.", "20GiB")
    activation_reserve: int | Literal["auto"] = _leaf(
        SizeSpec(auto=True), "auto",
        "Bytes of the GPU budget that `auto` placement (`optimizer.gpu_update_fraction`, "
        "`optimizer.gpu_stream_fraction`, `prefetch.keep_for_backward`) leaves for activations and whatever "
        "else the training step allocates. `auto`, on a GPU with `gpu_update_fraction: auto`: measured: the "
        "first training step updates on the CPU, and at its commit its peak (the allocator's reserved bytes) "
        "beyond the plan, plus 5% of the budget, is the reserve auto placement then uses; the chosen state "
        "moves to the GPU before the second step (runtime.planning.measured_placement), and moments spilled to NVMe come "
        "back into the pinned memory it frees. Where that is not done (an accumulated bf16 or fp16 run whose "
        "plan keeps a compute-dtype weights copy, its first step spilling nothing): three quarters of what the plan with nothing "
        "updated on the GPU leaves free of the budget. Set "
        "it when a run with `auto` placement runs out of GPU memory (the error says how much the step tried to "
        "use), or to hand the optimizer more of a card whose activations are small. Not used when none of the "
        "three is `auto`.", "24GiB")


@dataclass(frozen=True)
class HostTierConfig:
    """The host tier: one pinned arena, allocated once at start."""

    budget: int | Literal["auto"] = _leaf(
        SizeSpec(min_nbytes=1, auto=True), "auto",
        "Size of the pinned host arena. `auto`: sized by the memory plan, which includes second buffers for "
        "the master and moments of CPU-updated blocks when updates wait for `optimizer.step()` (clipping, "
        "fp16) and RAM has room, so those updates still run during backward. A size over the RAM this "
        "process may use (the tightest cgroup limit or the machine's, less headroom) is refused before "
        "anything is allocated; an explicit size with room to spare gives the second buffers what it "
        "holds.", "64GiB")
    pin: bool | Literal["auto"] = _leaf(
        BoolSpec(auto=True), "auto",
        "Pin (page-lock) the arena so copies run at full PCIe speed. `auto`: pin when CUDA is "
        "present.")


@dataclass(frozen=True)
class NvmeTierConfig:
    """The NVMe tier: swap files in one directory, read and written in large blocks."""

    path: str | None = _leaf(
        PathSpec(nullable=True), None,
        "Directory for swap files; null disables the NVMe tier. `tmp` means a fresh temporary "
        "directory (on /dev/shm where there is one: RAM, which the plan counts as such; one a killed run "
        "left there is removed at the next start). Must exist, be writable, be this user's and be writable by "
        "nobody else (a sticky shared directory such as /tmp is refused: use a private subdirectory).",
        "/mnt/nvme/tierstore")
    budget: int = _leaf(SizeSpec(min_nbytes=1), 64 * 2**30,
                        "Most bytes of swap files tierstore may write.")
    io_threads: int = _leaf(IntSpec(min=1, max=64), 4, "Threads issuing file reads and writes.")
    block_size: int = _leaf(
        SizeSpec(min_nbytes=4096, max_nbytes=2**30, multiple_of=4096), 64 * 2**20,
        "Largest single read or write. A multiple of 4096 so O_DIRECT can use it; at most 1GiB "
        "because Linux moves at most about 2GiB per call.")
    direct_io: str = _leaf(
        ChoiceSpec(choices=("auto", "on", "off"), bool_aliases=("on", "off")), "auto",
        "Bypass the page cache. `auto`: probe O_DIRECT and fall back to buffered IO where the "
        "file system refuses it; `on`: fail if it is refused. true/false mean on/off.")


@dataclass(frozen=True)
class TiersConfig:
    """Budgets and settings of the three memory tiers."""

    gpu: GpuTierConfig = _section(GpuTierConfig, "GPU memory.")
    host: HostTierConfig = _section(HostTierConfig, "Pinned host memory.")
    nvme: NvmeTierConfig = _section(NvmeTierConfig, "NVMe swap files.")


@dataclass(frozen=True)
class PlacementConfig:
    """Where each kind of training state lives between uses."""

    weights: str = _leaf(ChoiceSpec(choices=("auto", "host", "gpu"),
                                    note="Compute weights are not kept on NVMe: they are fetched from pinned memory "
                                         "or kept on the GPU."), "host",
                         "Where the GPU fetches compute weights from. `host` / `auto`: with the master in pinned "
                         "memory, the fp32 master itself (cast on the GPU), or, on a GPU with gradient "
                         "accumulation, a compute-dtype copy in pinned memory when it fits beside the rest without "
                         "spilling moments or streaming less (half the bytes a fetch; the plan says which); with the "
                         "master on NVMe, a compute-dtype copy. `gpu`: resident on the GPU.")
    gradients: str = _leaf(
        ChoiceSpec(choices=("host",),
                   note="Gradients are produced on the GPU and consumed by the CPU optimizer: they always leave the "
                        "GPU block by block (where the gradients are summed is optimizer.accumulate_on)."), "host",
        "Gradients, moved off the GPU block by block as backward completes them (fixed: `host`).")
    master: str = _leaf(ChoiceSpec(choices=_STATE_TIER, note=_STATE_NOTE), "host", "fp32 master weights. `auto`: host.")
    moments: str = _leaf(ChoiceSpec(choices=_STATE_TIER, note=_STATE_NOTE), "host",
                         "Adam first and second moments. `auto`: pinned host memory as far as `tiers.host.budget` "
                         "allows (`auto` budget: the RAM available at start, less headroom); the moments that do not "
                         "fit go to NVMe, the last blocks' first and blocks over twice the median size (a large "
                         "vocabulary's embedding and head) last (needs `tiers.nvme.path`; without one, host).")
    activations: str = _leaf(
        ChoiceSpec(choices=("auto", "keep", "recompute")), "auto",
        "The layers' activations between forward and backward. `keep`: on the GPU, as the model computes them. "
        "`recompute`: each layer's forward runs again in its backward (activation checkpointing: the same "
        "gradients, a third more compute, far less activation memory). `auto`: where the first step is measured "
        "(the update fraction and activation reserve `auto`, on a GPU) and its training state does not all fit "
        "on the GPU beside the activations, the second step tries `recompute`, and recomputation stays on when "
        "the modelled step with the placement it allows, the recomputed forward counted, is the shorter; "
        "otherwise `keep`.")


@dataclass(frozen=True)
class BlocksConfig:
    """How parameters are grouped into blocks, the unit of every transfer."""

    min_block_size: int = _leaf(
        SizeSpec(min_nbytes=1), 16 * 2**20,
        "When no repeated layer is found, modules holding at least this many bytes of "
        "parameters form a block.")
    modules: tuple[str, ...] | None = _leaf(
        PatternListSpec(nullable=True), None,
        "Module-name glob patterns (e.g. `model.layers.*`), one block per match, overriding the "
        "automatic grouping. null: automatic.", ["model.layers.*"])


@dataclass(frozen=True)
class PrefetchConfig:
    """How far ahead of the compute weights are fetched."""

    budget: int = _leaf(SizeSpec(), 2 * 2**30,
                        "Bytes of weights that may be in flight ahead of the compute.")
    depth: int = _leaf(IntSpec(min=0, max=64), 2, "Blocks fetched ahead; 0 disables prefetch.")
    keep_for_backward: int | Literal["auto"] = _leaf(
        SizeSpec(auto=True), "auto",
        "Bytes of compute weights a training forward may leave on the GPU for the backward that follows (the "
        "last blocks of the forward, which backward needs first), saving their second fetch. 0: every block "
        "is released after its forward and fetched again for backward. `auto`: what the GPU budget holds after "
        "the plan, the optimizer's `auto` choices and the activation reserve, up to the weights not resident "
        "(0 on the CPU and with `placement.weights: gpu`); the plan prints the choice (after a measured first "
        "step, see `tiers.gpu.activation_reserve`: the log and the plan's notes).", "4GiB")


@dataclass(frozen=True)
class LossScaleConfig:
    """Dynamic loss scaling; used only when `dtype` is `fp16`."""

    initial: float = _leaf(FloatSpec(min=0.0, min_open=True), 65536.0, "Starting loss scale.")
    growth_factor: float = _leaf(FloatSpec(min=1.0, min_open=True), 2.0,
                                 "Factor applied after `growth_interval` steps without overflow.")
    backoff_factor: float = _leaf(FloatSpec(min=0.0, max=1.0, min_open=True, max_open=True), 0.5,
                                  "Factor applied when a step overflows (the step is skipped).")
    growth_interval: int = _leaf(IntSpec(min=1), 2000,
                                 "Overflow-free steps before the scale grows.")


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW, run on the CPU over each block's fp32 shard while the GPU keeps computing."""

    lr: float = _leaf(FloatSpec(min=0.0, min_open=True), 1e-3, "Learning rate.")
    betas: tuple[float, float] = _leaf(
        FloatListSpec(length=2, item=FloatSpec(min=0.0, max=1.0, max_open=True)), (0.9, 0.999),
        "Adam coefficients for the running averages of the gradient and its square.",
        [0.9, 0.999])
    eps: float = _leaf(FloatSpec(min=0.0, min_open=True), 1e-8,
                       "Added to the denominator for numerical stability.")
    weight_decay: float = _leaf(FloatSpec(min=0.0), 0.01, "Decoupled weight decay.")
    grad_clip: float | None | Literal["auto"] = _leaf(
        FloatSpec(min=0.0, min_open=True, nullable=True, auto=True), "auto",
        "Global gradient-norm clipping threshold tierstore applies at each step's commit; null: none. `auto` (the "
        "default): 1.0, or none with `user_grad_clip: true` (your loop clips: its clip is then the only one, as in "
        "plain PyTorch; a number there is refused, since each step would be clipped twice).", 1.0)
    user_grad_clip: bool = _leaf(
        BoolSpec(), False,
        "Your training loop clips gradients itself (`torch.nn.utils.clip_grad_norm_`, HF Trainer's "
        "`max_grad_norm`, `optimizer.clip_grad_norm_`): updates wait for `optimizer.step()` so the loop's clip "
        "applies exactly, and `zero_grad()` before `step()` drops the step. Without it (and without `grad_clip` "
        "or fp16) updates start as gradients land, and a clip in the loop raises an error instead of being ignored.")
    accumulation_steps: int = _leaf(IntSpec(min=1), 1,
                                    "Micro-batches whose gradients are summed per update (a `step()` after fewer updates with "
                                    "the gradients summed so far, as plain PyTorch does).")
    accumulate_on: str = _leaf(
        ChoiceSpec(choices=("auto", "gpu", "host")), "auto",
        "Where the micro-batches' gradients of one step are summed (with `accumulation_steps` above 1). `gpu`: "
        "in each parameter's `.grad` on the device, in the compute dtype; the whole model's gradients stay on the "
        "GPU between micro-batches. `host`: each micro-batch's block gradient leaves the device when the block's "
        "backward is done and a CPU thread sums it in the block's host gradient buffer, in `host_grad_dtype` (bf16 "
        "under bf16 by default: bit for bit the plain loop's bf16 `.grad`; else fp32, the plain loop's for fp32 "
        "parameters); the GPU holds one block's gradient at a time (for models whose gradients do not fit beside "
        "the rest, such as 8B on a 24 GiB card). Between micro-batches such a "
        "parameter's `.grad` stands for the host sum: `model.zero_grad()` drops it, reading its values raises. "
        "Blocks updated on the GPU "
        "(`gpu_update_fraction`, `gpu_stream_fraction`) always sum on the device. `auto`: `host` when the model's "
        "gradients in the compute dtype would take more than a quarter of the GPU budget, else `gpu`.")
    host_grad_dtype: str = _leaf(
        ChoiceSpec(choices=("auto", "compute", "fp32")), "auto",
        "The dtype of the gradients the CPU updates from, in pinned host memory, and so of the host gradient sums "
        "(`accumulate_on: host`). `compute`: the compute dtype, half of fp32's pinned memory and PCIe bytes under "
        "bf16 (on a memory-bound run, pinned room for moments that would otherwise go to disk); one micro-batch's "
        "gradient loses nothing (it is computed in that dtype; the CPU widens it to fp32 for the clip and AdamW), "
        "and micro-batches sum in that dtype in their order, bit for bit what plain PyTorch's `.grad` of a bf16 "
        "parameter holds, and what `accumulate_on: gpu` sums. `fp32`: sums exact to fp32, finer than the plain "
        "bf16 loop's. `auto`: `compute` under bf16 where the micro-batches sum in host memory (`accumulate_on` "
        "resolved to `host`), else `fp32` (an fp32 gradient can wait on the GPU and be clipped there, which saves the "
        "CPU a pass over it; fp16 gradients carry the loss scale).")
    overlap: str = _leaf(
        ChoiceSpec(choices=("exact",), note="A one-step-delayed update (`delayed`) is not implemented."), "exact",
        "`exact`: results equal a plain PyTorch AdamW loop (the only mode).")
    cpu_threads: int | Literal["auto"] = _leaf(
        IntSpec(min=1, auto=True), "auto",
        "Threads of the CPU optimizer. `auto`: all cores but the ones the GPU launcher needs.", 14)
    gpu_update_fraction: float | Literal["auto"] = _leaf(
        FloatSpec(min=0.0, max=1.0, auto=True), "auto",
        "Fraction of the parameters (the first blocks, whose updates the CPU cannot hide) whose master and "
        "moments live on the GPU and are updated there. `auto`: as many blocks as the GPU budget holds after "
        "the plan's other GPU memory and a reserve for activations (`tiers.gpu.activation_reserve`; by "
        "default measured from the first training step, which updates on the CPU); 0 on the CPU. The plan "
        "prints the choice and its numbers (after the first step: the log and the plan's notes).", 0.25)
    gpu_stream_fraction: float | Literal["auto"] = _leaf(
        FloatSpec(min=0.0, max=1.0, auto=True), "auto",
        "Fraction of the parameters (the blocks right after the `gpu_update_fraction` ones) whose master "
        "and moments stay in pinned host memory but are updated on the GPU: each step the state is copied "
        "in while the block's backward runs, updated with the same fused AdamW, and written back. Costs "
        "PCIe bandwidth and a few blocks of transient GPU memory instead of resident state; frees CPU time. "
        "Needs master and moments on host. `auto`: the share that balances the CPU optimizer's time against "
        "the PCIe time each way (CPU AdamW and copy speeds measured at start); 0 on the CPU or when master or "
        "moments are on nvme.", 0.3)
    gpu_stream_ahead: int = _leaf(
        IntSpec(min=0, max=64), 8,
        "Streamed blocks (see `gpu_stream_fraction`) whose state may start moving to the GPU ahead of the "
        "block whose backward is running, so the copies overlap more of the backward. Each block ahead "
        "holds its master and moments (12 bytes per parameter) on the GPU; beyond the next block, only "
        "while the memory in use stays below what it was when the backward began (memory the backward "
        "has freed) and the GPU budget keeps room for the weight prefetch window.", 4)
    moment_dtype: str = _leaf(
        ChoiceSpec(choices=MOMENT_DTYPES), "fp32",
        "How Adam's two moments are stored, in host memory, in NVMe swap files and in checkpoints (the fp32 master "
        "stays fp32). `fp32` (the default): exact, torch.optim.AdamW's result bit for bit. `bf16`: 2 bytes a value "
        "each, half of fp32's; widened to fp32 for each update and rounded back, the second moment stochastically so "
        "that its slow decay is kept (approximate: the moments keep 8 bits of mantissa). `int8`: 1 byte a value, "
        "blockwise quantized with an fp32 scale per block (the second "
        "moment in a map suited to its range, as 8-bit Adam does): a quarter of fp32's bytes; approximate. The same "
        "format wherever the update runs (CPU or GPU: `gpu_update_fraction`, `gpu_stream_fraction`). "
        "`optimizer.state_dict()` gives fp32 moments either way, and a checkpoint written with one `moment_dtype` "
        "loads into a run with another.", "bf16")
    moment_kernel: str = _leaf(
        ChoiceSpec(choices=MOMENT_KERNELS), "auto",
        "How the CPU updates compact moments (`moment_dtype: bf16` or `int8`; fp32 moments and updates on the GPU "
        "always use torch ops). `compiled`: a C++ kernel that updates each block in one parallel pass over it, "
        "built with torch's cpp_extension when the run starts: it needs a C++ compiler and ninja "
        "(`pip install -e '.[kernel]'`), and the run refuses to start where it cannot build. The first build on a "
        "machine takes tens of seconds to a minute (logged, with its time); later runs load it from torch's "
        "extension cache (~/.cache/torch_extensions). `bf16`: widen, bf16's own AdamW (a fixed sequence of single fp32 "
        "operations, compiled without fused multiply-adds) and narrow a run of values in registers: the torch-ops "
        "path's bits (each build checks that; where it does not hold, bf16 uses torch ops with one warning naming "
        "the compiler). `int8`: decode, AdamW and encode of each "
        "block in registers; not bit-identical to torch ops (the same maps and per-block scales, codes within one "
        "of each other). `auto` (the default): `compiled` where it builds, else torch ops with one warning. "
        "`torch`: never the kernel.",
        "compiled")
    loss_scale: LossScaleConfig = _section(LossScaleConfig, "fp16 loss scaling.")


@dataclass(frozen=True)
class ProfileConfig:
    """Recording of transfers and timings."""

    dir: str | None = _leaf(PathSpec(nullable=True), None,
                            "Directory to write the profile to; null: no profile.", "profile")
    trace: bool = _leaf(BoolSpec(), True, "Write a Chrome trace (chrome://tracing, Perfetto).")
    plot: bool | Literal["auto"] = _leaf(
        BoolSpec(auto=True), "auto",
        "Write plot.png (bandwidth per path and stalls per step). `auto`: when matplotlib is installed "
        "(`pip install -e '.[plot]'`); `tierstore profile DIR --plot` draws it later from the saved summary.")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the bundled example model trained by `tierstore train`."""

    vocab_size: int = _leaf(IntSpec(min=1), 256, "Vocabulary size (256: bytes).")
    hidden_size: int = _leaf(IntSpec(min=1), 256, "Width; must be divisible by `num_heads`.")
    num_layers: int = _leaf(IntSpec(min=1), 4, "Transformer layers.")
    num_heads: int = _leaf(IntSpec(min=1), 4, "Attention heads.")
    ffn_size: int = _leaf(IntSpec(min=1), 688, "Hidden size of the feed-forward layers.")
    max_seq_len: int = _leaf(IntSpec(min=1), 1024,
                             "Longest sequence; must be >= `train.seq_len`.")


@dataclass(frozen=True)
class TrainConfig:
    """Settings of the `tierstore train` command: the bundled example model, or an HF model with `--model DIR`
    (`model` is the example's shape alone)."""

    steps: int = _leaf(IntSpec(min=1), 50, "Optimizer steps to run.")
    batch_size: int = _leaf(IntSpec(min=1), 8, "Sequences per micro-batch.")
    seq_len: int = _leaf(IntSpec(min=8), 256, "Tokens per sequence.")
    log_every: int = _leaf(IntSpec(min=1), 10, "Log the loss every this many steps.")
    lr_schedule: str = _leaf(
        ChoiceSpec(choices=("constant", "cosine")), "constant",
        "Learning-rate schedule of `tierstore train` over `steps`: `constant`, or `cosine` decay to 10% of "
        "`optimizer.lr`. Its state is saved in checkpoints and restored by `--resume`.")
    warmup_steps: int = _leaf(IntSpec(min=0), 0, "Steps of linear learning-rate warm-up before the schedule.")
    model: ModelConfig = _section(ModelConfig, "The example model's shape.")
    checkpoint_dir: str | None = _leaf(
        PathSpec(nullable=True), None,
        "Directory for checkpoints; null: none. Must not contain, or lie inside, "
        "`tiers.nvme.path`.", "checkpoints")
    save_every: int = _leaf(IntSpec(min=0), 0,
                            "Save a checkpoint every this many steps; 0: only at the end "
                            "(if `checkpoint_dir` is set). Needs `checkpoint_dir` when > 0.", 100)
    keep_last: int = _leaf(IntSpec(min=1), 3, "Checkpoints kept; older ones are deleted (only this run's own: "
                           "checkpoints of another run are never deleted).")
    stop_on_save_failure: bool = _leaf(
        BoolSpec(), False,
        "What a failed checkpoint save (disk full, IO error) does. `false`: a warning; the previous "
        "checkpoint stays `latest` and training goes on, trying again at the next save. `true`: the run "
        "stops with the error.")


@dataclass(frozen=True)
class TierstoreConfig:
    """The whole tierstore configuration; build it with :func:`runtime.config.loader.load_config`."""

    device: str = _leaf(ChoiceSpec(choices=("auto", "cuda", "cpu")), "auto",
                        "Compute device. `auto`: cuda if available, else cpu.")
    dtype: str = _leaf(ChoiceSpec(choices=("bf16", "fp16", "fp32")), "bf16",
                       "Compute dtype of weights and activations on the device.")
    seed: int = _leaf(IntSpec(min=0, max=2**64 - 1), 0, "Random seed.")
    tiers: TiersConfig = _section(TiersConfig, "Memory tiers.")
    placement: PlacementConfig = _section(PlacementConfig, "Where each state lives.")
    blocks: BlocksConfig = _section(BlocksConfig, "Grouping of parameters into blocks.")
    prefetch: PrefetchConfig = _section(PrefetchConfig, "Prefetch of weights.")
    optimizer: OptimizerConfig = _section(OptimizerConfig, "The CPU AdamW optimizer.")
    profile: ProfileConfig = _section(ProfileConfig, "Profiling.")
    train: TrainConfig = _section(TrainConfig, "The `tierstore train` command.")


# --------------------------------------------------------------------------------------------
# Schema-level rules and introspection (pure: no YAML, no file system).

def join_path(path: str, key: str) -> str:
    """Return the dotted YAML path of ``key`` inside the section at ``path`` ("" = top level).

    A key that is empty or holds a dot or whitespace is shown quoted, so the path stays readable.
    """
    if not key or any(c == "." or c.isspace() for c in key):
        key = '"' + key.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return key if path in ("", "<root>") else f"{path}.{key}"


def schema_paths(cls: type = TierstoreConfig, prefix: str = "") -> list[str]:
    """Return every dotted key path of the schema below ``cls``, sections included."""
    paths = []
    for f in fields(cls):
        sub = join_path(prefix, f.name)
        paths.append(sub)
        if "section" in f.metadata:
            paths.extend(schema_paths(f.metadata["section"], sub))
    return paths


def unknown_key_message(key: object, cls: type, path: str) -> str:
    """Explain why ``key`` is not allowed in section ``cls`` at ``path``, with a suggestion."""
    names = [f.name for f in fields(cls)]
    allowed = f" Keys allowed {'here' if path else 'at the top level'}: {', '.join(names)}."
    if not isinstance(key, str):
        return f"keys must be names, got {describe_value(key)}.{allowed}"
    if key == "<<":
        return "YAML merge keys (`<<`) are not supported; write the keys out." + allowed
    close = [n for n in names if n.lower() == key.lower()]
    close = close or difflib.get_close_matches(key, names, n=1, cutoff=0.6)
    if close:
        return f"unknown key `{key}`; did you mean `{close[0]}`?{allowed}"
    # A key written in the wrong section is a common slip: point at where it lives.
    elsewhere = [p for p in schema_paths() if p.rsplit(".", 1)[-1] == key]
    if elsewhere:
        return f"unknown key `{key}` here; it belongs at `{elsewhere[0]}`.{allowed}"
    return f"unknown key `{key}`.{allowed}"


@dataclass(frozen=True)
class Problem:
    """Settings that are valid one by one but contradict each other.

    Attributes:
        kind: the :class:`runtime.config.loader.ConfigError` kind.
        path: the YAML path the error is reported at.
        message: what is wrong and what to change.
        line_paths: other paths whose line locates the problem when ``path`` was not written.
    """

    kind: str
    path: str
    message: str
    line_paths: tuple[str, ...] = ()


def clip_threshold(opt: OptimizerConfig) -> float | None:
    """The norm tierstore clips each step's gradients to (``optimizer.grad_clip`` with ``auto`` resolved), or None."""
    if opt.grad_clip == "auto":
        return None if opt.user_grad_clip else 1.0
    return opt.grad_clip


def _block_over_budget(nvme: NvmeTierConfig, written: Callable[[str], bool] | None) -> Problem:
    """``tiers.nvme.block_size`` above ``tiers.nvme.budget``: reported at the budget when the user wrote it and left
    the block size at its default (``budget: 1MiB`` under the 64MiB default block), else at the block size."""
    budget, block = format_size(nvme.budget), format_size(nvme.block_size)
    if written is not None and written("tiers.nvme.budget") and not written("tiers.nvme.block_size"):
        return Problem("bad_value", "tiers.nvme.budget",
                       f"{budget} is below one block of {block} (tiers.nvme.block_size, the default); raise "
                       f"tiers.nvme.budget to at least {block} or lower tiers.nvme.block_size.")
    default = "" if written is None or written("tiers.nvme.budget") else ", the default"
    return Problem("bad_value", "tiers.nvme.block_size",
                   f"{block} is above the NVMe budget of {budget} (tiers.nvme.budget{default}); lower "
                   f"tiers.nvme.block_size or raise tiers.nvme.budget to at least {block}.", ("tiers.nvme.budget",))


def consistency_problems(cfg: TierstoreConfig, written: Callable[[str], bool] | None = None) -> list[Problem]:
    """Return the contradictions between settings of ``cfg``, in a fixed order (empty: none).

    ``written``: whether the user wrote a dotted path (``runtime.config.loader`` knows; None: unknown), so that a
    problem between a written key and a default is reported at the key the user wrote."""
    problems = []
    nvme = cfg.tiers.nvme
    for kind in ("weights", "master", "moments"):
        if getattr(cfg.placement, kind) == "nvme" and nvme.path is None:
            problems.append(Problem(
                "missing_key", "tiers.nvme.path",
                f"placement.{kind} is `nvme` but tiers.nvme.path is not set (null disables the "
                "NVMe tier). Set `path:` under tiers.nvme to a directory (or `tmp` for a "
                f"temporary one), or place {kind} on `host`.", (f"placement.{kind}",)))
    if nvme.block_size > nvme.budget:
        problems.append(_block_over_budget(nvme, written))
    opt = cfg.optimizer
    if opt.user_grad_clip and isinstance(opt.grad_clip, float):
        problems.append(Problem(
            "bad_value", "optimizer.grad_clip",
            f"optimizer.grad_clip ({opt.grad_clip}) with optimizer.user_grad_clip: true would clip every step twice: "
            "tierstore would clip again after your loop's clip, which plain PyTorch does not. Leave grad_clip out "
            "(`auto`: no clip of tierstore's beside the loop's) or set it to null. (A config that tierstore wrote "
            "before 2026-11-28 holds grad_clip: 1.0, the default then: runs with it clipped each step twice, and "
            "without it a resumed run clips once.)", ("optimizer.user_grad_clip",)))
    if opt.moment_kernel == "compiled" and opt.moment_dtype not in ("bf16", "int8"):
        problems.append(Problem(
            "bad_value", "optimizer.moment_kernel",
            f"optimizer.moment_kernel: compiled asks for the compiled moment kernel, but optimizer.moment_dtype is "
            f"{opt.moment_dtype}: only bf16 and int8 moments have one, so it would never run. Set moment_dtype: bf16 "
            "or int8, or leave moment_kernel out (auto).", ("optimizer.moment_dtype",)))
    # `auto` is resolved at offload time (runtime.planning.auto_placement), where these rules hold by construction.
    update_fraction, stream_fraction = opt.gpu_update_fraction, opt.gpu_stream_fraction
    if isinstance(update_fraction, float) and isinstance(stream_fraction, float) and update_fraction + stream_fraction > 1.0:
        problems.append(Problem(
            "out_of_range", "optimizer.gpu_stream_fraction",
            f"optimizer.gpu_update_fraction ({opt.gpu_update_fraction}) and gpu_stream_fraction "
            f"({opt.gpu_stream_fraction}) add up to more than 1; lower one of them.",
            ("optimizer.gpu_update_fraction",)))
    if not isinstance(stream_fraction, str) and stream_fraction > 0 and "nvme" in (cfg.placement.master, cfg.placement.moments):
        problems.append(Problem(
            "bad_value", "optimizer.gpu_stream_fraction",
            "optimizer.gpu_stream_fraction streams master and moments from pinned host memory, but "
            f"placement puts {'master' if cfg.placement.master == 'nvme' else 'moments'} on nvme; "
            "place them on host (or auto), or set gpu_stream_fraction: 0.",
            ("placement.master", "placement.moments")))
    if opt.host_grad_dtype == "compute" and cfg.dtype == "fp16":
        problems.append(Problem(
            "bad_value", "optimizer.host_grad_dtype",
            "optimizer.host_grad_dtype: compute is for bf16: under fp16 the host gradients carry the loss scale, "
            "and tierstore's overflow checks and unscaling work on fp32 ones. Use `auto` or `fp32` (the same under "
            "fp16), or dtype: bf16.", ("dtype",)))
    model = cfg.train.model
    if model.hidden_size % model.num_heads:
        nearest = model.num_heads * max(1, round(model.hidden_size / model.num_heads))
        problems.append(Problem(
            "bad_value", "train.model.hidden_size",
            f"hidden_size {model.hidden_size} is not divisible by num_heads {model.num_heads}; "
            f"pick e.g. hidden_size {nearest}.", ("train.model.num_heads",)))
    if cfg.train.seq_len > model.max_seq_len:
        problems.append(Problem(
            "out_of_range", "train.seq_len",
            f"seq_len {cfg.train.seq_len} is longer than train.model.max_seq_len "
            f"{model.max_seq_len}; lower seq_len or raise max_seq_len.",
            ("train.model.max_seq_len",)))
    if cfg.train.save_every > 0 and cfg.train.checkpoint_dir is None:
        problems.append(Problem(
            "missing_key", "train.checkpoint_dir",
            f"train.save_every is {cfg.train.save_every} but train.checkpoint_dir is not set, "
            "so no checkpoint would be saved. Set `checkpoint_dir:` or write `save_every: 0`.",
            ("train.save_every",)))
    return problems


#: Opening of docs/config.md: how values are read, independent of any one field.
REFERENCE_INTRO = """\
# Configuration reference

<!-- Generated from runtime/config/schema.py by runtime.config.loader.config_reference_markdown();
     do not edit by hand (a test checks that this file matches). -->

A tierstore config is a YAML file read by `runtime.load_config(path)` (a dict is accepted too).
Every key is optional; a missing key takes the default below. The loader is strict: an unknown
or duplicate key, a value of the wrong type or out of range, or settings that contradict each
other are refused with the file, line and key path, e.g.

```
tiers.yaml:12: tiers.nvme.io_threads: expected an integer in 1..64, got 0.
  Write e.g. `io_threads: 4`.
```

How values are read:

- YAML 1.2 rules: only `true` and `false` are booleans (`on`, `off`, `yes`, `no` are text);
  `1e-3` is a number; `010` is ten.
- Numbers: an integer is accepted where a number is wanted, never the other way round. `1e8` or
  `100.0` in an integer field is refused with the exact integer to write instead.
- Sizes: an integer of bytes or a number with a unit, e.g. `512MiB`, `1.5GB`, `64 KiB`, `1e9`.
  Units: B, KB, MB, GB, TB (powers of 1000) and KiB, MiB, GiB, TiB (powers of 1024), case
  ignored. `K`, `M`, `G` alone are refused as ambiguous. Fractions of a byte are rounded.
- Paths: a leading `~` is expanded; relative paths are relative to the working directory.
  `tiers.nvme.path: tmp` means a fresh temporary directory (write `./tmp` for a directory
  named tmp).
- A section written with nothing under it (e.g. every line commented out) takes its defaults.
  An empty file is refused; write `{}` for all defaults.
- `null` is accepted only where the table says so.
- Placing weights, master or moments on `nvme` requires `tiers.nvme.path`. When it names a
  directory, the directory must exist, be writable, be this user's and writable by nobody else (a
  sticky shared directory such as /tmp is refused), and not overlap `train.checkpoint_dir`.
"""


def _md_cell(text: str) -> str:
    # A "|" would end the table cell.
    return text.replace("|", "\\|").replace("\n", " ")


def _reference_sections(cls: type, path: str, out: list[str],
                        render: Callable[[object], str]) -> None:
    title = f"`{path}`" if path else "Top level"
    out.append(f"\n## {title}\n\n{cls.__doc__}\n")
    out.append("| key | accepts | default | meaning |\n|---|---|---|---|")
    subsections = []
    for f in fields(cls):
        doc = f.metadata["doc"]
        if "section" in f.metadata:
            sub = join_path(path, f.name)
            anchor = sub.replace(".", "")
            out.append(f"| `{f.name}` | section | | {_md_cell(doc)} See [`{sub}`](#{anchor}). |")
            subsections.append((f.metadata["section"], sub))
            continue
        spec: Spec = f.metadata["spec"]
        accepts = spec.describe()
        if spec.nullable and not accepts.endswith("or null"):
            accepts += " or null"
        default = "null" if f.default is None else render(spec.to_plain(f.default))
        out.append(f"| `{f.name}` | {_md_cell(accepts)} | `{_md_cell(default)}` | "
                   f"{_md_cell(doc)} |")
    for section, sub in subsections:
        _reference_sections(section, sub, out, render)


def reference_tables(render: Callable[[object], str]) -> list[str]:
    """Return the Markdown tables of every section, in schema order.

    Args:
        render: writes a default value (plain data) as it would appear in YAML.
    """
    out: list[str] = []
    _reference_sections(TierstoreConfig, "", out, render)
    return out
