"""Crash-safe checkpoints of tiered training state, and exact resume.

``save_checkpoint`` writes everything a resumed run needs to continue bit-identically: every block's fp32
master and Adam moments (read from wherever they live now: host memory, the GPU, or streamed straight
out of their NVMe swap files), the per-parameter step counters, the optimizer step, the fp16 loss
scaler, the RNG states (torch CPU and CUDA, Python, NumPy), the data stream's position and generator,
and the config. ``load_checkpoint`` verifies the whole checkpoint first, then writes each tensor into
whatever home the *new* session gives it (the tier layout and the NVMe path may differ from the saving
run's) and refreshes the compute weights. Each file is hashed as it is read into the tiers (one pass: the
bytes loaded are the bytes verified); ``meta.json`` is range-checked first (``runtime.checkpoint.meta``).
Which checkpoints a save may replace or prune, and the lock on the root: ``runtime.checkpoint.root``.

The swap directory is a cache and never the only copy: a checkpoint holds raw copies of the payloads, and
the store deletes its swap files on close. File layout and atomic publication: ``runtime.checkpoint.files``.
No pickle anywhere: tensors are raw little-endian bytes described in ``meta.json``; RNG and generator
states are uint8 tensors stored as raw bytes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import shlex
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np
import torch
import yaml

from runtime.checkpoint.files import (
    LATEST_NAME,
    MANIFEST_NAME,
    META_NAME,
    CheckpointError,
    DamagedCheckpointError,
    FileEntry,
    PendingCheckpoint,
    PendingFiles,
    check_listing,
    copy_range,
    find_checkpoint,
    json_bytes,
    list_checkpoints,
    parse_step_dir,
    read_verified,
    read_verified_into,
    resolve_checkpoint,
    verify_checkpoint,
    write_buffer,
)
from runtime.checkpoint.meta import FORMAT, VERSION, read_meta, saved_moment_dtype
from runtime.checkpoint.ranks import exchange, failed, from_first, raise_failure, raise_remote, status
from runtime.checkpoint.root import CheckpointRoot
from runtime.config.loader import dump_config
from runtime.core.signals import defers_interrupts
from runtime.engine.step_phase import StepPhase
from runtime.model.state_access import refresh_compute_weights
from runtime.planning.memory_plan import MOMENT_KINDS, STATE_KINDS, WeightSource
from runtime.update.moments import decode_moment, encode_moment, moment_storage
from tierstore import HEADER_NBYTES, CorruptFileError, Record, TierName, TierStore, payload_hasher

if TYPE_CHECKING:
    from runtime.core.blocks import Block
    from runtime.core.ranks import Ranks
    from runtime.engine.controller import Controller
    from runtime.session import OffloadSession

log = logging.getLogger(__name__)

__all__ = ["CheckpointError", "CheckpointRoot", "DamagedCheckpointError", "bench_checkpoint", "find_checkpoint", "load_checkpoint",
           "resume_training", "save_checkpoint", "save_due", "verify_checkpoint"]

CONFIG_NAME = "config.yaml"
_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                                   "float64": torch.float64, "int32": torch.int32, "int64": torch.int64, "uint8": torch.uint8}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


class ResumableData(Protocol):
    """A data stream that can be resumed exactly: ``position`` (batches drawn) and a torch generator."""

    position: int
    generator: torch.Generator


# ---- save ------------------------------------------------------------------------------------------
def save_checkpoint(session: OffloadSession, directory: str | os.PathLike[str] | CheckpointRoot,
                    data: ResumableData | None = None, keep_last: int = 3, *, threads: int = 4,
                    progress: Callable[[str], None] | None = None, overwrite: bool = False,
                    scheduler: Any = None) -> Path:
    """Save the session's whole training state under ``directory/step-NNNNNN`` and point ``latest`` at it.

    Call between steps (after ``optimizer.step()``, before the next forward). ``directory``: a
    :class:`CheckpointRoot` the run holds (locked for the run; the CLI's way), or a path, locked for this
    save only, where a root holding another run's checkpoints is refused unless ``overwrite``. Either way
    only checkpoints this run owns are ever replaced or pruned. ``data``: the batch source to resume
    (``position`` and ``generator``). ``scheduler``: an LR scheduler whose ``state_dict()`` is saved too (the
    optimizer's param_groups hyper-parameters always are). ``keep_last``: checkpoints kept; older ones are deleted only after
    the new one is in place. ``threads``: files written at once. ``progress`` is called with each file
    name once it is durable, then with "manifest.json", "renamed" and "latest" (a progress bar, or a test
    that needs time to pass inside a save). Returns the checkpoint directory.

    Several processes (``torchrun``): call it on every rank with the same arguments (a path, or on rank 0 the
    CheckpointRoot it holds and its path on the others); it writes one checkpoint, each rank the files of the blocks
    it owns, and rank 0 publishes it once every rank's files are durable; each rank returns its path. A failure on
    any rank publishes nothing and raises on every rank. Each rank's RNG states and ``data`` position are saved: a
    run resumed at as many ranks restores each rank's own, at another number (or in one process) rank 0's. See
    [Note: checkpoints of several processes] in runtime.checkpoint.ranks."""
    if sys.byteorder != "little":
        raise NotImplementedError("checkpoints are little-endian raw files; big-endian hosts are not supported")
    if isinstance(directory, CheckpointRoot) and overwrite:
        raise ValueError("overwrite is decided when the CheckpointRoot is opened: pass it to CheckpointRoot(...)")
    path = directory.path if isinstance(directory, CheckpointRoot) else Path(directory)
    ranks = session.ranks
    if ranks is not None:
        return _save_ranks(session, ranks, directory, path, _SaveArgs(data, keep_last, threads, progress, scheduler),
                           overwrite)
    _prepare_save(session, path)
    root = directory if isinstance(directory, CheckpointRoot) else \
        CheckpointRoot(directory, overwrite=overwrite, writer=session.store.instance_id)
    try:
        return _save(session, root, _SaveArgs(data, keep_last, threads, progress, scheduler))
    finally:
        if root is not directory:
            root.close()


class _SaveArgs(NamedTuple):
    """What save_checkpoint was asked to save besides the session, and how."""

    data: ResumableData | None
    keep_last: int
    threads: int
    progress: Callable[[str], None] | None
    scheduler: Any


def _prepare_save(session: OffloadSession, path: Path) -> None:
    """Refuse a save now (mid-step, blocks at two steps, a root inside the swap directory); wait for every update."""
    controller = session.controller
    _require_between_steps(controller, "save")
    controller.check_not_interrupted()  # never a checkpoint whose blocks are at different steps
    controller.synchronize()
    _refuse_swap_overlap(session.store, path)
    if session.store.device.type == "cuda":
        torch.cuda.synchronize(session.store.device)  # device updates are stream-ordered; copies below run on other threads


def _save(session: OffloadSession, root: CheckpointRoot, args: _SaveArgs) -> Path:
    controller = session.controller
    start = time.perf_counter()
    pending = root.begin(controller.optimizer_step)
    try:
        tensors = _write_blocks(session, session.blocks, pending, args)
        final = _publish(session, root, pending, tensors, _block_entries(controller, session.blocks), args)
    except BaseException:
        pending.abort()
        raise
    log.info("checkpoint %s saved in %.2f s", final, time.perf_counter() - start)
    return final


def _write_blocks(session: OffloadSession, blocks: list[Block], pending: PendingFiles, args: _SaveArgs) -> dict[str, dict[str, Any]]:
    """Write the state files of ``blocks`` into ``pending`` (``args.threads`` at once); returns meta.json's tensor
    entries for them."""
    jobs: list[tuple[str, Callable[[Path], FileEntry]]] = []
    tensors: dict[str, dict[str, Any]] = {}
    for block in blocks:
        for kind in STATE_KINDS:
            key = block.key(kind)
            record = session.store.record(key)
            name = f"{key}.bin"
            tensors[key] = {"file": name, "dtype": _DTYPE_NAMES[record.meta.dtype], "numel": record.meta.numel}
            jobs.append((name, _tensor_writer(session.store, record)))

    def run(job: tuple[str, Callable[[Path], FileEntry]]) -> None:
        name, write = job
        pending.add(name, write(pending.path(name)))
        if args.progress is not None:
            args.progress(name)

    with ThreadPoolExecutor(max_workers=max(1, args.threads)) as pool:
        list(pool.map(run, jobs))  # list(): re-raise the first failure
    return tensors


def _publish(session: OffloadSession, root: CheckpointRoot, pending: PendingCheckpoint, tensors: dict[str, dict[str, Any]],
             blocks: list[dict[str, Any]], args: _SaveArgs, other_ranks: list[Any] | None = None) -> Path:
    """Write meta.json (with ``tensors`` and ``blocks``, its entries), the config and the small files, and publish.
    ``other_ranks``: the RNG and data states of ranks 1.. (several processes), recorded with rank 0's as ``ranks``."""
    meta = _scalar_state(session, session.controller, tensors, blocks, args.data, pending)
    if other_ranks is not None:
        meta["ranks"] = [{"rng": rng, "data": data} for rng, data in [(meta["rng"], meta["data"]), *other_ranks]]
    meta.update(lineage=root.lineage, writer=session.store.instance_id)  # which run may prune it (checkpoint_root)
    meta.update(_optimizer_state(session, args.scheduler))
    pending.write_bytes(CONFIG_NAME, dump_config(session.config).encode())
    pending.write_bytes(META_NAME, json_bytes(meta))
    if args.progress is not None:
        args.progress(META_NAME)
    return root.publish(pending, args.keep_last, args.progress)


def _save_ranks(session: OffloadSession, ranks: Ranks, directory: str | os.PathLike[str] | CheckpointRoot, path: Path,
                args: _SaveArgs, overwrite: bool) -> Path:
    """save_checkpoint in a run of several processes, called by every rank ([Note: checkpoints of several processes]
    in runtime.checkpoint.ranks): rank 0 opens the root (``directory``: a path, or on rank 0 the CheckpointRoot it
    holds), each rank writes its blocks' files, rank 0 publishes. Three exchanges, whatever fails."""
    controller, rank = session.controller, ranks.rank
    root: CheckpointRoot | None = None
    pending: PendingCheckpoint | None = None
    error: Exception | None = None
    start = time.perf_counter()
    try:
        _prepare_save(session, path)
        if rank == 0:
            root = directory if isinstance(directory, CheckpointRoot) else \
                CheckpointRoot(directory, overwrite=overwrite, writer=session.store.instance_id)
            pending = root.begin(controller.optimizer_step)
    except Exception as exc:
        error = exc
    try:
        here = (controller.optimizer_step, os.path.realpath(path), None if pending is None else str(pending.tmp))
        statuses = exchange(ranks, "a checkpoint's start", status(ranks, error, here))
        raise_failure(ranks, "saving a checkpoint", statuses, error)
        _check_same(ranks, "saving a checkpoint", [(s.rank, s.payload[:2]) for s in statuses],
                    "every rank must save at the same step into the same directory (optimizer step, directory)")
        mine = pending if pending is not None else PendingFiles(Path(statuses[0].payload[2]))
        owned = [block for block in session.blocks if block.index not in controller.options.remote()]
        written = None
        try:
            tensors = _write_blocks(session, owned, mine, args)
            # Rank 0's RNG and data states are meta.json's own (what one process, or another number of ranks, loads).
            randoms = None if mine is pending else _random_state(args.data, mine, f".rank{rank}")
            written = (tensors, _block_entries(controller, owned), {} if mine is pending else mine.files, randoms)
        except Exception as exc:
            error = exc
        statuses = exchange(ranks, "a checkpoint's files", status(ranks, error, written))
        raise_failure(ranks, "saving a checkpoint", statuses, error)
        final = None
        if root is not None and pending is not None:  # rank 0
            try:
                final = str(_publish_gathered(session, root, pending, [s.payload for s in statuses], args))
            except Exception as exc:
                error = exc
        outcome = from_first(ranks, "the published checkpoint", status(ranks, error, final))
        raise_failure(ranks, "saving a checkpoint", [outcome], error)
    except BaseException:
        if pending is not None:
            pending.abort()  # nothing published (or already renamed: then there is nothing left to remove)
        raise
    finally:
        if root is not None and root is not directory:
            root.close()
    log.info("checkpoint %s saved by %d ranks in %.2f s", outcome.payload, ranks.world_size, time.perf_counter() - start)
    return Path(outcome.payload)


def _publish_gathered(session: OffloadSession, root: CheckpointRoot, pending: PendingCheckpoint,
                      written: list[tuple[dict[str, dict[str, Any]], list[dict[str, Any]], dict[str, FileEntry], Any]],
                      args: _SaveArgs) -> Path:
    """Rank 0: add the other ranks' files to the manifest (a file written twice is refused), and publish with every
    rank's tensor entries, step counters, RNG and data states."""
    tensors: dict[str, dict[str, Any]] = {}
    blocks: dict[int, dict[str, Any]] = {}
    for rank_tensors, rank_blocks, files, _ in written:
        tensors.update(rank_tensors)
        blocks.update((entry["index"], entry) for entry in rank_blocks)
        for name, entry in files.items():
            pending.add(name, entry)
    missing = [block.name for block in session.blocks if block.index not in blocks]
    if missing:
        raise RuntimeError(f"no rank saved the state of {', '.join(missing)}: the ranks disagree on who owns which block")
    return _publish(session, root, pending, tensors, [blocks[block.index] for block in session.blocks], args,
                    [randoms for *_, randoms in written[1:]])


def _check_same(ranks: Ranks, what: str, values: list[tuple[int, Any]], rule: str) -> None:
    """Refuse on every rank (each sees the same ``values``, by rank) when the ranks' values differ."""
    if any(value != values[0][1] for _, value in values):
        shown = ", ".join(f"rank {r}: {value}" for r, value in values)
        raise CheckpointError(f"rank {ranks.rank} of {ranks.world_size}: {what}: {rule}; {shown}")


def _require_between_steps(controller: Controller, what: str) -> None:
    if controller.phase is StepPhase.BACKWARD:
        raise RuntimeError(f"{what} a checkpoint between steps: a backward did not finish (it raised); call "
                           "optimizer.zero_grad() to drop its step first")
    if controller.step_pending:
        raise RuntimeError(f"{what} a checkpoint between steps: call optimizer.step() after the last micro-batch's "
                           f"backward first ({controller.micro} backward pass(es) since the last step)")


def _refuse_swap_overlap(store: TierStore, root: Path) -> None:
    """Checkpoints must not live in (or contain) the swap directory: that is a disposable cache."""
    if store.tiers.nvme is None:
        return
    swap = Path(os.path.realpath(store.tiers.nvme.directory.path))
    ckpt = Path(os.path.realpath(root))
    if swap == ckpt or swap.is_relative_to(ckpt) or ckpt.is_relative_to(swap):
        raise CheckpointError(f"{root}: overlaps the NVMe swap directory {swap}; swap files are a cache that the "
                              "store deletes on close. Save checkpoints to a separate directory.")


def _settle(record: Record) -> None:
    """Wait for every transfer touching this key (e.g. the write-back of the last update to NVMe), with its
    state changes; reading or overwriting a copy while one is in flight would race with it."""
    for copy in record.copies.values():
        handle = copy.handle
        if handle is not None:
            handle.wait()


def _tensor_writer(store: TierStore, record: Record) -> Callable[[Path], FileEntry]:
    """Decide (on this thread, where store state is consistent) where key's current value is read from;
    return the function that writes it to a checkpoint file (run on a writer thread)."""
    _settle(record)
    key = record.key
    if store.state(key, TierName.HOST).is_current:  # the home copy, or a fresh staging copy: no disk read
        host = store.tensor(key, TierName.HOST)
        return lambda path: write_buffer(path, _bytes_of(host))
    if store.state(key, TierName.GPU).is_current:
        gpu = store.tensor(key, TierName.GPU)  # one block at a time in host RAM, on the writer thread
        return lambda path: write_buffer(path, _bytes_of(gpu.to("cpu")))
    if TierName.NVME in store.tiers and store.state(key, TierName.NVME).is_current:
        directory = store.tiers[TierName.NVME].directory
        swap = directory.get(key)
        expected = directory.read_payload_checksum(swap, record.step)  # a stale file must not become a checkpoint

        # Copy the payload, not a hard link: swap files are rewritten in place by the next update, and the
        # checkpoint must stay a snapshot. The checksum keeps a corrupt swap file out of the checkpoint.
        def stream(path: Path) -> FileEntry:
            hasher = payload_hasher()
            entry = copy_range(swap.path, HEADER_NBYTES, record.meta.nbytes, path, observe=hasher.update)
            if hasher.intdigest() != expected:
                raise CorruptFileError(str(swap.path), f"payload checksum {hasher.intdigest():#018x} != header's "
                                       f"{expected:#018x} while checkpointing")
            return entry

        return stream
    raise RuntimeError(f"{key} has no current copy on any tier; cannot checkpoint it")


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a CPU tensor, without a copy."""
    flat = tensor.reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return flat.numpy().data


def _block_entries(controller: Controller, blocks: list[Block]) -> list[dict[str, Any]]:
    """meta.json's entries of ``blocks``: names, sizes and the parameters' AdamW step counters."""
    entries = []
    for block in blocks:
        steps = controller.param_steps(block.index)
        entries.append({"index": block.index, "name": block.name, "numel": block.numel,
                        "params": [slot.name for slot in block.slots], "param_steps": [float(s.item()) for s in steps]})
    return entries


def _scalar_state(session: OffloadSession, controller: Controller, tensors: dict[str, dict[str, Any]],
                  blocks: list[dict[str, Any]], data: ResumableData | None, pending: PendingCheckpoint) -> dict[str, Any]:
    """meta.json's content; writes the small raw files (RNG and generator states) on the way."""
    scaler = None
    if controller.scaler is not None:
        scaler = {"scale": float(controller.scaler.scale.item()), "growth_tracker": int(controller.scaler.growth_tracker.item())}
    rng, data_meta = _random_state(data, pending)
    return {
        "format": FORMAT, "version": VERSION, "byte_order": "little", "step": controller.optimizer_step,
        "created_unix_s": time.time(), "torch_version": torch.__version__, "lr": controller.hyper_source()[0].lr,
        "config": CONFIG_NAME, "blocks": blocks, "tensors": tensors, "scaler": scaler, "data": data_meta,
        "moment_dtype": controller.options.moment_dtype,  # how the moment files are stored (runtime.update.moments)
        "rng": rng,
    }


def _random_state(data: ResumableData | None, pending: PendingFiles, suffix: str = "") -> tuple[dict[str, Any], dict[str, Any] | None]:
    """This process's RNG states and ``data``'s position as meta.json records them (``rng``, ``data``); writes their
    raw files on the way, named with ``suffix`` (another rank's: ``.rank1``)."""
    pending.write_bytes(f"rng.torch_cpu{suffix}.bin", _bytes_of(torch.get_rng_state()))
    cuda_files = []
    if torch.cuda.is_available():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            cuda_files.append(f"rng.cuda{i}{suffix}.bin")
            pending.write_bytes(cuda_files[-1], _bytes_of(state))
    py_version, py_internal, py_gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state(legacy=True)
    data_meta = None
    if data is not None:
        pending.write_bytes(f"data.generator{suffix}.bin", _bytes_of(data.generator.get_state()))
        data_meta = {"position": int(data.position), "generator": f"data.generator{suffix}.bin",
                     "batch_size": getattr(data, "batch_size", None), "seq_len": getattr(data, "seq_len", None)}
    rng = {"torch_cpu": f"rng.torch_cpu{suffix}.bin", "cuda": cuda_files, "python": [py_version, list(py_internal), py_gauss],
           "numpy": [np_name, [int(k) for k in np_keys], int(np_pos), int(np_has_gauss), float(np_gauss)]}
    return rng, data_meta


def _optimizer_state(session: OffloadSession, scheduler: Any) -> dict[str, Any]:
    """The optimizer's param_groups hyper-parameters and the LR scheduler's state, as JSON."""
    groups = [{k: v for k, v in group.items() if k != "params"} for group in session.optimizer.param_groups]
    out: dict[str, Any] = {"param_groups": groups}
    if scheduler is not None:
        out["scheduler"] = scheduler.state_dict()
    try:
        json_bytes(out)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"the optimizer's param_groups or the scheduler's state_dict() is not plain data ({exc}); "
                         "checkpoints store them as JSON") from exc
    return out


def _restore_optimizer_state(session: OffloadSession, meta: dict[str, Any], scheduler: Any) -> None:
    """The checkpoint's param_groups hyper-parameters and the scheduler's state (both checked by _check_compatible)."""
    groups = meta.get("param_groups")
    if groups is not None:
        for group, saved in zip(session.optimizer.param_groups, groups, strict=True):  # as many: _check_compatible
            group.update({k: tuple(v) if k == "betas" else v for k, v in saved.items()})
    if scheduler is not None:
        scheduler.load_state_dict(meta["scheduler"])


# ---- load ------------------------------------------------------------------------------------------
def load_checkpoint(session: OffloadSession, directory: str | os.PathLike[str] | CheckpointRoot,
                    data: ResumableData | None = None, *, scheduler: Any = None) -> int:
    """Restore a checkpoint into ``session`` (and ``data``); returns the optimizer step it was taken after.

    ``directory`` is a checkpoint root (its ``latest`` is loaded; a :class:`CheckpointRoot` too) or one
    ``step-NNNNNN`` directory. Before anything is restored: the listing (no unlisted files, no links, sizes)
    and meta.json's values are checked, the checkpoint must fit the session (same blocks and parameters, as
    many param_groups, a scheduler state when ``scheduler`` is given), and the small files are read and
    hashed; a refusal there leaves the session as it was. Tensor files are hashed as they stream into the
    tiers; a mismatch there (a file corrupted, or replaced since the listing was checked) is refused naming
    the file. A load cut short there (that, Ctrl-C, a disk error) leaves the session part-loaded: it then
    refuses to train, save or hand out its state until a load completes (into it: the same call with a good
    checkpoint), or it is closed. To keep a trained session safe from a corrupt checkpoint, call
    ``verify_checkpoint`` first (it reads every file once more). A damaged checkpoint raises
    :class:`DamagedCheckpointError`. ``scheduler``: the LR scheduler to restore (saved with
    ``save_checkpoint(..., scheduler=)``); the optimizer's param_groups hyper-parameters are restored either
    way, over the config's (as torch's ``optimizer.load_state_dict`` does). The tier layout, NVMe path and
    device may differ from the saving run's. Call between steps.

    Several processes: call it on every rank with the same arguments; each rank checks the checkpoint and loads the
    blocks it owns, whatever number of ranks (or one process) saved it. A refusal or failure on any rank raises on
    every rank (one cut short part-way leaves every rank refusing to train until a load completes)."""
    remote = session.controller.options.remote()
    if session.ranks is not None:
        return _load_ranks(session, session.ranks, directory, data, scheduler, remote)
    return _restore(session, _prepare_load(session, directory, scheduler, remote), data, scheduler, remote)


class _Checked(NamedTuple):
    """A checkpoint checked for a load (listing, meta.json, fit) and its small files, read and hashed."""

    path: Path
    files: dict[str, FileEntry]
    meta: dict[str, Any]
    small: dict[str, bytes]
    rng: dict[str, Any]  # the RNG states and data position this process restores (meta.json's entries)
    data: dict[str, Any] | None


def _prepare_load(session: OffloadSession, directory: str | os.PathLike[str] | CheckpointRoot, scheduler: Any,
                  remote: frozenset[int]) -> _Checked:
    """Everything load_checkpoint checks before it changes anything; ``remote``: the blocks another rank loads."""
    path = resolve_checkpoint(directory.path if isinstance(directory, CheckpointRoot) else directory)
    with _damaged():
        files = check_listing(path)
        meta = read_meta(path, files)
    _check_compatible(session, meta=meta, path=path, files=files, scheduler=scheduler, remote=remote)
    controller = session.controller
    rng, data = _random_to_restore(meta, controller.options.ranks, path)
    with _damaged():
        small = _read_small_files(rng, data, path, files)
    _require_between_steps(controller, "load")
    controller.synchronize()
    return _Checked(path, files, meta, small, rng, data)


def _random_to_restore(meta: dict[str, Any], ranks: Ranks | None, path: Path) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The RNG states and data position this process restores: its own rank's when the checkpoint was saved at as many
    ranks, else rank 0's (or the one process's), said once."""
    saved = meta.get("ranks")
    world = 1 if ranks is None else ranks.world_size
    if saved is not None and len(saved) == world:
        entry = saved[0 if ranks is None else ranks.rank]
        return entry["rng"], entry.get("data")
    if (saved is not None or ranks is not None) and (ranks is None or ranks.rank == 0):
        log.warning("%s was saved by %s, this run has %s: %s restores %s RNG states and data position", path,
                    f"{len(saved)} ranks" if saved is not None else "one process",
                    f"{world} ranks" if ranks is not None else "one process",
                    "every rank" if ranks is not None else "it", "rank 0's" if saved is not None else "the one process's")
    return meta["rng"], meta.get("data")


def _load_ranks(session: OffloadSession, ranks: Ranks, directory: str | os.PathLike[str] | CheckpointRoot,
                data: ResumableData | None, scheduler: Any, remote: frozenset[int]) -> int:
    """load_checkpoint in a run of several processes, called by every rank ([Note: checkpoints of several processes]
    in runtime.checkpoint.ranks): every rank checks the checkpoint, the ranks agree, each loads the blocks it owns,
    the ranks agree again (a rank that loaded while another failed refuses to train too)."""
    checked: _Checked | None = None
    error: Exception | None = None
    try:
        checked = _prepare_load(session, directory, scheduler, remote)
    except Exception as exc:
        error = exc
    statuses = exchange(ranks, "the checkpoint to load", status(ranks, error, None if checked is None else str(checked.path)))
    raise_failure(ranks, "loading a checkpoint", statuses, error)
    _check_same(ranks, "loading a checkpoint", [(s.rank, s.payload) for s in statuses],
                "every rank must load the same checkpoint")
    assert checked is not None  # else raise_failure raised
    step = 0
    try:
        step = _restore(session, checked, data, scheduler, remote)
    except Exception as exc:
        error = exc
    statuses = exchange(ranks, "the load", status(ranks, error))
    bad = failed(statuses)
    if bad and error is None:  # this rank loaded its blocks, another did not: the run holds a mix of two states
        cause = RuntimeError(f"rank {bad[0].rank}'s part of the load failed")
        _mark_cut_short(session.controller, checked.path, cause, "this rank's part loaded, another's not")
        raise_remote(ranks, "loading a checkpoint", bad, "this rank loaded its blocks and refuses to train, save or hand "
                     "out its state too until a load completes")
    raise_failure(ranks, "loading a checkpoint", statuses, error)
    return step


def _restore(session: OffloadSession, checked: _Checked, data: ResumableData | None, scheduler: Any,
             remote: frozenset[int]) -> int:
    """Load a checked checkpoint into the session: the tensors of the blocks this process owns (not ``remote``), every
    block's step counters and the rest; returns its step."""
    controller = session.controller
    path, files, meta, small = checked.path, checked.files, checked.meta, checked.small
    _log_config_changes(session, small.get(CONFIG_NAME), path, saved_groups=meta.get("param_groups"))
    step = int(meta["step"])
    _release_fetched_weights(controller)  # only drops cached copies: nothing is lost if it raises
    loaded = 0
    saved, ours = saved_moment_dtype(meta), controller.options.moment_dtype
    if saved != ours:
        # Said once: decoding into fp32 keeps every value; encoding into bf16 or int8 rounds (or quantizes) them.
        log.info("%s holds %s Adam moments, this run stores them as %s (optimizer.moment_dtype): each is decoded and "
                 "encoded as it is loaded (%s)", path, saved, ours,
                 "exact" if ours == "fp32" else f"approximate: the saved values are rounded to {ours}")
    owned = [block for block in session.blocks if block.index not in remote]
    try:
        for block in owned:
            for kind in STATE_KINDS:
                entry = meta["tensors"][block.key(kind)]
                after = (lambda master, b=block: refresh_compute_weights(controller, b, master, step)) if kind == "master" else None
                file, listed = path / entry["file"], files[entry["file"]]
                fill = _file_filler(file, listed)
                if kind in MOMENT_KINDS and saved != ours:
                    fill = _converting_filler(file, listed, saved, ours, kind, [slot.numel for slot in block.slots])
                _load_tensor(session.store, block.key(kind), fill, step, after)
                loaded += 1
        _restore_counters(controller, session.blocks, meta["blocks"], step)
        _restore_scaler(controller, meta.get("scaler"), path)
        _restore_optimizer_state(session, meta, scheduler)
        _restore_rng(checked.rng, path, small)
        if data is not None:
            _restore_data(data, checked.data, path, small)
    except BaseException as exc:
        # Some tensors are the checkpoint's, the rest the session's: training on, or saving, would make a
        # checkpoint of neither. The session refuses both until a load completes.
        effect = _mark_cut_short(controller, path, exc, f"{loaded} of {len(owned) * len(STATE_KINDS)} tensors loaded")
        if isinstance(exc, CheckpointError):  # a tensor file failed its hash as it was read
            raise DamagedCheckpointError(f"{exc}; {effect}") from exc
        if isinstance(exc, KeyboardInterrupt):
            raise KeyboardInterrupt(f"Ctrl-C while loading {path}: {effect}") from exc
        if isinstance(exc, Exception):  # the checkpoint verified, so this is the machine (disk, memory budget)
            raise RuntimeError(f"loading {path} failed part-way ({exc}): {effect}") from exc
        raise  # SIGTERM (Terminated) and the like: the process is ending, the session is marked
    controller.clear_interrupted()  # every block is at the loaded step again
    log.info("resumed from %s (step %d)", path, step)
    return step


@contextlib.contextmanager
def _damaged() -> Iterator[None]:
    """A CheckpointError raised inside is about the files themselves: re-raised as DamagedCheckpointError."""
    try:
        yield
    except DamagedCheckpointError:
        raise
    except CheckpointError as exc:
        raise DamagedCheckpointError(str(exc)) from exc


@defers_interrupts  # a second Ctrl-C must not land between the failure and the mark
def _mark_cut_short(controller: Controller, path: Path, exc: BaseException, progress: str) -> str:
    """Make the session refuse to train, save or hand out its state until a load completes; returns what that
    means for the user, to add to the error."""
    effect = (f"this session now holds a mix of its own state and {path}'s ({progress}) and refuses to train, save "
              "or hand out its state: load a good checkpoint (runtime.checkpoint.state.load_checkpoint, into this "
              "session), or close the session")
    cause = "Ctrl-C" if isinstance(exc, KeyboardInterrupt) else (str(exc) or type(exc).__name__)
    why = f"a checkpoint load was cut short ({cause}): {effect}"
    if controller.interrupted is not None:
        why += f" (before the load: {controller.interrupted})"
    try:
        controller.discard_pending(broken=why)  # no step is pending: this only marks the blocks as at different steps
    except Exception as cleanup:  # the mark is set before anything there can fail
        log.warning("after the load of %s was cut short, cleaning up failed too: %r", path, cleanup)
    return effect


def _restore_counters(controller: Controller, blocks: list[Block], saved_blocks: list[dict[str, Any]], step: int) -> None:
    """Per-parameter AdamW step counters (into the worker's and, for device-updated blocks, the device's),
    the committed optimizer step, and every block's 'updated to' mark, so the next forward waits for nothing."""
    for block, saved in zip(blocks, saved_blocks, strict=True):  # as many, with a counter per slot: _check_compatible
        targets = [controller.worker.param_steps[block.index]]
        if block.index in controller.gpu_param_steps:
            targets.append(controller.gpu_param_steps[block.index])
        for counters in targets:
            for counter, value in zip(counters, saved["param_steps"], strict=True):
                counter.fill_(float(value))
    controller.optimizer_step = step
    controller.worker.set_updated_step(step)


def _read_small_files(rng: dict[str, Any], data: dict[str, Any] | None, path: Path, files: dict[str, FileEntry]) -> dict[str, bytes]:
    """The config and the raw RNG / generator states to restore (``rng``, ``data``: their meta.json entries), read and
    hashed before anything is restored."""
    names = [rng.get("torch_cpu"), *rng.get("cuda", [])] + ([data.get("generator")] if data else [])
    for name in names:
        if name not in files:
            raise CheckpointError(f"{path / str(name)}: named by meta.json but not in the manifest")
    names += [CONFIG_NAME] if CONFIG_NAME in files else []
    return {name: read_verified(path / name, files[name]) for name in names}


def _check_compatible(session: OffloadSession, *, meta: dict[str, Any], path: Path, files: dict[str, FileEntry],
                      scheduler: Any, remote: frozenset[int] = frozenset()) -> None:
    """The checkpoint holds this model's state (same blocks, parameters and sizes) and what the optimizer and
    ``scheduler`` restore, and every file it refers to is in the manifest with the size its dtype and numel
    imply (for the blocks another rank loads, ``remote``, that rank checks the sizes: this one keeps no record of
    them). Runs before anything is restored: a refusal here leaves the session as it was."""
    meta_path = path / META_NAME
    groups, num_groups = meta.get("param_groups"), len(session.optimizer.param_groups)
    if groups is not None and len(groups) != num_groups:
        raise CheckpointError(f"{meta_path}: pass the same param_groups to offload() as the saving run: it had "
                              f"{len(groups)} parameter group(s), this optimizer has {num_groups}")
    if scheduler is not None and meta.get("scheduler") is None:
        raise CheckpointError(f"{path} holds no LR scheduler state (it was saved without save_checkpoint(..., "
                              "scheduler=)): load it without scheduler= (the param_groups' lr is restored either way) "
                              "and step the scheduler yourself, or resume from a checkpoint saved with scheduler=")
    saved_blocks = meta.get("blocks", [])
    if len(saved_blocks) != len(session.blocks):
        raise CheckpointError(f"{meta_path}: {len(saved_blocks)} blocks, this model has {len(session.blocks)}; "
                              "resume needs the same model and blocks settings")
    for block, saved in zip(session.blocks, saved_blocks, strict=True):
        ours = (block.name, block.numel, [s.name for s in block.slots])
        theirs = (saved.get("name"), saved.get("numel"), saved.get("params"))
        if ours != theirs:
            raise CheckpointError(f"{meta_path}: block {block.index} is {theirs[0]} ({theirs[1]} elements) in the "
                                  f"checkpoint but {ours[0]} ({ours[1]} elements) here, or its parameters differ")
        if len(saved.get("param_steps", [])) != len(block.slots):
            raise CheckpointError(f"{meta_path}: block {block.index} has {len(saved.get('param_steps', []))} step counters, "
                                  f"expected {len(block.slots)}")
        for kind in STATE_KINDS:
            key = block.key(kind)
            entry = meta.get("tensors", {}).get(key)
            if entry is None:
                raise CheckpointError(f"{meta_path}: no entry for {key}")
            name = entry.get("file")
            if name not in files:
                raise CheckpointError(f"{path / str(name)}: named by meta.json for {key} but not in the manifest")
            if block.index in remote:
                continue
            # A moment is stored as the saving run's moment_dtype says (converted at load when it is not this run's).
            dtype, numel = saved_storage(session, meta, block, kind)
            if _DTYPES.get(entry.get("dtype")) != dtype or entry.get("numel") != numel:
                raise CheckpointError(f"{path / name}: {entry.get('dtype')} x{entry.get('numel')}, {key} stored as "
                                      f"{saved_moment_dtype(meta)} moments is {_DTYPE_NAMES.get(dtype)} x{numel}"
                                      if kind in MOMENT_KINDS else f"{path / name}: {entry.get('dtype')} x"
                                      f"{entry.get('numel')}, this session's {key} is {_DTYPE_NAMES.get(dtype)} x{numel}")
            if files[name].nbytes != numel * dtype.itemsize:
                raise CheckpointError(f"{path / name}: {files[name].nbytes:,} bytes, {key} needs {numel * dtype.itemsize:,}")


def saved_storage(session: OffloadSession, meta: dict[str, Any], block: Block, kind: str) -> tuple[torch.dtype, int]:
    """The dtype and numel of ``kind``'s file of ``block`` in a checkpoint (``meta``): a moment's as the saving run's
    ``moment_dtype`` stores it, anything else as this session's record."""
    if kind in MOMENT_KINDS:
        return moment_storage(saved_moment_dtype(meta), [slot.numel for slot in block.slots])
    record = session.store.record(block.key(kind))
    return record.meta.dtype, record.meta.numel


# Config keys whose values the optimizer's param_groups carry: a checkpoint's groups override them on load.
_GROUP_KEYS = ("lr", "betas", "eps", "weight_decay")


def _log_config_changes(session: OffloadSession, text: bytes | None, path: Path, *,
                        saved_groups: list[dict[str, Any]] | None) -> None:
    """Say which settings differ from the saving run's (a different layout is fine; other changes are the
    user's choice but break exact resume). ``text``: the saved config.yaml, already verified. A changed
    optimizer hyper-parameter that ``saved_groups`` (the checkpoint's param_groups) carry is not used: the
    checkpoint's value is restored, as torch's ``optimizer.load_state_dict`` does; the warning says so."""
    try:
        if text is None:
            raise OSError("not in the checkpoint")
        saved = yaml.safe_load(text.decode())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        log.warning("%s: unreadable (%s); not comparing configs", path / CONFIG_NAME, exc)
        return
    now = yaml.safe_load(dump_config(session.config))
    for dotted, old, new in _diff(saved, now):
        section, _, key = dotted.partition(".")
        if section == "optimizer" and key in _GROUP_KEYS and saved_groups is not None:
            restored = sorted({repr(group.get(key)) for group in saved_groups})
            scheduler = " (with an LR scheduler, its base_lrs: it sets lr at each step)" if key == "lr" else ""
            log.warning("resuming with %s %r in the config where the checkpoint's run had %r: %r is not used; the "
                        "checkpoint's param_groups are restored with %s %s, as torch's optimizer.load_state_dict "
                        "does. To train with another %s, set group[%r] in optimizer.param_groups after loading%s",
                        dotted, new, old, new, key, " / ".join(restored), key, key, scheduler)
            continue
        exact = section in ("tiers", "placement", "prefetch", "train", "profile")
        (log.info if exact else log.warning)("resuming with %s changed: %r -> %r", dotted, old, new)


def _diff(old: Any, new: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in sorted(set(old) | set(new), key=str):
            out += _diff(old.get(key), new.get(key), f"{prefix}{key}.")
        return out
    return [] if old == new else [(prefix.rstrip("."), old, new)]


def _release_fetched_weights(controller: Controller) -> None:
    """Drop compute weights fetched before the load: they hold the old values. Non-resident blocks are
    fetched from the loaded master (or weights copy) on their next use. Resident blocks are refilled by the
    load; first every refresh still reading a host master (issued or held) has to finish."""
    weights = controller.weights
    weights.release_refreshes()
    if controller.device.type == "cuda":
        # Refreshes of resident weights still copy from the host masters about to be overwritten.
        torch.cuda.synchronize(controller.device)
    for index, state in enumerate(weights.states):
        if weights.source is WeightSource.RESIDENT or index in controller.gpu_updated:
            weights.wait_refresh(index)  # refreshed from the loaded master below, after any refresh in flight
            continue
        if state.users:
            raise RuntimeError(f"block {index}'s weights are in use by a forward; load a checkpoint between steps")
        weights.release(index)


def _file_filler(file: Path, entry: FileEntry) -> Callable[[torch.Tensor], None]:
    """Fills a CPU tensor with one tensor file's bytes as they are, hashing them on the way (``entry``: its size and
    sha256)."""
    return lambda target: read_verified_into(file, _bytes_of(target), entry)


def _converting_filler(file: Path, entry: FileEntry, saved: str, ours: str, kind: str,
                       sizes: list[int]) -> Callable[[torch.Tensor], None]:
    """Fills a CPU tensor, stored as ``ours`` moments, from a moment file stored as ``saved`` (hashed as it is read):
    decoded to fp32, then encoded."""
    def fill(target: torch.Tensor) -> None:
        dtype, numel = moment_storage(saved, sizes)
        staging = torch.empty(numel, dtype=dtype)
        read_verified_into(file, _bytes_of(staging), entry)
        encode_moment(decode_moment(staging, saved, kind, sizes), ours, kind, sizes, target)

    return fill


def _load_tensor(store: TierStore, key: str, fill: Callable[[torch.Tensor], None], step: int,
                 after: Callable[[torch.Tensor], None] | None) -> None:
    """Write one tensor into key's home in this session through ``fill`` (which writes a CPU tensor of the key's
    dtype and numel: ``_file_filler``, ``_converting_filler``); ``after`` sees the loaded values while a copy of them
    is still in memory (the master's, to refresh the compute weights)."""
    record = store.record(key)
    _settle(record)
    home = record.home
    if home is TierName.GPU:
        staging = torch.empty(record.meta.numel, dtype=record.meta.dtype)
        fill(staging)
        target = store.tensor(key, TierName.GPU)
        target.copy_(staging)
        store.mark_dirty(key, TierName.GPU, step=step)  # the home copy: clean; any cached copy is stale now
    elif home is TierName.HOST:
        target = store.tensor(key, TierName.HOST)
        fill(target)  # straight into the (pinned) home bytes
        store.mark_dirty(key, TierName.HOST, step=step)
    else:
        # No public way to write a swap file except through a host copy: stage, overwrite, write back.
        store.fetch(key, TierName.HOST).wait()
        target = store.tensor(key, TierName.HOST)
        try:
            fill(target)
        except BaseException:
            store.release(key, TierName.HOST)  # partly the file's bytes now, yet marked clean: drop; the swap file is intact
            raise
        store.mark_dirty(key, TierName.HOST, step=step)  # host now newer than the swap file
    if after is not None:
        after(target)
    if home is TierName.NVME:
        store.evict(key, TierName.HOST).wait()  # written back home, then the staging copy released


def _restore_scaler(controller: Controller, saved: dict[str, Any] | None, path: Path) -> None:
    scaler = controller.scaler
    if scaler is None or saved is None:
        if scaler is not None or saved is not None:
            log.warning("%s: fp16 loss scaling %s in the checkpoint but %s now; the scale starts afresh",
                        path, "on" if saved else "off", "on" if scaler else "off")
        return
    scaler.scale.fill_(float(saved["scale"]))
    scaler.growth_tracker.fill_(int(saved["growth_tracker"]))


def _raw_tensor(small: dict[str, bytes], name: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(small[name]), dtype=torch.uint8)


def _restore_rng(rng: dict[str, Any], path: Path, small: dict[str, bytes]) -> None:
    torch.set_rng_state(_raw_tensor(small, rng["torch_cpu"]))
    cuda_files = rng.get("cuda", [])
    if torch.cuda.is_available() and cuda_files:
        if len(cuda_files) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all([_raw_tensor(small, name) for name in cuda_files])
        else:
            log.warning("%s: %d CUDA RNG states saved, %d devices here; CUDA RNG not restored", path, len(cuda_files),
                        torch.cuda.device_count())
    elif cuda_files or torch.cuda.is_available():
        log.warning("%s: CUDA RNG state %s; not restored", path, "saved without CUDA here" if cuda_files else "not in the checkpoint")
    version, internal, gauss = rng["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = rng["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


def _restore_data(data: ResumableData, saved: dict[str, Any] | None, path: Path, small: dict[str, bytes]) -> None:
    if saved is None:
        log.warning("%s: no data position in the checkpoint; the data stream starts afresh", path)
        return
    for attr in ("batch_size", "seq_len"):
        if saved.get(attr) is not None and getattr(data, attr, saved[attr]) != saved[attr]:
            log.warning("%s: data %s was %s, now %s; batches will differ from the original run", path, attr, saved[attr],
                        getattr(data, attr))
    data.generator.set_state(_raw_tensor(small, saved["generator"]))
    data.position = int(saved["position"])


# ---- training-loop helpers and benchmark ---------------------------------------------------------
def save_due(step: int, total_steps: int, save_every: int) -> bool:
    """True when ``tierstore train`` saves after ``step``: every ``save_every`` steps, and at the end."""
    return step == total_steps or (save_every > 0 and step % save_every == 0)


def resume_training(session: OffloadSession, directory: str | os.PathLike[str] | CheckpointRoot,
                    data: ResumableData | None = None, *, scheduler: Any = None) -> int:
    """Load the latest checkpoint in ``directory`` if there is one; returns its step (0: start afresh).

    A damaged latest checkpoint is refused, never skipped for an older one: the DamagedCheckpointError lists
    the intact earlier checkpoints in ``directory`` and the command that resumes from one. When the damage was
    found part-way through the load, the session refuses to train until a load completes: call this again
    once ``latest`` names a good checkpoint."""
    path = Path(directory.path if isinstance(directory, CheckpointRoot) else directory)
    found = find_checkpoint(path)
    if found is None:
        log.warning("no checkpoint in %s yet; starting from step 0", path)
        return 0
    try:
        if not (found / MANIFEST_NAME).exists():  # else load_checkpoint would look for a root inside it
            raise DamagedCheckpointError(f"{found / MANIFEST_NAME}: missing (an incomplete or damaged checkpoint)")
        return load_checkpoint(session, found, data, scheduler=scheduler)
    except DamagedCheckpointError as exc:
        if found == path:  # directory is one checkpoint, not a root: there is no other to point at
            raise
        # The file's own message: what the load said about this session is answered by the way out below.
        cause = exc.__cause__ if isinstance(exc.__cause__, CheckpointError) else exc
        raise DamagedCheckpointError(f"{cause}. {_way_out(path, found)}") from exc


def _way_out(root: Path, damaged: Path) -> str:
    """The intact checkpoints before ``damaged`` in ``root`` (listing, sizes and meta.json checked; the tensor
    files are hashed when they load), and the commands that resume from the newest of them."""
    step = parse_step_dir(damaged.name)
    intact = []
    for earlier_step, earlier in reversed(list_checkpoints(root)):
        if step is None or earlier_step >= step:
            continue
        try:
            read_meta(earlier, check_listing(earlier))
        except (CheckpointError, OSError):
            continue
        intact.append(earlier.name)
    if not intact:
        return (f"The latest checkpoint in {root}, {damaged.name}, is damaged and there is no intact earlier one: "
                f"restore {damaged} from a copy, or start afresh in another --checkpoint-dir (train.checkpoint_dir)")
    aside = root / f"damaged-{damaged.name}"  # inside the root: the same file system, and not a step-* name
    command = (f"mv {shlex.quote(str(damaged))} {shlex.quote(str(aside))} && "
               f"echo {intact[0]} > {shlex.quote(str(root / LATEST_NAME))}")
    return (f"The latest checkpoint in {root}, {damaged.name}, is damaged; it is not skipped on its own. Intact "
            f"earlier checkpoints there, newest first: {', '.join(intact)}. To resume from {intact[0]}, move the "
            f"damaged one aside and point latest at it: `{command}`, then resume again (tierstore train --resume; "
            "resume_training in Python)")


def bench_checkpoint(session: OffloadSession, directory: str | os.PathLike[str], data: ResumableData | None = None,
                     threads: int = 4) -> dict[str, Any]:
    """Time one save, one verification and one load (which verifies again) of the session's state.

    Returns seconds and bytes: ``save_s``, ``verify_s``, ``load_s``, ``nbytes`` (all files),
    ``tensor_nbytes`` (master + moments) and GB/s of each, to compare against the disk's bandwidth. Reads
    may be served from the page cache; drop caches between save and load to time the disk itself."""
    start = time.perf_counter()
    path = save_checkpoint(session, directory, data, keep_last=1, threads=threads)
    save_s = time.perf_counter() - start
    start = time.perf_counter()
    files = verify_checkpoint(path, threads=threads)
    verify_s = time.perf_counter() - start
    start = time.perf_counter()
    load_checkpoint(session, path, data)
    load_s = time.perf_counter() - start
    nbytes = sum(entry.nbytes for entry in files.values())
    tensor_nbytes = sum(entry.nbytes for name, entry in files.items() if name.startswith("block") and name.endswith(".bin"))
    return {"path": str(path), "nbytes": nbytes, "tensor_nbytes": tensor_nbytes, "save_s": save_s, "verify_s": verify_s,
            "load_s": load_s, "save_GBps": nbytes / save_s / 1e9, "verify_GBps": nbytes / verify_s / 1e9,
            "load_GBps": nbytes / load_s / 1e9}
