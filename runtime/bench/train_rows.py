"""The rows of ``tierstore bench train``: their names, suffixes, descriptions and tierstore configs.

A row is a base name (:data:`ROWS`) followed by suffixes. Pure logic, no torch: running a row is
``runtime.bench.train_bench``'s job, the model it trains ``runtime.bench.train_model``'s.

Suffixes, in any order:

- tierstore rows: ``-fNN`` NN% of the parameters (the first blocks) updated on the GPU
  (``optimizer.gpu_update_fraction``); ``-sNN`` NN% (the next blocks) updated on the GPU over state streamed
  from host (``optimizer.gpu_stream_fraction``); ``-aN`` N streamed blocks' state brought in ahead
  (``optimizer.gpu_stream_ahead``); ``-tNN`` NN CPU optimizer threads; ``-keep`` weights kept on the GPU from
  forward to backward (``prefetch.keep_for_backward``); ``-auto`` the runtime chooses all three of
  ``gpu_update_fraction``, ``gpu_stream_fraction`` and ``keep_for_backward`` (``auto``); ``-cap`` the
  process's GPU memory capped at ``--gpu-cap``, else at the peak the first ds-zero2-cpu row without -ckpt
  reserved in the same call; ``-noseg``
  PyTorch's default allocator (our rows otherwise run with ``expandable_segments:True`` unless
  ``PYTORCH_CUDA_ALLOC_CONF`` is set); ``-nopace`` streamed state's write-backs queued at once, not paced
  (the comparison for [Note: paced write-back] in ``runtime/engine/writeback.py``); ``-rc`` the layers' activations
  recomputed in the backward (``placement.activations: recompute``); ``-norc`` on an -auto row, activations kept
  (``keep``: -auto rows otherwise leave the choice to the runtime, ``auto``, and rows without -auto keep them).
  A row without -f, -s, -keep or -auto sets those to 0. ``-bf16m`` / ``-int8m``: Adam's moments stored as bf16 /
  int8 (``optimizer.moment_dtype``; every update on the CPU, so not with -f or -s).
- every row: ``-clip`` global-norm clipping at 1.0 (tierstore ``optimizer.grad_clip``, DeepSpeed
  ``gradient_clipping``, ``clip_grad_norm_`` over the fp32 masters in the plain row); ``-ckpt`` activation
  checkpointing in every decoder layer (``runtime.bench.train_model.BenchModel.checkpointing``): the same
  gradients for a recomputed forward, and activation memory that under a GPU cap can hold optimizer state.
"""

from __future__ import annotations

from typing import Any

ROWS = {
    "torch": "plain PyTorch, all on GPU, fused AdamW (fp32 masters)",
    "host": "tierstore: weights + optimizer on pinned host",
    "gpu-weights": "tierstore: weights on GPU, optimizer on pinned host",
    "nvme": "tierstore: weights + master on host, moments on NVMe",
    "nvme-auto": "tierstore: weights + master on host, moments in pinned RAM up to ds-zero3-cpu's peak RSS "
                 "(else ds-zero3-nvme's), the rest on NVMe",
    "host-accum8": "tierstore: weights + optimizer on host, accumulation 8",
    "torch-accum8": "plain PyTorch, accumulation 8",
    "ds-zero2-cpu": "DeepSpeed ZeRO-2, optimizer offloaded to CPU",
    "ds-zero3-cpu": "DeepSpeed ZeRO-3, params + optimizer offloaded to CPU",
    "ds-zero3-nvme": "DeepSpeed ZeRO-3, params on CPU, optimizer on NVMe (aio 8 MiB blocks, queue depth 8, 8 threads; "
                     "8 buffers, no pipelined read/write: DeepSpeed 0.19.8's pipelined swapper fails an assertion)",
}
FLAGS = ("keep", "cap", "noseg", "clip", "auto", "nopace", "ckpt", "rc", "norc", "bf16m", "int8m")
MOMENT_FLAGS = {"bf16m": "bf16", "int8m": "int8"}  # suffix -> optimizer.moment_dtype
ANY_ROW = ("clip", "ckpt")  # suffixes every row takes, plain PyTorch and DeepSpeed too
NUMBERED = ("f", "s", "a", "t")
ACCUMULATION = 8  # micro-batches per step of the -accum8 rows
CLIP_NORM = 1.0  # the -clip rows' max global norm
KEEP_NBYTES = "4GiB"  # prefetch.keep_for_backward of a -keep row


def row_options(row: str) -> tuple[str, dict[str, int | bool]]:
    """'host-f30-t15-keep-cap' -> ('host', {'f': 30, 't': 15, 'keep': True, 'cap': True}): the base row and
    its suffixes (see the module docstring)."""
    parts = row.split("-")
    options: dict[str, int | bool] = {}
    while len(parts) > 1 and "-".join(parts) not in ROWS:  # 'nvme-auto' is a row; 'host-auto' is host with -auto
        last = parts[-1]
        if last in FLAGS:
            options[last] = True
        elif last[:1] in NUMBERED and last[1:].isdigit():
            options[last[0]] = int(last[1:])
        else:
            break
        parts.pop()
    return "-".join(parts), options


def split_row(row: str) -> tuple[str, float]:
    """'host-f50' -> ('host', 0.5): the base row and its GPU update share (other suffixes dropped)."""
    base, options = row_options(row)
    return base, int(options.get("f", 0)) / 100


def is_tierstore(row: str) -> bool:
    """True for rows that train through ``runtime.offload``."""
    return not row.startswith(("torch", "ds-"))


def accumulation_of(row: str) -> int:
    """Micro-batches per optimizer step of the row."""
    return ACCUMULATION if row_options(row)[0].endswith("accum8") else 1


def row_errors(rows: list[str]) -> list[str]:
    """Why each unusable row name is unusable (empty when all are fine)."""
    errors = []
    for row in rows:
        base, options = row_options(row)
        if base not in ROWS:
            errors.append(f"{row}: unknown row {base!r}; choose from {', '.join(ROWS)}")
            continue
        extra = set(options) - set(ANY_ROW)
        if not is_tierstore(row) and extra:
            errors.append(f"{row}: -{', -'.join(sorted(extra))} applies to tierstore rows only ({base} takes -clip "
                          "and -ckpt)")
        elif options.get("auto") and {"f", "s", "keep"} & set(options):
            errors.append(f"{row}: -auto chooses the GPU update, stream and keep shares itself; drop -f, -s or -keep")
        elif options.get("rc") and (options.get("norc") or options.get("ckpt")):
            errors.append(f"{row}: -rc recomputes the layers' activations; drop -norc or -ckpt (the model's own "
                          "checkpointing)")
        elif sum(bool(options.get(flag)) for flag in MOMENT_FLAGS) > 1:
            errors.append(f"{row}: one of -{', -'.join(MOMENT_FLAGS)}")
        elif any(options.get(flag) for flag in MOMENT_FLAGS) and (options.get("f") or options.get("s")):
            errors.append(f"{row}: compact moments update on the CPU; drop -f and -s (or use -auto: it resolves them to 0)")
        elif options.get("norc") and not options.get("auto"):
            errors.append(f"{row}: -norc keeps the activations that -auto would choose for; rows without -auto keep "
                          "them already")
    return errors


def describe_row(row: str) -> str:
    """What a row runs, for the table."""
    base, options = row_options(row)
    text = ROWS[base]
    text += f", {options['f']}% of the update on the GPU" if options.get("f") else ""
    text += f", {options['s']}% updated on the GPU over state streamed from host" if options.get("s") else ""
    text += f", {options['a']} streamed blocks ahead" if "a" in options else ""
    text += f", {options['t']} CPU optimizer threads" if "t" in options else ""
    text += ", weights kept for backward" if options.get("keep") else ""
    text += ", GPU update / stream / keep shares chosen by the runtime (auto)" if options.get("auto") else ""
    text += f", clipping at {CLIP_NORM}" if options.get("clip") else ""
    text += ", activation checkpointing" if options.get("ckpt") else ""
    text += ", activations recomputed (placement.activations: recompute)" if options.get("rc") else ""
    text += ", activations kept (placement.activations: keep)" if options.get("norc") else ""
    text += ", GPU memory capped (--gpu-cap, else DeepSpeed ZeRO-2's peak)" if options.get("cap") else ""
    text += ", write-backs not paced" if options.get("nopace") else ""
    text += "".join(f", {dtype} moments" for flag, dtype in MOMENT_FLAGS.items() if options.get(flag))
    return text + (", default CUDA allocator" if options.get("noseg") else "")


def row_config(row: str, nvme_dir: str | None) -> dict[str, Any]:
    """The ``runtime.offload`` config of a tierstore row (before the bench adds budgets and accumulation)."""
    base, options = row_options(row)
    auto = bool(options.get("auto"))
    optimizer: dict[str, Any] = {
        "grad_clip": CLIP_NORM if options.get("clip") else None, "lr": 1e-4, "cpu_threads": options.get("t", "auto"),
        "gpu_update_fraction": "auto" if auto else int(options.get("f", 0)) / 100,
        "gpu_stream_fraction": "auto" if auto else int(options.get("s", 0)) / 100}
    if "a" in options:
        optimizer["gpu_stream_ahead"] = int(options["a"])
    for flag, moment_dtype in MOMENT_FLAGS.items():
        if options.get(flag):
            optimizer["moment_dtype"] = moment_dtype
    keep: str | int = "auto" if auto else (KEEP_NBYTES if options.get("keep") else 0)
    config: dict[str, Any] = {"dtype": "bf16", "optimizer": optimizer, "prefetch": {"depth": 2, "keep_for_backward": keep}}
    if base in ("host", "host-accum8"):
        config["placement"] = {"weights": "host", "master": "host", "moments": "host"}
    elif base == "gpu-weights":
        config["placement"] = {"weights": "gpu", "master": "host", "moments": "host"}
    elif base in ("nvme", "nvme-auto"):
        config["placement"] = {"weights": "host", "master": "host", "moments": "nvme" if base == "nvme" else "auto"}
        config["tiers"] = {"nvme": {"path": nvme_dir or "tmp", "budget": "48GiB", "io_threads": 8}}
    # placement.activations: -auto rows leave it to the runtime (the default, auto) unless -norc; -rc recomputes
    config.setdefault("placement", {})["activations"] = (
        "recompute" if options.get("rc") else "auto" if auto and not options.get("norc") else "keep")
    return config
