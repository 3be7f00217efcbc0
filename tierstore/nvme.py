"""Swap files on an NVMe (or any) directory: layout, locking, O_DIRECT probe, header + checksum.

Layout of one file: a 4096-byte header, then the payload padded to a multiple of 4096 so that every IO
can be O_DIRECT. The header carries magic, version, key, dtype, numel, the payload's XXH3-64 checksum and
the step that wrote it, plus a crc32 of the header itself. (XXH3 runs at ~9 GB/s a core, crc32 at ~2.5:
on a two-core box crc32 alone held reads of a fast device to 78% of the raw ceiling.) Files are created mode 0600
and preallocated. One process holds the directory at a time (an flock on ``.tierstore.lock``). Where the file
system refuses O_DIRECT (tmpfs), IO falls back to ordinary buffered pread/pwrite; the mode chosen is logged and
exposed.

Safety: the directory must be ours and writable by nobody else (tierstore.files); it is opened once and
every file in it is created relative to that descriptor with ``O_EXCL|O_NOFOLLOW``, so a link planted at a
swap file's name is removed, never written through. Every read checks the header's step against the step
the caller expects, so a file rolled back to an older step reads as corrupt, never as current data.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import logging
import mmap
import os
import struct
import threading
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
import xxhash

from tierstore.allocator import align_up
from tierstore.errors import CapacityError, CorruptFileError, DirectoryLockedError, StoreIOError, UnsafeDirectoryError
from tierstore.files import create_new, lock_file, shared_directory_problem, unlink_lock_file
from tierstore.keys import DTYPE_CODES, DTYPES_BY_CODE, TensorKey, TensorMeta

log = logging.getLogger(__name__)

HEADER_NBYTES = 4096
"""Bytes of a swap file's header (magic, key, meta, step, payload checksum); the payload starts at this offset."""
IO_ALIGNMENT = 4096
MAGIC = b"TIERSWP1"
FORMAT_VERSION = 2
LOCK_NAME = ".tierstore.lock"
PROBE_NAME = ".tierstore.direct_probe"
SUFFIX = ".tsw"
# magic, version, dtype code, numel, nbytes, payload xxh3-64, step, key length; then the key; then header crc32.
_HEADER_STRUCT = struct.Struct("<8sIIQQQqH")


@dataclass
class SwapFile:
    """One tensor's file: path, open descriptors, and the meta the header must match."""

    key: TensorKey
    meta: TensorMeta
    path: Path
    file_nbytes: int
    fd_buffered: int
    fd_direct: int | None
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def payload_padded_nbytes(self) -> int:
        """Payload bytes rounded up to the IO alignment."""
        return align_up(self.meta.nbytes, IO_ALIGNMENT)


def probe_direct_io(directory: Path, *, dir_fd: int | None = None) -> bool:
    """True when files in directory accept O_DIRECT reads and writes of aligned 4096-byte buffers.

    The probe file is created new (``O_EXCL|O_NOFOLLOW``; a leftover or a planted link at its name is
    unlinked first, so the caller must hold the directory's lock) and switched to O_DIRECT with fcntl, so
    it is never reopened by name. ``dir_fd``: the directory's open descriptor, when the caller has one."""
    if not hasattr(os, "O_DIRECT"):
        return False
    name = PROBE_NAME if dir_fd is not None else directory / PROBE_NAME
    buf = mmap.mmap(-1, IO_ALIGNMENT)
    try:
        fd = create_new(name, dir_fd=dir_fd, replace_stale=True)
    except OSError:
        buf.close()
        return False
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
        return os.pwrite(fd, buf, 0) == IO_ALIGNMENT and os.preadv(fd, [buf], 0) == IO_ALIGNMENT
    except OSError:
        return False
    finally:
        os.close(fd)
        buf.close()
        os.unlink(name, dir_fd=dir_fd)


class NVMeDirectory:
    """A locked directory of swap files with a hard byte budget.

    ``direct_io``: "auto" probes O_DIRECT and falls back to buffered IO; "on" refuses a file system
    without it; "off" always uses buffered IO.
    """

    def __init__(self, path: str | os.PathLike, budget_nbytes: int, direct_io: str = "auto", block_nbytes: int = 64 << 20):
        if direct_io not in ("auto", "on", "off"):
            raise ValueError(f"direct_io must be auto, on or off; got {direct_io!r}")
        if block_nbytes <= 0 or block_nbytes % IO_ALIGNMENT:
            raise ValueError(f"NVMe block size must be a positive multiple of {IO_ALIGNMENT}, got {block_nbytes}")
        self.path = Path(path)
        if not self.path.is_dir():
            raise FileNotFoundError(f"NVMe directory {self.path} does not exist or is not a directory; create it or change tiers.nvme.path")
        self.budget_nbytes = budget_nbytes
        self.block_nbytes = block_nbytes
        self._dir_fd = _open_private_dir(self.path)
        try:
            self._lock_fd = lock_file(LOCK_NAME, f"NVMe directory {self.path}",
                                      "Give each training run its own tiers.nvme.path.", dir_fd=self._dir_fd)
        except BaseException:
            os.close(self._dir_fd)
            raise
        self._files: dict[TensorKey, SwapFile] = {}
        self._used_nbytes = 0
        self._state_lock = threading.Lock()
        self._closed = False
        try:
            supported = direct_io != "off" and probe_direct_io(self.path, dir_fd=self._dir_fd)
            if direct_io == "on" and not supported:
                raise ValueError(f"direct_io: on, but {self.path} refuses O_DIRECT (some file systems do); use direct_io: "
                                 "auto or off")
        except BaseException:  # a refusal, an IO error or a signal (SIGTERM, Ctrl-C): the directory left as found
            self._release_lock()
            raise
        self.direct_io = supported
        self.io_mode = "direct" if supported else "buffered"
        log.info("NVMe tier at %s: %s IO, budget %.2f GiB", self.path, self.io_mode, budget_nbytes / 2**30)

    # ---- locking -------------------------------------------------------------------------------------
    def _release_lock(self) -> None:
        try:
            unlink_lock_file(LOCK_NAME, self._lock_fd, dir_fd=self._dir_fd)  # the user's directory is left as found
        finally:
            os.close(self._dir_fd)

    # ---- accounting ----------------------------------------------------------------------------------
    @property
    def used_nbytes(self) -> int:
        """Bytes of disk reserved by this directory's swap files (headers and padding included)."""
        return self._used_nbytes

    @property
    def free_nbytes(self) -> int:
        """Budget not yet reserved."""
        return self.budget_nbytes - self._used_nbytes

    @staticmethod
    def file_size(meta: TensorMeta) -> int:
        """On-disk size of a swap file for meta."""
        return HEADER_NBYTES + align_up(meta.nbytes, IO_ALIGNMENT)

    # ---- files ---------------------------------------------------------------------------------------
    def create(self, key: TensorKey, meta: TensorMeta) -> SwapFile:
        """Create and preallocate key's file (mode 0600). Raises CapacityError over budget, StoreIOError when
        the disk is full; in both cases nothing is left behind."""
        self._check_open()
        size = self.file_size(meta)
        name = f"{key.file_stem()}{SUFFIX}"
        path = self.path / name
        with self._state_lock:
            if key in self._files:
                raise RuntimeError(f"swap file for {key} already exists")
            clash = next((other for other in self._files.values() if other.path == path), None)
            if clash is not None:  # '/' maps to '__', so 'a/b' and 'a__b' would share (and truncate) one file
                raise ValueError(f"keys {key} and {clash.key} map to the same swap file {path}; rename one of them")
            if self._used_nbytes + size > self.budget_nbytes:
                raise CapacityError("nvme", size, self._used_nbytes, self.budget_nbytes, str(key))
            self._used_nbytes += size  # reserve before the slow fallocate; undone on failure
        fd: int | None = None
        fd_direct: int | None = None
        try:
            # We hold the directory's lock, so a file already at this name is a leftover (or a planted link):
            # it is unlinked, never opened, and the new file is created mode 0600 whatever the umask.
            fd = create_new(name, dir_fd=self._dir_fd, replace_stale=True)
            os.posix_fallocate(fd, 0, size)
            fd_direct = self._reopen_direct(name, fd) if self.direct_io else None
            swap = SwapFile(key=key, meta=meta, path=path, file_nbytes=size, fd_buffered=fd, fd_direct=fd_direct)
            with self._state_lock:
                self._files[key] = swap
        except BaseException as exc:
            # Whatever stopped it (a disk error, or a signal's exception raised between any two of these calls:
            # SIGTERM's handler raises in the main thread), the file is not ours to keep and nothing will close it.
            with self._state_lock:
                self._files.pop(key, None)  # registered just before the interrupt: not registered after all
            self._undo_create(name, fd, fd_direct, size)
            if not isinstance(exc, OSError):
                raise
            if fd is None:
                raise StoreIOError(exc.errno, f"cannot create swap file: {exc.strerror}", str(path), 0) from exc
            hint = " (disk full: free space or lower tiers.nvme.budget)" if exc.errno == errno.ENOSPC else ""
            raise StoreIOError(exc.errno, f"cannot preallocate {size:,} bytes: {exc.strerror}{hint}", str(path), 0) from exc
        return swap

    def get(self, key: TensorKey) -> SwapFile:
        """The open swap file of key."""
        return self._files[key]

    def remove(self, key: TensorKey) -> None:
        """Close and delete key's file, returning its bytes to the budget."""
        with self._state_lock:
            swap = self._files.pop(key)
            self._used_nbytes -= swap.file_nbytes
        self._close_file(swap)
        try:
            os.unlink(swap.path.name, dir_fd=self._dir_fd)
        except FileNotFoundError:
            pass

    def _undo_create(self, name: str, fd: int | None, fd_direct: int | None, size: int) -> None:
        """Close what ``create`` opened, remove its file and give its bytes back to the budget. The file is removed
        also when no descriptor came back (an interrupt inside ``create_new``): we hold the directory's lock, so a
        file at this name is this call's or a leftover."""
        for descriptor in (fd_direct, fd):
            if descriptor is not None:
                os.close(descriptor)
        with contextlib.suppress(OSError):  # none there (or not a file): the error being raised is the one to see
            os.unlink(name, dir_fd=self._dir_fd)
        with self._state_lock:
            self._used_nbytes -= size

    def _reopen_direct(self, name: str, fd: int) -> int:
        """A second, O_DIRECT descriptor of the file just created as ``fd`` (never through a link)."""
        fd_direct = os.open(name, os.O_RDWR | os.O_DIRECT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), dir_fd=self._dir_fd)
        first, second = os.fstat(fd), os.fstat(fd_direct)
        if (first.st_dev, first.st_ino) != (second.st_dev, second.st_ino):
            os.close(fd_direct)
            raise RuntimeError(f"swap file {self.path / name} was replaced while this process held the directory's lock")
        return fd_direct

    @staticmethod
    def _close_file(swap: SwapFile) -> None:
        os.close(swap.fd_buffered)
        if swap.fd_direct is not None:
            os.close(swap.fd_direct)

    # ---- IO ------------------------------------------------------------------------------------------
    def write(self, swap: SwapFile, src: torch.Tensor, step: int = 0, fsync: bool = False) -> int:
        """Write src (a flat uint8 tensor of at least the payload's bytes) and a fresh header. Returns nbytes.

        The payload goes first and the header last, so a crash in between leaves a header whose checksum
        does not match: the file then reads as corrupt, never as stale data.
        """
        nbytes = swap.meta.nbytes
        _check_buffer(src, nbytes, swap)
        with swap.lock:
            crc = self._transfer(swap, src, nbytes, write=True)
            os_write_all(swap.fd_buffered, _encode_header(swap, crc, step), 0, swap.path)
            if fsync:
                os.fsync(swap.fd_buffered)
        return nbytes

    def write_zeros(self, swap: SwapFile, step: int = 0) -> int:
        """Make a file just created hold a zero payload: only its header is written. ``create`` preallocated the
        file, and a new file's preallocated bytes read as zeros, so the payload already is; writing it again
        would move every byte of it through the disk (the 8B scenario's 21 GiB of zero moments: seconds of
        setup). Refuses a file that was ever written (its header is no longer zeros). Returns the payload bytes."""
        with swap.lock:
            if any(os_read_all(swap.fd_buffered, HEADER_NBYTES, 0, swap.path)):
                raise RuntimeError(f"{swap.path}: write_zeros on a file already written")
            os_write_all(swap.fd_buffered, _encode_header(swap, zeros_checksum(swap.meta.nbytes), step), 0, swap.path)
        return swap.meta.nbytes

    def read(self, swap: SwapFile, dst: torch.Tensor, expected_step: int | None = None) -> int:
        """Read the payload into dst (a flat uint8 tensor) and verify header and checksum. Returns nbytes.

        ``expected_step``: the step the caller believes the file holds (the store's ``Record.step``); a
        header recording another step (a file rolled back, or copied in from another run) is corrupt."""
        nbytes = swap.meta.nbytes
        _check_buffer(dst, nbytes, swap)
        with swap.lock:
            header = os_read_all(swap.fd_buffered, HEADER_NBYTES, 0, swap.path)
            expected_crc, _step = _decode_header(swap, header, expected_step)
            crc = self._transfer(swap, dst, nbytes, write=False)
        if crc != expected_crc:
            raise CorruptFileError(str(swap.path), f"payload checksum {crc:#018x} != header's {expected_crc:#018x}")
        return nbytes

    def read_step(self, swap: SwapFile) -> int:
        """The step recorded in key's header (verifies the header)."""
        return _decode_header(swap, os_read_all(swap.fd_buffered, HEADER_NBYTES, 0, swap.path))[1]

    def read_payload_checksum(self, swap: SwapFile, expected_step: int | None = None) -> int:
        """The payload checksum recorded in key's header (verifies the header, and its step against
        ``expected_step`` as :meth:`read` does), for a reader that streams the payload itself (a checkpoint
        copying ``HEADER_NBYTES`` onward) and must not copy a corrupt or stale file; compute the bytes' own
        with :func:`payload_hasher`."""
        return _decode_header(swap, os_read_all(swap.fd_buffered, HEADER_NBYTES, 0, swap.path), expected_step)[0]

    def _transfer(self, swap: SwapFile, buf: torch.Tensor, nbytes: int, write: bool) -> int:
        """Move the payload in block-sized chunks; returns the XXH3-64 of the payload bytes, computed chunk by
        chunk while each chunk is hot in cache (one pass over memory for IO and checksum together)."""
        view = buf.numpy().data  # buf is flat uint8 (_check_buffer): byte offsets index it
        padded = align_up(nbytes, IO_ALIGNMENT)
        # O_DIRECT moves whole pages from page-aligned memory; anything else goes through the page cache.
        direct = swap.fd_direct if buf.data_ptr() % IO_ALIGNMENT == 0 and buf.numel() >= padded else None
        fd = direct if direct is not None else swap.fd_buffered
        end = padded if direct is not None else nbytes
        hasher = xxhash.xxh3_64()
        pos = 0
        while pos < end:
            chunk_end = min(pos + self.block_nbytes, end)
            chunk = view[pos:chunk_end]
            payload = chunk[: max(0, min(chunk_end, nbytes) - pos)]
            if write:
                hasher.update(payload)
                os_write_all(fd, chunk, HEADER_NBYTES + pos, swap.path)
            else:
                os_read_all_into(fd, chunk, HEADER_NBYTES + pos, swap.path)
                hasher.update(payload)
            pos = chunk_end
        return hasher.intdigest()

    def sync(self) -> None:
        """fsync every swap file and the directory."""
        for swap in list(self._files.values()):
            os.fsync(swap.fd_buffered)
        os.fsync(self._dir_fd)

    def close(self, remove_files: bool = True) -> None:
        """Close every file (deleting them unless remove_files is False), then release the lock."""
        if self._closed:
            return
        for key in list(self._files):
            if remove_files:
                self.remove(key)
            else:
                self._close_file(self._files.pop(key))
        self._used_nbytes = 0
        self._release_lock()
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"NVMe directory {self.path} is closed")


@functools.lru_cache(maxsize=64)
def zeros_checksum(nbytes: int) -> int:
    """The XXH3-64 of ``nbytes`` zero bytes (cached: a model's blocks come in a few sizes)."""
    hasher, zeros = xxhash.xxh3_64(), bytes(min(nbytes, 16 << 20))
    for pos in range(0, nbytes, len(zeros) or 1):
        hasher.update(zeros[: min(len(zeros), nbytes - pos)])
    return hasher.intdigest()


def payload_hasher() -> xxhash.xxh3_64:
    """A fresh hasher of the algorithm swap-file headers record for their payload (XXH3-64): ``update``
    it with the payload bytes in order, then compare ``intdigest()`` with ``read_payload_checksum``."""
    return xxhash.xxh3_64()


def _check_buffer(buf: torch.Tensor, nbytes: int, swap: SwapFile) -> None:
    if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous() or buf.device.type != "cpu":
        raise TypeError(f"swap IO for {swap.key} needs a flat contiguous uint8 host tensor, "
                        f"got {buf.dtype} {tuple(buf.shape)} on {buf.device}")
    if buf.numel() < nbytes:
        raise ValueError(f"buffer of {buf.numel():,} bytes is smaller than {swap.key}'s {nbytes:,}")


def _encode_header(swap: SwapFile, crc: int, step: int) -> memoryview:
    key_bytes = swap.key.name.encode()
    fields = _HEADER_STRUCT.pack(MAGIC, FORMAT_VERSION, DTYPE_CODES[swap.meta.dtype], swap.meta.numel, swap.meta.nbytes, crc, step,
                                 len(key_bytes))
    body = fields + key_bytes
    page = mmap.mmap(-1, HEADER_NBYTES)  # page-aligned, zero-filled
    page[: len(body)] = body
    page[len(body) : len(body) + 4] = struct.pack("<I", zlib.crc32(body))
    return memoryview(page)


def _open_private_dir(path: Path) -> int:
    """Open the swap directory once (every file is then created relative to this descriptor, so renaming
    the path afterwards cannot redirect us) and refuse one that other users can write to."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
    problem = shared_directory_problem(os.fstat(fd))
    if problem is not None:
        os.close(fd)
        raise UnsafeDirectoryError(
            f"NVMe directory {path} {problem}: another user could plant links or replace swap files there. Point "
            f"tiers.nvme.path at a directory only you can write (`mkdir -m 700 {path}/mine` and use that), or write "
            "tiers.nvme.path: tmp for a private temporary one")
    return fd


def _decode_header(swap: SwapFile, header: bytes, expected_step: int | None = None) -> tuple[int, int]:
    path = str(swap.path)
    fixed = _HEADER_STRUCT.size
    magic, version, dtype_code, numel, nbytes, crc, step, key_len = _HEADER_STRUCT.unpack_from(header, 0)
    if magic != MAGIC:
        raise CorruptFileError(path, f"bad magic {magic!r} (never written, or not a tierstore file)")
    if key_len > 200:
        raise CorruptFileError(path, f"header key length {key_len} is out of range")
    body = header[: fixed + key_len]
    (header_crc,) = struct.unpack_from("<I", header, fixed + key_len)
    if zlib.crc32(body) != header_crc:
        raise CorruptFileError(path, "header checksum does not match")
    if version != FORMAT_VERSION:
        raise CorruptFileError(path, f"format version {version}, this tierstore reads {FORMAT_VERSION}")
    key = header[fixed : fixed + key_len].decode(errors="replace")
    dtype = DTYPES_BY_CODE.get(dtype_code)
    if key != swap.key.name or dtype != swap.meta.dtype or numel != swap.meta.numel or nbytes != swap.meta.nbytes:
        raise CorruptFileError(path, f"header describes {key} {dtype} x{numel}, expected {swap.key} {swap.meta.dtype} x{swap.meta.numel}")
    if expected_step is not None and step != expected_step:
        raise CorruptFileError(path, f"header records step {step}, but the store expects step {expected_step} "
                                     "(a stale or rolled-back file)")
    return crc, step


def os_write_all(fd: int, data: memoryview, offset: int, path: Path) -> None:
    """pwrite all of data at offset; a short write or an OSError becomes StoreIOError naming file and offset."""
    done = 0
    total = len(data)
    while done < total:
        try:
            n = os.pwrite(fd, data[done:], offset + done)
        except OSError as exc:
            hint = " (disk full)" if exc.errno == errno.ENOSPC else ""
            raise StoreIOError(exc.errno, f"write of {total - done:,} bytes failed: {exc.strerror}{hint}", str(path),
                               offset + done) from exc
        if n <= 0:
            raise StoreIOError(None, f"write returned {n} with {total - done:,} bytes left", str(path), offset + done)
        done += n


def os_read_all_into(fd: int, data: memoryview, offset: int, path: Path) -> None:
    """pread exactly len(data) bytes at offset into data; EOF or an OSError becomes StoreIOError."""
    done = 0
    total = len(data)
    while done < total:
        try:
            n = os.preadv(fd, [data[done:]], offset + done)
        except OSError as exc:
            raise StoreIOError(exc.errno, f"read of {total - done:,} bytes failed: {exc.strerror}", str(path), offset + done) from exc
        if n <= 0:
            raise StoreIOError(None, f"read hit end of file with {total - done:,} bytes left (file truncated?)", str(path), offset + done)
        done += n


def os_read_all(fd: int, nbytes: int, offset: int, path: Path) -> bytes:
    """Read exactly nbytes at offset into new bytes."""
    buf = bytearray(nbytes)
    os_read_all_into(fd, memoryview(buf), offset, path)
    return bytes(buf)


def remove_abandoned(path: str | os.PathLike[str]) -> list[str]:
    """Remove the swap files a process that died left in ``path`` (killed, it could not remove them itself): only
    when the directory's lock can be taken now, which the kernel released with the dead holder; a holder still
    running keeps it, and nothing is touched. Returns the names removed (the lock file last)."""
    directory = Path(path)
    if not directory.is_dir():
        return []
    dir_fd = _open_private_dir(directory)
    try:
        try:
            lock_fd = lock_file(LOCK_NAME, f"NVMe directory {directory}", "", dir_fd=dir_fd)
        except DirectoryLockedError:
            return []
        removed = [name for name in os.listdir(dir_fd) if name.endswith(SUFFIX)]
        for name in removed:
            os.unlink(name, dir_fd=dir_fd)
        unlink_lock_file(LOCK_NAME, lock_fd, dir_fd=dir_fd)
        return [*removed, LOCK_NAME]
    finally:
        os.close(dir_fd)
