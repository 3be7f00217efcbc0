"""The predicted time of one optimizer step, and the per-step traffic it is made of: pure arithmetic, no torch.

Owns: the bytes and parameter counts a placement must move and update per step (:class:`RowPlacement`,
:func:`row_traffic`; ``runtime.bench.train_bound`` bounds measured rows with the same accounting), the FLOPs of a
causal LM's training step (:func:`training_flops`) and the step-time model ``tierstore plan --model`` prints
(:func:`predict_step`). Leaves out: measuring rates (``runtime.update.rates``, the CLI's matmul probe), deciding
the placement (``runtime.planning.placement``) and the model's module (the caller counts its parameters).

The step-time model. A step of ``A`` micro-batches of ``b`` sequences of ``s`` tokens (``T = A b s`` tokens),
a model of ``N`` parameters, ``M`` of them in matmuls (all but an untied input embedding, a lookup), ``L``
layers of attention width ``d`` (heads x head size):

- compute: ``F = 6 M T`` forward and backward, plus ``2 M T`` with activation checkpointing (the forward runs
  again in the backward), plus attention's score and value matmuls, ``2 L b s^2 d`` a forward per micro-batch
  (causal: half of the square is skipped), three forwards' worth with the backward, four with checkpointing.
  ``T_compute = F / (COMPUTE_EFFICIENCY x matmul rate)``, the rate a large bf16 matmul reaches (measured on this
  machine's GPU, or ``--gpu-tflops``); a training step of an HF causal LM reaches ``COMPUTE_EFFICIENCY`` of it
  (kernel launches, norms, activations, HF's fp32 loss over the logits, the offload hooks between matmuls).
- each other resource's work is :func:`row_traffic`'s over its rate: ``T_fetch`` (weights fetched for each
  micro-batch's forward and backward), ``T_h2d`` (those, streamed state in, refreshed weights), ``T_d2h``
  (gradients to host, streamed state out), ``T_cpu`` (AdamW of the CPU-updated parameters at the CPU's rate beside
  copies), ``T_gpu_update`` (AdamW of the GPU-updated ones), ``T_nvme`` (the longer of state read and written).
- what overlaps: the weight fetches run on a copy engine beside the micro-batches' compute, so the micro-batch
  phase takes ``max(T_compute, T_fetch)``. When updates wait for the commit (gradient clipping, the default, or
  fp16) the updates come after the last backward: the CPU's AdamW runs beside the copies of the streamed state
  and the gradients, which share one link (in and out together ran at about the rate of one direction), and
  beside the disk, so ``max(T_cpu, T_d2h + T_h2d - T_fetch, T_nvme) + T_gpu_update`` is added (the next forward
  overlaps only their last blocks, which is left out). Without clipping the updates run during the backward and
  the step is the largest of all the terms. Plus ``MICRO_BATCH_OVERHEAD_S`` a micro-batch (hooks, the first fetch
  of each pass, which nothing hides).

Calibration (one H200, 16 cores, 24 GiB cap, sequence 2048, micro-batch 2, accumulation 4, bf16, checkpointing,
HF's loss, clipping 1.0, placement auto, 2026-11-29; measured rates: bf16 matmul 765 TFLOP/s, PCIe 54.6 GB/s each
way, CPU AdamW 1.96 G params/s beside copies): Llama-shaped 1.5B (hidden 2048, 16 layers, untied) 0.855 s a step
measured, 3.6B (hidden 3072, 28 layers, untied) 3.05 s, 2.8B (Llama-3-8B's layers, 8 of them) 2.05 s; this model
with ``COMPUTE_EFFICIENCY`` 0.37 predicts 1.06x, 0.93x and 1.07x of them. The efficiency is that one fit (of the
overlap forms tried, this one fit all three within 7%; the others left one 14-20% out). Checked, not fitted, on
the same three at sequence 4096, micro-batch 1, accumulation 8 (another H200 host: CPU AdamW 2.86 G params/s,
matmul 785 TFLOP/s, PCIe 55.4 GB/s): 1.39, 4.93 and 2.86 s measured, 1.10x, 0.94x and 1.05x predicted. On another
GPU, or at shapes and sequences far from these, the share a step reaches differs, and the prediction with it.

Limits: a prediction for the placement the plan shows (a config whose first step is measured is predicted as
that first step); the activations' memory is not modelled here (the plan reserves ``activation_reserve``);
host memory bandwidth shared between CPU AdamW and copies is in the CPU rate only where it was measured beside
copies; the disk is assumed to serve reads and writes at once.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

FP32 = 4
STATE_NBYTES = 3 * FP32  # fp32 master + exp_avg + exp_avg_sq of one parameter
# The share of the bf16 matmul rate a training step of an HF causal LM reaches (see the module docstring).
COMPUTE_EFFICIENCY = 0.37
GPU_ADAM_PARAMS_PER_S = 40e9  # torch's fused AdamW on the GPU where not measured: ~28 bytes a parameter at ~1.1 TB/s
MICRO_BATCH_OVERHEAD_S = 0.01  # per micro-batch: hooks, the first fetch of the forward and of the backward


@dataclass(frozen=True)
class RowPlacement:
    """Where one row's training state lives, in parameter counts and bytes per element."""

    num_params: int
    accumulation: int = 1
    resident_numel: int = 0  # weights on the GPU for the whole step: never fetched
    fetch_elem_nbytes: int = 0  # bytes one fetch moves per non-resident weight (fp32 master: 4, bf16 copy: 2)
    kept_numel: int = 0  # fetched weights kept from forward to backward: fetched once per micro-batch, not twice
    carried_numel: int = 0  # fetched weights a backward leaves for the next micro-batch's forward: not fetched again
    fresh_numel: int = 0  # fetched weights the GPU update leaves on the device: no fetch for the step's first forward
    cpu_update_numel: int = 0  # parameters whose AdamW runs on the CPU (their gradients go to host)
    gpu_update_numel: int = 0  # parameters whose AdamW runs on the GPU (resident or streamed state)
    streamed_numel: int = 0  # GPU-updated parameters whose fp32 state comes from host and goes back
    grad_elem_nbytes: int = FP32  # bytes per gradient element moved to host
    refresh_elem_nbytes: int = 0  # bytes per CPU-updated weight copied back to the GPU after the update
    disk_state_nbytes: int = 0  # optimizer state bytes read from disk and written back each step
    cpu_threads: int = 0  # threads of the CPU update (0: the machine's default)
    # bytes a streamed parameter's master and moments take each way (optimizer.moment_dtype: 12 with fp32 moments)
    state_elem_nbytes: float = STATE_NBYTES

    def as_dict(self) -> dict[str, float]:
        """The fields, for JSON."""
        return asdict(self)


def disk_state_nbytes(block_numels: list[int], gpu_updated: set[int], homes: dict[str, str], spilled: set[int],
                      moment_nbytes: list[int] | None = None) -> int:
    """Optimizer state bytes a step reads from NVMe and writes back (``RowPlacement.disk_state_nbytes``): of every
    CPU-updated block, the fp32 master where its home is NVMe, and each moment where its home is NVMe or the block's
    moments spilled there, at ``moment_nbytes[i]`` bytes (one moment of block ``i`` as ``optimizer.moment_dtype``
    stores it; None: fp32's 4 a value)."""
    disk = 0
    for index, numel in enumerate(block_numels):
        if index in gpu_updated:
            continue
        moment = FP32 * numel if moment_nbytes is None else moment_nbytes[index]
        for kind in ("master", "exp_avg", "exp_avg_sq"):
            if homes.get(kind) == "nvme" or (index in spilled and kind != "master"):
                disk += FP32 * numel if kind == "master" else moment
    return disk


@dataclass(frozen=True)
class Traffic:
    """The work of one optimizer step of a row, per resource."""

    compute_passes: int  # forward + backward passes (micro-batches)
    gpu_update_numel: int
    cpu_update_numel: int
    h2d_nbytes: int
    d2h_nbytes: int
    disk_read_nbytes: int
    disk_write_nbytes: int
    fetch_nbytes: int = 0  # of h2d_nbytes, the weight fetches of the micro-batches (the rest: update state, refresh)


def row_traffic(p: RowPlacement) -> Traffic:
    """Bytes and parameter counts one optimizer step of placement ``p`` must move and update."""
    fetched = p.num_params - p.resident_numel
    kept = min(p.kept_numel, fetched)
    fresh = min(p.fresh_numel, fetched)
    carried = min(p.carried_numel, fetched)
    weights_h2d = p.fetch_elem_nbytes * (p.accumulation * (2 * fetched - kept) - (p.accumulation - 1) * carried - fresh)
    state = round(p.state_elem_nbytes * p.streamed_numel)
    h2d = weights_h2d + state + p.refresh_elem_nbytes * p.cpu_update_numel
    d2h = p.grad_elem_nbytes * p.cpu_update_numel + state
    return Traffic(compute_passes=p.accumulation, gpu_update_numel=p.gpu_update_numel, cpu_update_numel=p.cpu_update_numel,
                   h2d_nbytes=h2d, d2h_nbytes=d2h, disk_read_nbytes=p.disk_state_nbytes, disk_write_nbytes=p.disk_state_nbytes,
                   fetch_nbytes=weights_h2d)


@dataclass(frozen=True)
class ModelShape:
    """What the FLOPs of a causal LM's step depend on."""

    num_params: int
    matmul_params: int  # parameters used in matmuls: all but an untied input embedding
    num_layers: int
    attention_width: int  # heads x head size
    hidden: int = 0
    ffn: int = 0
    vocab: int = 0


@dataclass(frozen=True)
class Work:
    """One optimizer step's work: ``accumulation`` micro-batches of ``micro_batch`` sequences of ``seq`` tokens."""

    seq: int
    micro_batch: int
    accumulation: int
    recompute: bool = True  # activation checkpointing: the forward runs again in the backward
    # A chunked loss (Liger's fused linear cross-entropy, runtime.integrations.hf_loss.use_chunked_loss): the logits
    # of this many tokens exist at once. None: HF's own loss, the whole micro-batch's logits at once.
    loss_piece_tokens: int | None = None

    @property
    def tokens(self) -> int:
        """Tokens a step."""
        return self.seq * self.micro_batch * self.accumulation


def training_flops(shape: ModelShape, work: Work) -> float:
    """FLOPs of one optimizer step (see the module docstring): matmuls 6 (8 with recompute) x M x tokens, and
    causal attention's 2 L b s^2 d a forward, 3 (4 with recompute) forwards' worth."""
    passes = 4 if work.recompute else 3  # forward, backward (twice a forward), recomputed forward
    dense = 2 * passes * shape.matmul_params * work.tokens
    attention = passes * 2 * shape.num_layers * work.micro_batch * work.seq ** 2 * shape.attention_width * work.accumulation
    return float(dense + attention)


ACTIVATION_SLACK_NBYTES = 1 << 30  # the allocator's fragmentation and the kernels' workspaces


def activation_nbytes(shape: ModelShape, work: Work, itemsize: int = 2) -> int:
    """GPU bytes a micro-batch's activations take at their peak, estimated for an HF causal LM: with checkpointing,
    each layer's input kept (``b s h``) and one layer's activations and their gradients while it is recomputed
    (about ``b s (10 h + 4 ffn)`` twice); without, every layer's; the logits in the compute dtype, their fp32 copy
    for the loss and the gradients of both (12 bytes a logit under bf16) of the whole micro-batch with HF's loss, of
    ``work.loss_piece_tokens`` tokens with a chunked loss; 1 GiB of slack."""
    tokens = work.micro_batch * work.seq
    layer = tokens * (10 * shape.hidden + 4 * shape.ffn) * itemsize
    layers = shape.num_layers * tokens * shape.hidden * itemsize + 2 * layer if work.recompute else shape.num_layers * layer
    logit_tokens = tokens if work.loss_piece_tokens is None else min(tokens, work.loss_piece_tokens)
    logits = logit_tokens * shape.vocab * (2 * itemsize + 2 * FP32)
    return layers + logits + ACTIVATION_SLACK_NBYTES


@dataclass(frozen=True)
class StepRates:
    """The rates a prediction is made with (bytes, parameters or FLOPs a second), and whether they were measured."""

    matmul_flops_per_s: float  # a large bf16 matmul on the GPU
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    cpu_adam_params_per_s: float
    disk_read_bytes_per_s: float
    disk_write_bytes_per_s: float
    gpu_adam_params_per_s: float = GPU_ADAM_PARAMS_PER_S
    compute_efficiency: float = COMPUTE_EFFICIENCY
    measured: tuple[str, ...] = ()  # which of the rates were measured on this machine (the rest are stated)

    def describe(self) -> str:
        """The rates for a person, each marked measured or stated."""
        def how(name: str) -> str:
            return "measured" if name in self.measured else "stated"

        return (f"GPU bf16 matmul {self.matmul_flops_per_s / 1e12:.0f} TFLOP/s ({how('gpu')}; a step reaches "
                f"{self.compute_efficiency:.0%} of it), PCIe {self.h2d_bytes_per_s / 1e9:.1f}/"
                f"{self.d2h_bytes_per_s / 1e9:.1f} GB/s host->GPU/GPU->host ({how('pcie')}), CPU AdamW "
                f"{self.cpu_adam_params_per_s / 1e9:.2f} G params/s ({how('cpu_adam')}), disk "
                f"{self.disk_read_bytes_per_s / 1e9:.1f}/{self.disk_write_bytes_per_s / 1e9:.1f} GB/s read/write "
                f"({how('disk')})")


@dataclass(frozen=True)
class Prediction:
    """A predicted step: each resource's seconds, how they combine, and the result."""

    terms: dict[str, float]  # T_compute, T_fetch, T_h2d, T_d2h, T_cpu, T_gpu_update, T_nvme
    step_s: float
    tokens: int
    flops: float
    limit: str  # the term the step waits on most
    updates_after_backward: bool

    @property
    def tokens_per_s(self) -> float:
        """Tokens a second at the predicted step time."""
        return self.tokens / self.step_s

    def describe(self) -> str:
        """The prediction for a person: step, tokens/s, and the terms."""
        terms = ", ".join(f"{k} {v:.3f} s" for k, v in self.terms.items())
        how = ("max(T_compute, T_fetch) + max(T_cpu, T_d2h + T_h2d - T_fetch, T_nvme) + T_gpu_update + overhead "
               "(updates wait for the commit)" if self.updates_after_backward else "max of the terms + overhead")
        return (f"predicted step {self.step_s:.2f} s, {self.tokens_per_s:,.0f} tokens/s "
                f"({self.flops / self.step_s / 1e12:.0f} TFLOP/s of {self.flops / 1e12:,.0f} TFLOP a step; the step waits "
                f"on {self.limit})\n  {terms}\n  step = {how}")


def predict_step(placement: RowPlacement, shape: ModelShape, work: Work, rates: StepRates, *,
                 updates_after_backward: bool) -> Prediction:
    """The step time of ``placement`` doing ``work`` at ``rates`` (the model of the module docstring).
    ``updates_after_backward``: updates wait for the commit (clipping or fp16)."""
    t = row_traffic(placement)
    flops = training_flops(shape, work)
    terms = {"T_compute": flops / (rates.matmul_flops_per_s * rates.compute_efficiency),
             "T_fetch": t.fetch_nbytes / rates.h2d_bytes_per_s,
             "T_h2d": t.h2d_nbytes / rates.h2d_bytes_per_s,
             "T_d2h": t.d2h_nbytes / rates.d2h_bytes_per_s,
             "T_cpu": t.cpu_update_numel / rates.cpu_adam_params_per_s,
             "T_gpu_update": t.gpu_update_numel / rates.gpu_adam_params_per_s,
             "T_nvme": max(t.disk_read_nbytes / rates.disk_read_bytes_per_s,
                           t.disk_write_nbytes / rates.disk_write_bytes_per_s)}
    overhead = work.accumulation * MICRO_BATCH_OVERHEAD_S
    if updates_after_backward:
        micro = {k: terms[k] for k in ("T_compute", "T_fetch")}
        update_state_h2d = terms["T_h2d"] - terms["T_fetch"]  # streamed state in and refreshed weights
        # the streamed state in and out and the gradients out share the link (see the module docstring)
        after = {"T_cpu": terms["T_cpu"], "T_d2h + update T_h2d": terms["T_d2h"] + update_state_h2d, "T_nvme": terms["T_nvme"]}
        step = max(micro.values()) + max(after.values()) + terms["T_gpu_update"] + overhead
        limit = max(micro, key=micro.__getitem__)
        if max(after.values()) > max(micro.values()):
            limit = max(after, key=after.__getitem__)
    else:
        gpu = terms["T_compute"] + terms["T_gpu_update"]
        others = {"T_compute + T_gpu_update": gpu, "T_h2d": terms["T_h2d"], "T_d2h": terms["T_d2h"],
                  "T_cpu": terms["T_cpu"], "T_nvme": terms["T_nvme"]}
        step = max(others.values()) + overhead
        limit = max(others, key=others.__getitem__)
    return Prediction(terms=terms, step_s=step, tokens=work.tokens, flops=flops, limit=limit,
                      updates_after_backward=updates_after_backward)
