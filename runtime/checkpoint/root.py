"""The checkpoint root a run writes into: locked while the run writes, refused when it holds another run's
work, and the record of which checkpoints this run may replace or delete.

Rules (what they protect is someone else's work; ``runtime.checkpoint.files`` draws the directory layout):

- One writer at a time. An flock on ``root/.tierstore.lock`` is held from :class:`CheckpointRoot` to
  ``close`` (which removes the file); a second run on the same root is refused, naming the holder. The kernel drops the lock when its holder
  dies, so a killed run never leaves the root locked. (On NFS, Linux turns flock into a POSIX lock that
  the server arbitrates, so two hosts exclude each other too.)
- A save in progress is judged by that lock, never by a pid: whoever holds the lock is the only writer,
  so every scratch directory (``.tmp-*``, ``.del-*``) found by the holder belongs to a dead save. They are
  partial and never a checkpoint, so they are removed; an ``.old-step-N-*`` whose ``step-N`` is missing
  (a save killed while replacing step N) is renamed back instead.
- A root that already holds something is refused, unless the run resumes from it (``resume``) or the user
  says ``overwrite``. The message says how to do either, or to choose another directory.
- Cleanup (``keep_last`` pruning, and replacing a step saved again) touches only checkpoints this run
  owns: the ones it wrote; with ``resume``, also the lineage it resumed (checkpoints at or before the one
  loaded, and newer ones written by the same lineage -- left by a save killed before ``latest`` moved);
  with ``overwrite``, everything in the root. A newer checkpoint of another lineage is refused at resume.

Every checkpoint's ``meta.json`` records its ``lineage`` (a run and the runs resumed from it) and its
``writer`` (the session that saved it). ``save_checkpoint`` given a plain path opens a root for that one
save, owning what the same session saved before (:class:`CheckpointRoot` with ``writer``).
"""

from __future__ import annotations

import logging
import os
import re
import uuid
from collections.abc import Callable
from pathlib import Path

from runtime.checkpoint.files import (
    LATEST_NAME,
    MANIFEST_NAME,
    META_NAME,
    CheckpointError,
    PendingCheckpoint,
    find_checkpoint,
    fsync_dir,
    list_checkpoints,
    parse_json,
    parse_step_dir,
    read_latest,
    read_small,
    remove_path,
    step_dir_name,
)
from tierstore import lock_file, shared_directory_problem, unlink_lock_file

log = logging.getLogger(__name__)

LOCK_NAME = ".tierstore.lock"  # the swap directory's lock has the same name; the two never overlap
_SCRATCH_DIR = re.compile(r"^\.(tmp|old|del)-(step-\d{6,})-(\d+)$")
_HOW_TO_CONTINUE = ("Resume from it (`tierstore train --resume`; CheckpointRoot(..., resume=True) in Python), choose "
                    "another directory (--checkpoint-dir / train.checkpoint_dir), or pass --overwrite (overwrite=True) "
                    "to let this run replace and prune what is there")


class CheckpointRoot:
    """A locked checkpoint root and the checkpoints in it that this run may replace or delete.

    ``resume``: this run continues the latest checkpoint's lineage. ``overwrite``: every checkpoint already
    there becomes this run's to replace or prune. ``writer`` (used by ``save_checkpoint`` given a path):
    a root whose latest checkpoint this writer saved is accepted, owning that writer's checkpoints.
    Close it (or use it as a context manager) to release the lock."""

    def __init__(self, path: str | os.PathLike[str], *, resume: bool = False, overwrite: bool = False,
                 writer: str | None = None):
        self.path = Path(path)
        self._owned: set[str] = set()
        self._lock_fd: int | None = None
        if os.path.lexists(self.path) and not self.path.is_dir():
            raise CheckpointError(f"{self.path} is not a directory; --checkpoint-dir (train.checkpoint_dir) names the "
                                  "directory that holds the checkpoints")
        if os.path.lexists(self.path / MANIFEST_NAME):  # a lock file in it would make it fail verification
            raise CheckpointError(f"{self.path} is one checkpoint, not a checkpoint root; pass its parent "
                                  f"{self.path.parent} as --checkpoint-dir (train.checkpoint_dir)")
        try:
            _make_private_dirs(self.path)
        except (FileNotFoundError, NotADirectoryError) as exc:  # permissions and read-only ones: runtime.core.user_errors
            raise CheckpointError(f"checkpoint directory {self.path} cannot be made ({exc.strerror or exc}): give "
                                  "--checkpoint-dir (train.checkpoint_dir) a directory this user can create") from exc
        problem = shared_directory_problem(os.stat(self.path))  # as for swap directories: a sticky bit stops no link
        if problem is not None:
            raise CheckpointError(f"checkpoint directory {self.path} {problem}, so another user could plant links or "
                                  "replace checkpoint files there. Give --checkpoint-dir (train.checkpoint_dir) a private "
                                  f"directory: a new subdirectory (tierstore makes it 0700), e.g. {self.path / 'mine'}")
        self._lock_fd = lock_file(self.path / LOCK_NAME, f"checkpoint directory {self.path}",
                                  "Give each run its own --checkpoint-dir (train.checkpoint_dir).")
        try:
            self._recover_scratch()
            self.lineage = self._claim(resume, overwrite, writer)
        except BaseException:
            self.close()
            raise

    # ---- claiming the root ---------------------------------------------------------------------------
    def _claim(self, resume: bool, overwrite: bool, writer: str | None) -> str:
        """Decide what this run owns; returns its lineage. Refuses a root holding another run's work."""
        found = list_checkpoints(self.path)
        if resume or overwrite:
            lineage = self._claim_lineage(found, refuse_foreign=not overwrite) if resume else uuid.uuid4().hex
            if overwrite and found:
                log.warning("checkpoint directory %s: --overwrite: this run may replace and prune its %d checkpoint(s)",
                            self.path, len(found))
                self._owned = {p.name for _, p in found}
            return lineage
        if writer is not None:  # one save of a session: accepted where this session's saves are the latest
            identities = {p.name: _identity(p) for _, p in found}
            mine = {name: lineage for name, (who, lineage) in identities.items() if who == writer}
            latest = read_latest(self.path)
            if (latest in mine) or (latest is None and mine):
                self._owned = set(mine)
                return mine[latest if latest in mine else max(mine)] or writer
        others = sorted(name for name in os.listdir(self.path) if name != LOCK_NAME)
        if others:
            shown = ", ".join(others[:4]) + (f" and {len(others) - 4} more" if len(others) > 4 else "")
            raise CheckpointError(f"checkpoint directory {self.path} is not empty ({shown}): it holds another run's "
                                  f"checkpoints or files, which a new run would mix with or prune. {_HOW_TO_CONTINUE}.")
        return writer or uuid.uuid4().hex

    def _claim_lineage(self, found: list[tuple[int, Path]], refuse_foreign: bool) -> str:
        """Resume: own the checkpoint resumed from and the others of its lineage, before or after it; a newer
        one of another lineage is refused when ``refuse_foreign``, an older one is left alone (never pruned: it
        was copied in from another run). Checkpoints that record no lineage are the resumed one's when it records
        none either and they are not newer. Returns the lineage resumed."""
        if not found:
            return uuid.uuid4().hex
        resumed = find_checkpoint(self.path)
        assert resumed is not None  # found is not empty, so the newest complete one at least
        resumed_step = parse_step_dir(resumed.name)
        # A step-* directory: ``latest`` names only those, and a root that is itself a checkpoint is refused above.
        assert resumed_step is not None
        lineage = _identity(resumed)[1]
        foreign = []
        for step, path in found:
            theirs = _identity(path)[1]
            if path.name == resumed.name or (theirs == lineage and (lineage is not None or step <= resumed_step)):
                self._owned.add(path.name)
            elif step > resumed_step:
                foreign.append(path.name)
            else:
                log.info("checkpoint directory %s: %s is of another run; this run keeps it (keep_last prunes only "
                         "its own)", self.path, path.name)
        if foreign and refuse_foreign:
            raise CheckpointError(f"checkpoint directory {self.path}: {', '.join(foreign)} is newer than the checkpoint "
                                  f"to resume ({resumed.name}) and was not written by its run; resuming would replace "
                                  "it. Move it away, or pass --overwrite (overwrite=True) to let this run replace it.")
        return lineage or uuid.uuid4().hex

    def _recover_scratch(self) -> None:
        """We hold the lock, so every scratch entry is a dead save's: restore or remove it (see the module doc)."""
        for name in sorted(os.listdir(self.path)):
            path = self.path / name
            match = _SCRATCH_DIR.match(name)
            if name == LATEST_NAME + ".tmp":
                remove_path(path)
            elif match is not None and match.group(1) == "old" and not os.path.lexists(self.path / match.group(2)):
                log.warning("restoring %s from %s: a save that was replacing it was interrupted", match.group(2), name)
                os.rename(path, self.path / match.group(2))
                fsync_dir(self.path)
            elif match is not None:
                log.info("removing %s, left by an interrupted save", path)
                remove_path(path)

    # ---- saving --------------------------------------------------------------------------------------
    def owns(self, name: str) -> bool:
        """True when checkpoint directory ``name`` is this run's to replace or delete."""
        return name in self._owned

    def begin(self, step: int) -> PendingCheckpoint:
        """Start writing the checkpoint of ``step``; refused before anything is written when a checkpoint of
        another run already has that name."""
        self._check_open()
        name = step_dir_name(step)
        if os.path.lexists(self.path / name) and not self.owns(name):
            raise CheckpointError(f"{self.path / name} exists and was not written by this run; saving step {step} "
                                  "would replace it. Move it away, or pass --overwrite (overwrite=True).")
        return PendingCheckpoint(self.path, step)

    def publish(self, pending: PendingCheckpoint, keep_last: int, progress: Callable[[str], None] | None = None) -> Path:
        """Commit ``pending`` (it becomes ``latest``), then prune this run's older checkpoints to ``keep_last``."""
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        self._check_open()
        self._owned.add(pending.name)  # before the rename: from then on the directory is ours to clean up
        final = pending.commit(progress)
        self._prune(keep_last)
        return final

    def _prune(self, keep_last: int) -> None:
        """Keep the checkpoint ``latest`` names and this run's ``keep_last - 1`` newest before it. This run's
        checkpoints newer than latest are an abandoned future of its own lineage (it resumed from an earlier
        one): deleted too. Nothing this run does not own is touched."""
        latest = read_latest(self.path)
        latest_step = parse_step_dir(latest) if latest is not None else None
        if latest_step is None:
            return
        mine = [(s, p) for s, p in list_checkpoints(self.path) if self.owns(p.name)]
        older = [(s, p) for s, p in mine if s < latest_step]
        for step, path in mine:
            if step > latest_step:
                log.warning("deleting checkpoint %s: it is newer than latest (%s) and this run's own (an abandoned "
                            "attempt of its lineage, or taken over with --overwrite)", path.name, latest)
                self._remove(path)
        for _, path in older[: max(0, len(older) - (keep_last - 1))]:
            log.debug("deleting old checkpoint %s (keep_last %d)", path.name, keep_last)
            self._remove(path)

    def _remove(self, path: Path) -> None:
        """Rename first (atomic: a half-deleted step-* directory must never be visible), then delete."""
        doomed = self.path / f".del-{path.name}-{os.getpid()}"
        os.rename(path, doomed)
        self._owned.discard(path.name)
        remove_path(doomed)

    # ---- lifetime ------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._lock_fd is None:
            raise RuntimeError(f"checkpoint directory {self.path} was closed; open a new CheckpointRoot")

    def close(self) -> None:
        """Release the lock and remove its file, as the swap directory's is (``tierstore.unlink_lock_file``: unlinked
        while still held, so a run that opened it meanwhile finds it gone once it has the lock, ``lock_file``'s
        check, and takes a new one); the root then holds the checkpoints only."""
        if self._lock_fd is not None:
            fd, self._lock_fd = self._lock_fd, None
            unlink_lock_file(self.path / LOCK_NAME, fd)

    def __enter__(self) -> CheckpointRoot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _make_private_dirs(path: Path) -> None:
    """Create path and any missing parents, each 0700 (not ``mkdir -p``'s umask default: a world-writable
    parent would let another user swap our root for theirs), each made durable in its parent."""
    missing = []
    while not os.path.lexists(path):
        missing.append(path)
        path = path.parent
    for directory in reversed(missing):
        directory.mkdir(mode=0o700, exist_ok=True)  # exist_ok: another run racing us to create it
        fsync_dir(directory.parent)


def _identity(checkpoint: Path) -> tuple[str | None, str | None]:
    """(writer, lineage) recorded in a checkpoint's meta.json; (None, None) when unreadable or absent, which
    makes it another run's: ownership is never granted on a guess."""
    if not (checkpoint / MANIFEST_NAME).is_file():
        return None, None
    try:
        meta = parse_json(read_small(checkpoint / META_NAME), checkpoint / META_NAME)
    except (OSError, CheckpointError):
        return None, None
    if not isinstance(meta, dict):
        return None, None
    writer, lineage = meta.get("writer"), meta.get("lineage")
    return (writer if isinstance(writer, str) else None), (lineage if isinstance(lineage, str) else None)
