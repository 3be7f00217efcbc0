"""``tierstore train``: train the bundled example model (or, with ``--model``, a local HF model) with offload.

With no arguments it runs an embedded default: the small example decoder on the Python standard library's
source (bytes), fp32 master on pinned host memory, Adam moments on NVMe swap files in a temporary directory,
weights fetched to the GPU block by block -- every tier in use.
"""

from __future__ import annotations

import argparse
import copy
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from runtime.bundled.data import ByteBatches, stdlib_text_bytes
from runtime.bundled.example_model import ExampleLM, ModelShape
from runtime.checkpoint.files import read_latest
from runtime.checkpoint.state import (
    CheckpointError,
    CheckpointRoot,
    ResumableData,
    resume_training,
    save_checkpoint,
    save_due,
)
from runtime.cli.job import TrainJob
from runtime.cli.train_hf import check_hf_inputs, hf_job
from runtime.config.loader import TierstoreConfig, TrainConfig, load_config
from runtime.core.ranks import rank_folder
from runtime.core.text import counted
from runtime.profiler import Profiler, measure_ceilings
from runtime.profiler.outputs import check_profile_dir
from runtime.profiler.traffic import TrafficCounter
from runtime.session import OffloadSession, offload
from tierstore import TierStoreError

log = logging.getLogger(__name__)


# tierstore train's defaults. A config file given with --config is laid over the documented defaults (the
# schema's, docs/config.md), nothing else: a two-line file changes two settings. Without --config, `tierstore
# train` shows the three tiers at work: the documented defaults with only DEMONSTRATION laid over them (and
# printed at the start of the run), so the quick start, a --config file and the docs agree on dtype, sequence
# length, steps and the rest. `--model DIR` without --config trains on the documented defaults alone (auto
# placement): a real model, not a demonstration.
DEMONSTRATION: dict[str, Any] = {
    "tiers": {"nvme": {"path": "tmp", "budget": "4GiB"}},
    "placement": {"weights": "host", "master": "host", "moments": "nvme"},
    # An `auto` fraction would put this small model's state on the GPU, and the tiers would not be shown.
    "optimizer": {"gpu_update_fraction": 0.0},
}


def default_config() -> dict[str, Any]:
    """The embedded config of ``tierstore train`` without ``--config``: the documented defaults with
    ``DEMONSTRATION`` over them (all three tiers in use); why, in the comment above ``DEMONSTRATION``."""
    return copy.deepcopy(DEMONSTRATION)


def _flat(tree: dict[str, Any], prefix: str = "") -> list[str]:
    """``key.path: value`` for each leaf of a nested dict."""
    out = []
    for key, value in tree.items():
        out += _flat(value, f"{prefix}{key}.") if isinstance(value, dict) else [f"{prefix}{key}: {value}"]
    return out


def config_source(args: argparse.Namespace) -> str:
    """Where this run's settings come from, as the run's first lines say it."""
    if args.config is not None:
        return f"{args.config} over the documented defaults (docs/config.md)"
    if getattr(args, "model", None) is not None:
        return "the documented defaults (docs/config.md; --config FILE to change them)"
    return f"the documented defaults (docs/config.md) with {', '.join(_flat(DEMONSTRATION))}"


def build_model(cfg: TierstoreConfig) -> ExampleLM:
    """The example model with the config's shape, seeded."""
    m = cfg.train.model
    torch.manual_seed(cfg.seed)
    return ExampleLM(ModelShape(vocab_size=m.vocab_size, hidden_size=m.hidden_size, num_layers=m.num_layers,
                                num_heads=m.num_heads, ffn_size=m.ffn_size, max_seq_len=m.max_seq_len))


class Progress:
    """A one-line progress bar on stderr (a log line per ``log_every`` steps when stderr is not a terminal)."""

    def __init__(self, total: int, log_every: int):
        self.total = total
        self.log_every = log_every
        self.tty = sys.stderr.isatty()

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        """Show step / total, the loss and the throughput (rank 0 only, where several ranks run)."""
        if rank_and_world()[0] != 0:
            return
        width = 30
        filled = int(width * step / self.total)
        line = f"[{'#' * filled}{'.' * (width - filled)}] step {step}/{self.total}  loss {loss:.4f}  {tokens_per_s / 1e3:.1f}k tok/s"
        if self.tty:
            print("\r" + line, end="" if step < self.total else "\n", file=sys.stderr, flush=True)
        elif step % self.log_every == 0 or step == self.total:
            print(line, file=sys.stderr, flush=True)


def lr_scheduler(optimizer: torch.optim.Optimizer, train: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """The config's schedule: linear warm-up over ``warmup_steps``, then constant or cosine decay to 10%."""
    warmup, total, cosine = train.warmup_steps, train.steps, train.lr_schedule == "cosine"

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if not cosine:
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.45 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def save_or_warn(session: OffloadSession, root: CheckpointRoot | Path, data: ResumableData, step: int, train: TrainConfig,
                 scheduler: Any = None) -> Path | None:
    """Save a checkpoint after ``step``; returns its directory, or None when the save failed.

    A failed save (disk full, an IO error, a refused checkpoint) does not lose the run: the partial save is
    removed, the previous checkpoint stays ``latest``, a warning says so and training goes on from memory,
    to try again at the next save. With ``train.stop_on_save_failure`` the run stops instead, with one
    clear error."""
    try:
        return save_checkpoint(session, root, data, keep_last=train.keep_last, scheduler=scheduler)
    except (OSError, CheckpointError, TierStoreError) as exc:
        try:
            latest = read_latest(root.path if isinstance(root, CheckpointRoot) else root)
        except CheckpointError:
            latest = None
        kept = f"{latest} stays the latest checkpoint" if latest else "there is no checkpoint yet"
        if train.stop_on_save_failure:
            raise CheckpointError(f"checkpoint of step {step} failed: {exc}. {kept}; stopping "
                                  "(train.stop_on_save_failure is true)") from exc
        log.warning("checkpoint of step %d failed: %s. %s; training goes on and the next save tries again "
                    "(set train.stop_on_save_failure: true to stop instead)", step, exc, kept)
        return None


def settings(args: argparse.Namespace) -> TierstoreConfig:
    """The run's config: ``--config`` (or the embedded one) with the command line's flags over it."""
    flags = {"checkpoint_dir": "train.checkpoint_dir", "save_every": "train.save_every", "steps": "train.steps",
             "seq": "train.seq_len", "micro_batch": "train.batch_size", "accumulation": "optimizer.accumulation_steps",
             "lr": "optimizer.lr", "profile": "profile.dir"}
    overrides: dict[str, object] = {}
    for flag, key in flags.items():
        value = getattr(args, flag, None)
        if value is not None:
            overrides[key] = str(value) if isinstance(value, Path) else value
    if args.config is not None:
        source: Any = args.config
    elif getattr(args, "model", None) is not None:
        source = None  # the documented defaults
    else:
        source = default_config()
    return load_config(source, overrides=overrides or None)


def main(args: argparse.Namespace) -> int:
    """Run the training job the CLI asked for."""
    model_dir = getattr(args, "model", None)
    if model_dir is None:
        for flag in ("data", "output"):
            if getattr(args, flag, None) is not None:
                raise ValueError(f"--{flag} goes with --model DIR (a local HF model directory); without --model, "
                                 "tierstore train trains the bundled example model on its own data")
    cfg = settings(args)
    _check_ranks(args, cfg)
    if args.resume and cfg.train.checkpoint_dir is None:
        raise ValueError("--resume needs --checkpoint-dir DIR (or train.checkpoint_dir in the config)")
    if cfg.profile.dir:  # refused now, not after the run's steps
        check_profile_dir(rank_profile_dir(cfg.profile.dir, *rank_and_world()))
    _say(f"tierstore train: config: {config_source(args)}")
    if model_dir is not None:
        check_hf_inputs(args)  # a wrong DIR, FILE or --output is said before anything is made
    # Opened before the model is built, so a used or busy checkpoint root is refused before anything is allocated
    # (or a large --data file tokenized); held (locked) for the whole run.
    root = _checkpoint_root(cfg, args)
    try:
        return _run(cfg, args, root, hf_job(args, cfg) if model_dir is not None else bundled_job(cfg))
    finally:
        if isinstance(root, CheckpointRoot):
            root.close()


def _checkpoint_root(cfg: TierstoreConfig, args: argparse.Namespace) -> CheckpointRoot | Path | None:
    """``--checkpoint-dir``, claimed (locked) for the run: by this process, or, where several ranks run, by rank 0,
    the others taking its path (``save_checkpoint`` and ``resume_training`` are collective, rank 0 publishing). The
    ranks learn together whether rank 0 could claim it, before anything is built."""
    if cfg.train.checkpoint_dir is None:
        return None
    rank, world = rank_and_world()
    if world <= 1:
        return CheckpointRoot(cfg.train.checkpoint_dir, resume=args.resume, overwrite=args.overwrite)
    from runtime.core.ranks import join_ranks
    from runtime.planning.settings import resolve_device

    ranks = join_ranks(resolve_device(cfg))
    assert ranks is not None  # WORLD_SIZE > 1
    root: CheckpointRoot | Path = Path(cfg.train.checkpoint_dir)
    refusal: Exception | None = None
    if rank == 0:
        try:
            root = CheckpointRoot(cfg.train.checkpoint_dir, resume=args.resume, overwrite=args.overwrite)
        except Exception as error:
            refusal = error
    others = ranks.others_refusing(None if refusal is None else f"{type(refusal).__name__}: {refusal}")
    if refusal is not None:
        raise refusal
    if others:
        raise ValueError(f"--checkpoint-dir {cfg.train.checkpoint_dir}: rank 0 could not claim it ({others[0][1]})")
    return root


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the number of ranks (0 and 1 in a run of one process; torchrun's environment else)."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def rank_profile_dir(directory: str, rank: int, world: int) -> Path:
    """Where this process writes its profile (``--profile DIR``): DIR in a run of one process, else DIR/rank<N>:
    each rank profiles its own session, whose traffic is its own blocks'."""
    return Path(directory if world <= 1 else rank_folder(directory, rank))


def _ceilings_one_rank_at_a_time(session: Any) -> dict[str, float]:
    """The profiler's bandwidth ceilings (``measure_ceilings``), the ranks probing one after another: probing
    together they would share the host's memory and the disk, and each would measure less than its path moves."""
    ranks = session.ranks
    if ranks is None:
        return measure_ceilings(session.store)
    ceilings: dict[str, float] = {}
    for turn in range(ranks.world_size):
        if turn == ranks.rank:
            ceilings = measure_ceilings(session.store)
        # in the store, not a collective: the probes pin host memory ([Note: no GPU collective beside a pinning])
        ranks.host_barrier("the profile's bandwidth probes, one rank at a time")
    return ceilings


def _say(line: str, end: str = "\n") -> None:
    """Print for the person running the command: rank 0's lines only, where several ranks run."""
    if rank_and_world()[0] == 0:
        print(line, end=end, file=sys.stderr, flush=True)


def _check_ranks(args: argparse.Namespace, cfg: TierstoreConfig) -> None:
    """Several ranks (``--nproc``): refuse, before anything is built, what they cannot do (yet), naming the flag."""
    world = rank_and_world()[1]
    if world <= 1:
        return
    if cfg.train.batch_size % world:
        raise ValueError(f"--micro-batch {cfg.train.batch_size} does not split between {world} processes (--nproc "
                         f"{world}): give a multiple of {world}")


def rank_rows(batch: Any, rank: int, world: int) -> Any:
    """This rank's rows of a micro-batch (tensors, or tuples / dicts of them, split along their first dimension):
    every rank reads the same stream of micro-batches and trains on its own part of each, so the step's gradient is
    the mean over the whole micro-batch, as one process would have it."""
    if world <= 1:
        return batch
    if isinstance(batch, torch.Tensor):
        share = batch.shape[0] // world
        return batch[rank * share:(rank + 1) * share]
    if isinstance(batch, tuple | list):
        return type(batch)(rank_rows(part, rank, world) for part in batch)
    if isinstance(batch, dict):
        return {key: rank_rows(value, rank, world) for key, value in batch.items()}
    raise TypeError(f"cannot split a micro-batch of {type(batch).__name__} between ranks")


def _mean_over_ranks(loss: torch.Tensor, world: int) -> float:
    """The micro-batch's loss as one process would report it: the mean of the ranks' (a collective: every rank)."""
    if world <= 1:
        return loss.item()
    total = loss.detach().float().reshape(1).clone()
    torch.distributed.all_reduce(total)
    return total.item() / world


def bundled_job(cfg: TierstoreConfig) -> TrainJob:
    """The bundled example model (``train.model``) on the standard library's source, read as bytes."""

    def loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor], device: torch.device) -> torch.Tensor:
        tokens, targets = batch
        return model(tokens.to(device, non_blocking=True), targets.to(device, non_blocking=True))

    model = build_model(cfg)
    return TrainJob(model, ByteBatches(stdlib_text_bytes(), cfg.train.batch_size, cfg.train.seq_len, seed=cfg.seed),
                    loss)


def _run(cfg: TierstoreConfig, args: argparse.Namespace, root: CheckpointRoot | Path | None, job: TrainJob) -> int:
    """Offload the job's model, train (resuming from ``root`` when asked), report."""
    steps, batch, seq = cfg.train.steps, cfg.train.batch_size, cfg.train.seq_len
    accumulation = cfg.optimizer.accumulation_steps
    rank, world = rank_and_world()
    _say(f"tierstore train: {sum(p.numel() for p in job.model.parameters()):,} parameters, {counted(steps, 'step')} "
         f"of {accumulation} x {batch} x {seq} tokens, dtype {cfg.dtype}"
         + (f", {world} processes ({batch // world} sequences of each micro-batch each)" if world > 1 else ""))
    model, optimizer = offload(job.model, cfg, init=job.init)
    if job.after_offload is not None:
        job.after_offload()
    session = optimizer.session  # type: ignore[attr-defined]
    device = session.store.device
    _say(f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU (no CUDA found)'}; "
         f"NVMe IO: {session.store.nvme_io_mode or 'no NVMe tier'}")
    traffic = TrafficCounter(device.type)  # a CPU run's paths say device, not GPU
    session.store.bus.subscribe(traffic)
    # --profile DIR: ceilings measured now (see runtime.profiler.ceilings), then listen until the session is closed.
    profiler = Profiler(session, _ceilings_one_rank_at_a_time(session)).start() if cfg.profile.dir else None
    data = job.data
    progress = Progress(steps, cfg.train.log_every)
    scheduler = lr_scheduler(optimizer, cfg.train)
    first_loss = last_loss = float("nan")
    failed_saves = 0
    begin = 0  # steps already done (by the run a checkpoint was taken from)
    total_s = 0.0
    try:
        if args.resume:
            assert root is not None  # main() refuses --resume without a checkpoint directory
            begin = resume_training(session, root, data, scheduler=scheduler)
            if begin >= steps:  # a requeued job whose run already finished: nothing to do, and no error
                print(f"tierstore train: the run in {cfg.train.checkpoint_dir} is already complete at step {begin} "
                      f"(train.steps is {steps}); nothing to train. Raise --steps to train further", file=sys.stderr)
                if job.finish is not None:
                    job.finish(session)
                return 0
        start = time.perf_counter()
        for step in range(begin + 1, steps + 1):
            step_start = time.perf_counter()
            for _ in range(accumulation):
                loss = job.loss(model, rank_rows(data.next(), rank, world), device)
                optimizer.scale_loss(loss / accumulation).backward()
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            last_loss = _mean_over_ranks(loss, world)
            first_loss = last_loss if step == begin + 1 else first_loss
            elapsed = time.perf_counter() - step_start
            progress.update(step, last_loss, accumulation * batch * seq / elapsed)
            if root is not None and save_due(step, steps, cfg.train.save_every):
                failed_saves += save_or_warn(session, root, data, step, cfg.train, scheduler) is None
        optimizer.synchronize()
        total_s = time.perf_counter() - start
        if job.finish is not None:
            job.finish(session)
    finally:
        session.close()
    num_tokens = (steps - begin) * accumulation * batch * seq
    _say(f"done: loss {first_loss:.4f} -> {last_loss:.4f} in {total_s:.1f} s ({num_tokens / total_s / 1e3:.1f}k tok/s)")
    if failed_saves:
        latest = read_latest(root.path if isinstance(root, CheckpointRoot) else root) if root is not None else None
        print(f"warning: {counted(failed_saves, 'checkpoint save')} failed (see above); latest checkpoint: {latest or 'none'}",
              file=sys.stderr)
    whose = f" (rank 0 of {world}: its own blocks' traffic)" if world > 1 else ""
    _say(traffic.summary() + whose)
    stats = session.controller.schedule.stats
    _say(f"prefetch hit rate {stats.hit_rate:.2f}; host time waiting on updates {session.controller.stats.wait_update_s:.2f} s, "
         f"on fetches {session.controller.stats.wait_fetch_s:.2f} s{whose}")
    if profiler is not None:
        profiler.stop()  # after close(): the last write-backs are in the totals
        assert cfg.profile.dir is not None  # the profiler runs only with one
        saved = profiler.save(rank_profile_dir(cfg.profile.dir, rank, world), trace=cfg.profile.trace,
                              plot=cfg.profile.plot is not False)
        print(f"profile{f' of rank {rank}' if world > 1 else ''} written to {saved.directory}; read it with: "
              f"tierstore profile {saved.directory}", file=sys.stderr)
    return 0
