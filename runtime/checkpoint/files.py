"""Checkpoint files on disk: flat directories of raw files, a manifest of sizes and sha256, atomic publication.

A checkpoint root looks like this::

    step-000123/              one complete checkpoint; it only ever appears whole (renamed into place)
        manifest.json         {"format", "version", "files": {name: {"nbytes", "sha256"}}}
        meta.json             what the files mean (written by runtime.checkpoint.state)
        block3.master.bin     raw little-endian tensor bytes, one file per store key
    latest                    "step-000123\\n", replaced atomically after the directory is in place
    .tmp-step-000124-<pid>/   a save in progress, or one killed: never read; removed by the next run that
                              holds the root's lock (runtime.checkpoint.root: locking, ownership, pruning)

Durability order of a save: every file is written and fsynced, then the manifest, then the directory;
the directory is renamed into place and its parent fsynced; only then is ``latest`` replaced (written to
``latest.tmp``, fsynced, renamed, parent fsynced). A crash at any point leaves ``latest`` naming a
complete, earlier checkpoint. Nothing here deserializes code or objects: JSON and raw bytes only.

Nothing is written through a link: every file (``latest.tmp`` included) is created new with
``O_EXCL|O_NOFOLLOW``, mode 0600, in directories created 0700; a checkpoint is private to its user.

Loading trusts nothing: :func:`check_listing` refuses files the manifest does not list, manifest entries
that are not plain names in the directory, links and wrong sizes; :func:`read_verified_into` hashes each
file as it is read into memory, so the bytes used are the bytes verified (a file replaced after the
listing was checked is refused). :func:`verify_checkpoint` hashes every file without loading it. JSON
files have a size cap, and malformed JSON of any kind is a CheckpointError naming the file.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
import stat
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PureWindowsPath
from typing import Any

from tierstore import create_new

log = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
META_NAME = "meta.json"  # what the files mean; written and read by runtime.checkpoint.state
LATEST_NAME = "latest"
MANIFEST_FORMAT = "tierstore-checkpoint-manifest"
MANIFEST_VERSION = 1
CHUNK_NBYTES = 8 << 20  # hashing and copying granularity: large enough for disk speed, small in RAM
JSON_MAX_NBYTES = 64 << 20  # manifest / meta: ~200 bytes per file or parameter; far above any real model's
_LATEST_MAX_NBYTES = 256
_STEP_DIR = re.compile(r"^step-(\d{6,})$")
_PLAIN_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}$")
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, tampered with, or does not fit the session; names the file."""


class DamagedCheckpointError(CheckpointError):
    """A checkpoint's files are not what its manifest lists (missing, truncated, changed, unparseable): an
    earlier checkpoint in the same root may still be intact. A checkpoint that does not fit the session is a
    plain CheckpointError."""


@dataclass(frozen=True)
class FileEntry:
    """One manifest entry: the file's exact size and sha256 (hex)."""

    nbytes: int
    sha256: str


def step_dir_name(step: int) -> str:
    """The directory name of the checkpoint taken after ``step`` optimizer steps."""
    return f"step-{step:06d}"


def parse_step_dir(name: str) -> int | None:
    """The step of a checkpoint directory name, or None when the name is not one."""
    match = _STEP_DIR.match(name)
    return int(match.group(1)) if match else None


# ---- files -----------------------------------------------------------------------------------------
def fsync_dir(path: Path) -> None:
    """fsync a directory, so the names created / renamed in it survive a power loss."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data: memoryview, path: Path) -> None:
    done = 0
    while done < len(data):
        try:
            n = os.write(fd, data[done:])
        except OSError as exc:
            exc.filename = str(path)  # "No space left on device: '<the file>'", not a bare errno
            raise
        if n <= 0:
            raise OSError(f"write to {path} returned {n} with {len(data) - done:,} bytes left")
        done += n


def write_chunks(path: Path, chunks: Iterable[bytes | bytearray | memoryview]) -> FileEntry:
    """Create ``path`` (it must not exist, not even as a link), mode 0600, write the chunks, fsync; returns
    its size and sha256."""
    digest = hashlib.sha256()
    nbytes = 0
    fd = create_new(path, flags=os.O_WRONLY)
    try:
        for chunk in chunks:
            view = memoryview(chunk).cast("B")
            digest.update(view)
            _write_all(fd, view, path)
            nbytes += len(view)
        os.fsync(fd)
    finally:
        os.close(fd)
    return FileEntry(nbytes, digest.hexdigest())


def write_buffer(path: Path, data: bytes | bytearray | memoryview) -> FileEntry:
    """Write one in-memory buffer (e.g. a host tensor's bytes) to a new file in chunks; fsynced."""
    view = memoryview(data).cast("B")
    return write_chunks(path, (view[i : i + CHUNK_NBYTES] for i in range(0, len(view), CHUNK_NBYTES)))


def _read_chunks(src: Path, offset: int, nbytes: int) -> Iterator[memoryview]:
    """Exactly ``nbytes`` of ``src`` from ``offset``, in chunks of one reused buffer."""
    buf = bytearray(min(CHUNK_NBYTES, max(nbytes, 1)))
    view = memoryview(buf)
    with os.fdopen(_open_regular(src), "rb", buffering=0) as f:
        f.seek(offset)
        left = nbytes
        while left > 0:
            want = min(left, len(buf))
            got = f.readinto(view[:want])
            if not got:
                raise CheckpointError(f"{src}: ended {left:,} bytes early (expected {nbytes:,} bytes from offset {offset})")
            yield view[:got]
            left -= got


def copy_range(src: Path, offset: int, nbytes: int, dst: Path, observe: Callable[[memoryview], None] | None = None) -> FileEntry:
    """Stream ``nbytes`` of ``src`` starting at ``offset`` into the new file ``dst`` through one 8 MiB
    buffer (never the whole payload in RAM). ``observe`` sees every chunk in order (e.g. a hasher's
    update, so the caller can check the bytes against the source's own checksum)."""

    def chunks() -> Iterator[memoryview]:
        for chunk in _read_chunks(src, offset, nbytes):
            if observe is not None:
                observe(chunk)
            yield chunk

    return write_chunks(dst, chunks())


def _open_regular(path: Path) -> int:
    """Open path for reading: never through a link, never a FIFO or device (which could block or never end)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise
    except OSError as exc:
        reason = "a symbolic link, refused" if exc.errno == errno.ELOOP else exc.strerror
        raise CheckpointError(f"{path}: cannot open ({reason})") from exc
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError(f"{path}: not a regular file")
    return fd


def read_verified_into(path: Path, dst: memoryview, expected: FileEntry) -> None:
    """Fill ``dst`` with the whole of ``path``, hashing each chunk as it lands: what is loaded is what was
    verified, in one pass. Refuses a link, another size, or bytes whose sha256 differs from the manifest's
    -- naming the file. ``dst`` keeps whatever was read when it raises; the caller discards it."""
    dst = dst.cast("B")
    if expected.nbytes != len(dst):
        raise CheckpointError(f"{path}: the manifest says {expected.nbytes:,} bytes, {len(dst):,} are expected here")
    fd = _open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if size != len(dst):
            raise CheckpointError(f"{path}: {size:,} bytes, the manifest says {len(dst):,} (truncated or overwritten)")
        digest = hashlib.sha256()
        pos = 0
        while pos < len(dst):
            got = os.readv(fd, [dst[pos : pos + CHUNK_NBYTES]])
            if not got:
                raise CheckpointError(f"{path}: ended at byte {pos:,} of {len(dst):,}")
            digest.update(dst[pos : pos + got])
            pos += got
    finally:
        os.close(fd)
    if digest.hexdigest() != expected.sha256:
        raise CheckpointError(f"{path}: sha256 {digest.hexdigest()[:16]}... does not match the manifest's "
                              f"{expected.sha256[:16]}... (corrupted or modified)")


def read_verified(path: Path, expected: FileEntry) -> bytes:
    """The whole of a small listed file (meta, config, RNG states), verified as :func:`read_verified_into` does."""
    if expected.nbytes > JSON_MAX_NBYTES:
        raise CheckpointError(f"{path}: {expected.nbytes:,} bytes, more than the {JSON_MAX_NBYTES:,} such a file may have")
    buf = bytearray(expected.nbytes)
    read_verified_into(path, memoryview(buf), expected)
    return bytes(buf)


def read_small(path: Path, limit: int = JSON_MAX_NBYTES) -> bytes:
    """The whole of a small regular file read before anything vouches for it (the manifest, ``latest``):
    no link, no FIFO, at most ``limit`` bytes."""
    fd = _open_regular(path)
    try:
        size = os.fstat(fd).st_size
        data = bytearray()
        while size <= limit and len(data) <= limit:  # read to the end, a byte past the cap at most
            chunk = os.read(fd, limit + 1 - len(data))
            if not chunk:
                break
            data += chunk
    finally:
        os.close(fd)
    if size > limit or len(data) > limit:
        raise CheckpointError(f"{path}: {max(size, len(data)):,} bytes, more than the {limit:,} such a file may have")
    return bytes(data)


def parse_json(data: bytes, path: Path) -> Any:
    """JSON text of a checkpoint file; anything malformed (bad syntax, bad UTF-8, nesting too deep for the
    parser) is a CheckpointError naming the file."""
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as exc:  # a 200k-deep nesting raises RecursionError, not ValueError
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)[:200]
        raise CheckpointError(f"{path}: unreadable ({reason})") from None


def hash_file(path: Path) -> FileEntry:
    """Size and sha256 of a file, read in 8 MiB chunks."""
    digest = hashlib.sha256()
    nbytes = 0
    for chunk in _read_chunks(path, 0, path.stat().st_size):
        digest.update(chunk)
        nbytes += len(chunk)
    return FileEntry(nbytes, digest.hexdigest())


def json_bytes(obj: Any) -> bytes:
    """Deterministic JSON text of obj."""
    return (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode()


# ---- writing a checkpoint --------------------------------------------------------------------------
class PendingFiles:
    """The files written so far into a checkpoint's scratch directory ``tmp`` (which exists), by name.

    Files are added by name (thread-safe, so several files can be written at once); each must already be
    fsynced (the ``write_*`` helpers do that). In a run of several processes, each rank but the first writes its
    blocks' files through one of these into the directory rank 0's :class:`PendingCheckpoint` made, and hands
    the entries to rank 0, which adds them to its own before it commits (``runtime.checkpoint.ranks``)."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self._files: dict[str, FileEntry] = {}
        self._lock = threading.Lock()

    @property
    def files(self) -> dict[str, FileEntry]:
        """A copy of the entries added so far."""
        with self._lock:
            return dict(self._files)

    def path(self, name: str) -> Path:
        """Where file ``name`` of this checkpoint is written."""
        check_entry_name(name, self.tmp)
        return self.tmp / name

    def add(self, name: str, entry: FileEntry) -> None:
        """Record a written (and fsynced) file for the manifest."""
        with self._lock:
            if name in self._files:
                raise RuntimeError(f"{name} was written twice into {self.tmp}")
            self._files[name] = entry

    def write_bytes(self, name: str, data: bytes | bytearray | memoryview) -> FileEntry:
        """Write and record one small file."""
        entry = write_buffer(self.path(name), data)
        self.add(name, entry)
        return entry


class PendingCheckpoint(PendingFiles):
    """A checkpoint being written in ``root/.tmp-step-NNNNNN-<pid>/``; ``commit`` publishes it atomically.

    The root must exist and the caller must hold its lock (runtime.checkpoint.root), which makes anything already
    at the scratch name a dead leftover."""

    def __init__(self, root: Path, step: int):
        self.root = root
        self.name = step_dir_name(step)
        tmp = root / f".tmp-{self.name}-{os.getpid()}"
        remove_path(tmp)
        tmp.mkdir(mode=0o700)
        super().__init__(tmp)

    def commit(self, progress: Callable[[str], None] | None = None) -> Path:
        """Write the manifest, make everything durable, rename into place, repoint ``latest``. A directory
        already at the final name is replaced whole; the caller decided it may be (it is this run's)."""
        manifest = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION,
                    "files": {name: {"nbytes": e.nbytes, "sha256": e.sha256} for name, e in sorted(self._files.items())}}
        write_buffer(self.tmp / MANIFEST_NAME, json_bytes(manifest))
        fsync_dir(self.tmp)
        _notify(progress, MANIFEST_NAME)
        final = self.root / self.name
        old = None
        if os.path.lexists(final):
            # The same step saved again (e.g. resumed from an earlier checkpoint after a crash that left this
            # one in place but not yet named by latest): move the old one aside, never merge into it.
            old = self.root / f".old-{self.name}-{os.getpid()}"
            os.rename(final, old)
            fsync_dir(self.root)
        os.rename(self.tmp, final)
        fsync_dir(self.root)
        _notify(progress, "renamed")
        write_latest(self.root, self.name)
        _notify(progress, LATEST_NAME)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def abort(self) -> None:
        """Delete the partial directory (a failed save leaves the previous checkpoint as latest)."""
        shutil.rmtree(self.tmp, ignore_errors=True)


def remove_path(path: Path) -> None:
    """Remove whatever is at path (a directory tree, a file, or a link -- never what a link points at)."""
    if path.is_symlink() or (os.path.lexists(path) and not path.is_dir()):
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def _notify(progress: Callable[[str], None] | None, what: str) -> None:
    if progress is not None:
        progress(what)


def write_latest(root: Path, name: str) -> None:
    """Point ``root/latest`` at checkpoint directory ``name``, atomically and durably. The caller holds the
    root's lock, so a ``latest.tmp`` already there is a leftover (or a planted link): it is unlinked, never
    written through; on failure the new one is removed and ``latest`` is unchanged."""
    tmp = root / (LATEST_NAME + ".tmp")
    fd = create_new(tmp, flags=os.O_WRONLY, replace_stale=True)
    try:
        try:
            _write_all(fd, memoryview((name + "\n").encode()), tmp)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, root / LATEST_NAME)  # replaces the name (a link there too), never writes through it
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(root)


def read_latest(root: Path) -> str | None:
    """The directory name ``root/latest`` points at (validated), or None when there is no pointer."""
    pointer = root / LATEST_NAME
    try:
        text = read_small(pointer, _LATEST_MAX_NBYTES).decode("ascii", errors="strict").strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{pointer}: unreadable ({exc})") from exc
    if parse_step_dir(text) is None:
        raise CheckpointError(f"{pointer}: names {text[:80]!r}, not a checkpoint directory like step-000123")
    return text


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoint directories under root (step-NNNNNN; never the .tmp ones), by step."""
    if not root.is_dir():
        return []
    found = [(parse_step_dir(p.name), p) for p in root.iterdir() if p.is_dir() and not p.is_symlink()]
    return sorted((step, p) for step, p in found if step is not None)


# ---- finding and verifying -------------------------------------------------------------------------
def find_checkpoint(directory: str | os.PathLike[str]) -> Path | None:
    """The checkpoint to load from ``directory``: the directory itself when it holds a manifest, else the
    one ``latest`` names. A dangling ``latest`` (its directory was removed) falls back to the newest
    complete ``step-*`` directory. None when there is no checkpoint at all."""
    path = Path(directory)
    if (path / MANIFEST_NAME).exists():
        return path
    if not path.is_dir():
        return None
    name = read_latest(path)
    if name is not None:
        target = path / name
        if target.is_dir():
            return target
        log.warning("%s names %s, which is missing; using the newest complete checkpoint instead", path / LATEST_NAME, name)
    found = list_checkpoints(path)
    return found[-1][1] if found else None


def resolve_checkpoint(directory: str | os.PathLike[str]) -> Path:
    """Like :func:`find_checkpoint`, but raises CheckpointError when there is none."""
    found = find_checkpoint(directory)
    if found is None:
        raise CheckpointError(f"{directory}: no checkpoint here (no {MANIFEST_NAME}, no {LATEST_NAME}, no step-* directory)")
    return found


def check_entry_name(name: object, directory: Path) -> str:
    """Refuse a manifest entry that is not a plain file name inside the checkpoint directory."""
    where = f"{directory}: manifest entry {name!r}"
    if not isinstance(name, str) or not name:
        raise CheckpointError(f"{where} is not a file name")
    if name.startswith(("/", "\\")) or os.path.isabs(name) or PureWindowsPath(name).is_absolute():
        raise CheckpointError(f"{where} is an absolute path; entries must be plain names inside the checkpoint")
    if ".." in re.split(r"[/\\]", name):
        raise CheckpointError(f"{where} leaves the checkpoint directory ('..')")
    if not _PLAIN_NAME.match(name):
        raise CheckpointError(f"{where} is not a plain file name (letters, digits, _ . -; no directories)")
    if name == MANIFEST_NAME:
        raise CheckpointError(f"{where}: the manifest cannot list itself")
    return name


def read_manifest(path: Path) -> dict[str, FileEntry]:
    """Parse and validate ``path/manifest.json`` (structure and names only; no file is read)."""
    manifest_path = path / MANIFEST_NAME
    try:
        raw = parse_json(read_small(manifest_path), manifest_path)
    except FileNotFoundError:
        raise CheckpointError(f"{manifest_path}: missing (not a checkpoint directory, or an incomplete one)") from None
    except OSError as exc:
        raise CheckpointError(f"{manifest_path}: unreadable ({exc})") from exc
    if not isinstance(raw, dict) or raw.get("format") != MANIFEST_FORMAT:
        raise CheckpointError(f"{manifest_path}: not a tierstore checkpoint manifest")
    if raw.get("version") != MANIFEST_VERSION:
        raise CheckpointError(f"{manifest_path}: manifest version {raw.get('version')!r}, this tierstore reads {MANIFEST_VERSION}")
    files = raw.get("files")
    if not isinstance(files, dict):
        raise CheckpointError(f"{manifest_path}: 'files' is not a mapping")
    out: dict[str, FileEntry] = {}
    for name, entry in files.items():
        check_entry_name(name, path)
        nbytes = entry.get("nbytes") if isinstance(entry, dict) else None
        sha = entry.get("sha256") if isinstance(entry, dict) else None
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0 or not isinstance(sha, str) or not _SHA256_HEX.match(sha):
            raise CheckpointError(f"{path / name}: manifest entry {entry!r} needs an integer nbytes and a sha256 hex digest")
        out[name] = FileEntry(nbytes, sha)
    return out


def check_listing(path: str | os.PathLike[str]) -> dict[str, FileEntry]:
    """The cheap half of verification, without reading any file: every listed file exists as a regular
    file (no links) of the listed size, and nothing unlisted is there. Raises CheckpointError naming the
    file; returns the manifest's entries (to check each file's sha256 as it is read)."""
    path = Path(path)
    files = read_manifest(path)
    for entry in sorted(os.scandir(path), key=lambda e: e.name):
        if entry.name != MANIFEST_NAME and entry.name not in files:
            raise CheckpointError(f"{path / entry.name}: not listed in {MANIFEST_NAME}; refusing a checkpoint with unlisted files")
    for name, expected in sorted(files.items()):  # cheap checks first: a truncated file fails without hashing
        target = path / name
        try:
            st = target.lstat()
        except FileNotFoundError:
            raise CheckpointError(f"{target}: listed in {MANIFEST_NAME} but missing") from None
        if not os.path.isfile(target) or os.path.islink(target):
            raise CheckpointError(f"{target}: not a regular file")
        if st.st_size != expected.nbytes:
            raise CheckpointError(f"{target}: {st.st_size:,} bytes, the manifest says {expected.nbytes:,} (truncated or overwritten)")
    return files


def verify_checkpoint(path: str | os.PathLike[str], threads: int = 4) -> dict[str, FileEntry]:
    """Check a checkpoint directory against its manifest: :func:`check_listing`, then every file's sha256.

    Loading does not need this (it hashes each file as it reads it); call it to check a checkpoint
    without loading it, or before loading into a session whose state must survive a refused checkpoint.
    Raises CheckpointError naming the file; returns the manifest's entries."""
    path = Path(path)
    files = check_listing(path)
    names = sorted(files)
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(names)))) as pool:  # hashlib releases the GIL
        actual = dict(zip(names, pool.map(lambda n: hash_file(path / n), names), strict=True))
    for name in names:
        if actual[name] != files[name]:
            raise CheckpointError(f"{path / name}: sha256 {actual[name].sha256[:16]}... does not match the manifest's "
                                  f"{files[name].sha256[:16]}... (corrupted or modified)")
    return files
