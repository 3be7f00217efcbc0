"""NVMeDirectory: swap-file round trips on tmpfs and disk, O_DIRECT probe, header/checksum, locking, modes."""

from __future__ import annotations

import multiprocessing
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.unit.tierstore.tensors import as_bytes, random_tensor
from tierstore import CapacityError, CorruptFileError, DirectoryLockedError, NVMeDirectory, PinnedArena, StoreIOError
from tierstore.keys import TensorKey, TensorMeta
from tierstore.nvme import _HEADER_STRUCT, HEADER_NBYTES, IO_ALIGNMENT, LOCK_NAME, SUFFIX, probe_direct_io

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool]
NUMELS = [0, 1, 4097, (3 << 20) // 4 + 3]






def file_payload(path: Path, nbytes: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(HEADER_NBYTES)
        return f.read(nbytes)


def swap_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(SUFFIX))


def flip_byte(path: Path, offset: int) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        (old,) = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([old ^ 0xFF]), offset)
    finally:
        os.close(fd)


@pytest.fixture
def nvme(nvme_dir: Path):
    directory = NVMeDirectory(nvme_dir, 64 << 20)
    yield directory
    directory.close()


# ---- round trips ---------------------------------------------------------------------------------------
def _io_buffer(kind: str, nbytes: int, keep: list) -> torch.Tensor:
    padded = -(-nbytes // IO_ALIGNMENT) * IO_ALIGNMENT
    if kind == "arena":  # page-aligned and padded: O_DIRECT where the directory allows it
        arena = PinnedArena(max(padded, IO_ALIGNMENT), pin=False)
        keep.append(arena)
        return arena.padded_view(arena.allocate(nbytes), nbytes)
    return torch.zeros(padded + 1, dtype=torch.uint8)[1:]  # misaligned: always the buffered path


@pytest.mark.parametrize("direct_io,buffer", [("auto", "arena"), ("auto", "unaligned"), ("off", "arena")])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("numel", NUMELS)
def test_round_trip_is_bit_exact(nvme_dir: Path, direct_io: str, buffer: str, dtype: torch.dtype, numel: int) -> None:
    """Every dtype and size comes back bit-exact, and the bytes are in the file itself after the header."""
    data = random_tensor(dtype, numel, seed=numel + 7)
    meta = TensorMeta.of(data)
    key = TensorKey("layer.0/" + str(dtype).replace("torch.", ""))
    keep: list = []
    directory = NVMeDirectory(nvme_dir, 64 << 20, direct_io=direct_io)
    try:
        swap = directory.create(key, meta)
        src = _io_buffer(buffer, meta.nbytes, keep)
        src[: meta.nbytes].copy_(as_bytes(data))
        assert directory.write(swap, src, step=5) == meta.nbytes
        assert file_payload(swap.path, meta.nbytes) == as_bytes(data).numpy().tobytes()
        assert os.path.getsize(swap.path) == NVMeDirectory.file_size(meta)
        dst = _io_buffer(buffer, meta.nbytes, keep)
        dst.fill_(0xA5)
        assert directory.read(swap, dst) == meta.nbytes
        assert torch.equal(dst[: meta.nbytes], as_bytes(data))
        assert directory.read_step(swap) == 5
    finally:
        directory.close()
        for arena in keep:
            arena.close()
    assert swap_files(nvme_dir) == []


@pytest.mark.parametrize("direct_io", ["auto", "off"])
def test_a_new_file_holds_zeros_with_only_its_header_written(nvme_dir: Path, direct_io: str, monkeypatch) -> None:
    """write_zeros writes the header alone (the preallocated payload reads as zeros): the file reads back as
    zeros with a valid checksum, a flipped payload byte still reads as corrupt, and a file once written refuses it."""
    meta = TensorMeta(torch.float32, 3 * (1 << 20) + 5)  # several IO blocks and a tail
    directory = NVMeDirectory(nvme_dir, 64 << 20, direct_io=direct_io, block_nbytes=1 << 20)
    writes: list[int] = []
    real_write = os.pwrite
    monkeypatch.setattr(os, "pwrite", lambda fd, data, offset: writes.append(len(data)) or real_write(fd, data, offset))
    try:
        swap = directory.create(TensorKey("zeros"), meta)
        assert directory.write_zeros(swap, step=3) == meta.nbytes
        assert 0 < sum(writes) <= HEADER_NBYTES  # the header, not the 12 MiB payload
        dst = torch.full((NVMeDirectory.file_size(meta),), 0xA5, dtype=torch.uint8)
        assert directory.read(swap, dst, expected_step=3) == meta.nbytes and not dst[: meta.nbytes].any()
        with open(swap.path, "r+b") as f:  # one bit of the payload flipped: the checksum no longer matches
            f.seek(HEADER_NBYTES + 12345)
            f.write(b"\x01")
        with pytest.raises(CorruptFileError):
            directory.read(swap, dst)
        with pytest.raises(RuntimeError, match="already written"):
            directory.write_zeros(swap)
    finally:
        directory.close()


def test_multi_block_transfer_with_small_blocks(nvme_dir: Path) -> None:
    """A payload spanning many IO blocks (and ending mid-block) is chunked without losing a byte."""
    data = random_tensor(torch.uint8, 5 * IO_ALIGNMENT + 123, seed=3)
    directory = NVMeDirectory(nvme_dir, 1 << 20, block_nbytes=IO_ALIGNMENT)
    keep: list = []
    try:
        swap = directory.create(TensorKey("multi"), TensorMeta.of(data))
        for kind in ("arena", "unaligned"):
            src = _io_buffer(kind, data.numel(), keep)
            src[: data.numel()].copy_(data)
            directory.write(swap, src)
            dst = _io_buffer(kind, data.numel(), keep)
            directory.read(swap, dst)
            assert torch.equal(dst[: data.numel()], data)
    finally:
        directory.close()
        for arena in keep:
            arena.close()


def test_write_with_fsync_and_sync(nvme: NVMeDirectory) -> None:
    data = random_tensor(torch.float32, 1000)
    swap = nvme.create(TensorKey("synced"), TensorMeta.of(data))
    nvme.write(swap, as_bytes(data).clone(), step=2, fsync=True)
    nvme.sync()
    out = torch.empty(data.numel() * 4, dtype=torch.uint8)
    nvme.read(swap, out)
    assert torch.equal(out, as_bytes(data))


def test_buffers_are_checked(nvme: NVMeDirectory) -> None:
    swap = nvme.create(TensorKey("checked"), TensorMeta(torch.float32, 100))
    with pytest.raises(TypeError, match="uint8"):
        nvme.write(swap, torch.zeros(100, dtype=torch.float32))
    with pytest.raises(ValueError, match="smaller"):
        nvme.read(swap, torch.zeros(399, dtype=torch.uint8))


# ---- O_DIRECT probe -------------------------------------------------------------------------------------
def test_io_mode_follows_the_probe(nvme_dir: Path) -> None:
    supported = probe_direct_io(nvme_dir)
    assert not (nvme_dir / ".tierstore.direct_probe").exists()
    directory = NVMeDirectory(nvme_dir, 1 << 20)
    try:
        assert directory.io_mode in ("direct", "buffered")
        assert directory.io_mode == ("direct" if supported else "buffered")
        swap = directory.create(TensorKey("probe"), TensorMeta(torch.uint8, 10))
        assert (swap.fd_direct is not None) == supported
    finally:
        directory.close()


def test_direct_io_off_is_buffered(nvme_dir: Path) -> None:
    directory = NVMeDirectory(nvme_dir, 1 << 20, direct_io="off")
    try:
        assert directory.io_mode == "buffered" and not directory.direct_io
        assert directory.create(TensorKey("off"), TensorMeta(torch.uint8, 10)).fd_direct is None
    finally:
        directory.close()


def test_direct_io_on(nvme_dir: Path) -> None:
    if probe_direct_io(nvme_dir):
        directory = NVMeDirectory(nvme_dir, 1 << 20, direct_io="on")
        assert directory.io_mode == "direct"
        directory.close()
    else:
        with pytest.raises(ValueError, match="refuses O_DIRECT"):
            NVMeDirectory(nvme_dir, 1 << 20, direct_io="on")
    NVMeDirectory(nvme_dir, 1 << 20).close()  # either way the lock was released


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="direct_io"):
        NVMeDirectory(tmp_path, 1 << 20, direct_io="yes")
    with pytest.raises(ValueError, match="block size"):
        NVMeDirectory(tmp_path, 1 << 20, block_nbytes=1000)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        NVMeDirectory(tmp_path / "missing", 1 << 20)


# ---- budget ---------------------------------------------------------------------------------------------
def test_budget_is_enforced_and_nothing_is_left_behind(nvme_dir: Path) -> None:
    meta = TensorMeta(torch.float32, 3000)  # 12000 bytes -> 4096 header + 12288 payload
    size = NVMeDirectory.file_size(meta)
    assert size == HEADER_NBYTES + 12288
    directory = NVMeDirectory(nvme_dir, 2 * size)
    try:
        directory.create(TensorKey("a"), meta)
        directory.create(TensorKey("b"), meta)  # exactly fits
        assert directory.used_nbytes == 2 * size and directory.free_nbytes == 0
        files = swap_files(nvme_dir)
        with pytest.raises(CapacityError) as info:
            directory.create(TensorKey("c"), TensorMeta(torch.uint8, 1))
        assert "nvme" in str(info.value) and "c" in str(info.value)
        assert directory.used_nbytes == 2 * size
        assert swap_files(nvme_dir) == files
        directory.remove(TensorKey("a"))
        assert directory.used_nbytes == size
        assert swap_files(nvme_dir) == [f"b{SUFFIX}"]
        directory.create(TensorKey("c"), meta)
    finally:
        directory.close()


def test_clashing_file_stems_are_refused(nvme: NVMeDirectory) -> None:
    """'a/b' and 'a__b' map to one file; the second create must not truncate the first one's data."""
    data = random_tensor(torch.uint8, 5000)
    first = nvme.create(TensorKey("a/b"), TensorMeta.of(data))
    nvme.write(first, data.clone())
    used = nvme.used_nbytes
    with pytest.raises(ValueError, match="same swap file"):
        nvme.create(TensorKey("a__b"), TensorMeta.of(data))
    assert nvme.used_nbytes == used
    out = torch.empty_like(data)
    nvme.read(first, out)
    assert torch.equal(out, data)


def test_close_keeps_or_removes_files(nvme_dir: Path) -> None:
    directory = NVMeDirectory(nvme_dir, 1 << 20)
    directory.create(TensorKey("kept"), TensorMeta(torch.uint8, 10))
    directory.close(remove_files=False)
    assert swap_files(nvme_dir) == [f"kept{SUFFIX}"]
    directory = NVMeDirectory(nvme_dir, 1 << 20)
    directory.create(TensorKey("kept"), TensorMeta(torch.uint8, 10))  # a leftover file is reused
    directory.close()
    assert swap_files(nvme_dir) == []
    with pytest.raises(RuntimeError, match="closed"):
        directory.create(TensorKey("x"), TensorMeta(torch.uint8, 1))


# ---- file modes -----------------------------------------------------------------------------------------
def test_files_are_0600_even_with_a_permissive_umask(nvme_dir: Path) -> None:
    stale = nvme_dir / f"old{SUFFIX}"
    stale.write_bytes(b"left over by an earlier run")
    os.chmod(stale, 0o666)
    old_umask = os.umask(0o000)
    try:
        directory = NVMeDirectory(nvme_dir, 1 << 20)
        try:
            fresh = directory.create(TensorKey("fresh"), TensorMeta(torch.float32, 10))
            reused = directory.create(TensorKey("old"), TensorMeta(torch.float32, 10))
            for path in (fresh.path, reused.path, nvme_dir / LOCK_NAME):
                mode = stat.S_IMODE(os.stat(path).st_mode)
                assert mode == 0o600, f"{path.name} has mode {mode:o}"
        finally:
            directory.close()
    finally:
        os.umask(old_umask)


# ---- corruption -----------------------------------------------------------------------------------------
def _written(nvme: NVMeDirectory, numel: int = 3000):
    data = random_tensor(torch.float32, numel, seed=11)
    key = TensorKey("block.1/weights")
    swap = nvme.create(key, TensorMeta.of(data))
    nvme.write(swap, as_bytes(data).clone(), step=9)
    return swap, data


@pytest.mark.parametrize("buffer", ["arena", "unaligned"])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_corrupt_payload_byte_is_detected(nvme: NVMeDirectory, where: str, buffer: str) -> None:
    swap, data = _written(nvme)
    nbytes = swap.meta.nbytes
    offset = HEADER_NBYTES + {"first": 0, "middle": nbytes // 2, "last": nbytes - 1}[where]
    flip_byte(swap.path, offset)
    keep: list = []
    out = _io_buffer(buffer, nbytes, keep)
    with pytest.raises(CorruptFileError, match="checksum") as info:
        nvme.read(swap, out)
    assert str(swap.path) in str(info.value) and info.value.path == str(swap.path)
    flip_byte(swap.path, offset)  # undone: the file reads again, so the flip was what was detected
    nvme.read(swap, out)
    assert torch.equal(out[:nbytes], as_bytes(data))
    for arena in keep:
        arena.close()


_FIELDS = {"magic": 0, "version": 8, "dtype": 12, "numel": 16, "nbytes": 24, "crc": 32, "step": 40, "keylen": 48}


@pytest.mark.parametrize("field", [*_FIELDS, "key", "header_crc"])
def test_corrupt_header_byte_is_detected(nvme: NVMeDirectory, field: str) -> None:
    swap, data = _written(nvme)
    offset = {**_FIELDS, "key": _HEADER_STRUCT.size + 3, "header_crc": _HEADER_STRUCT.size + len(swap.key.name)}[field]
    flip_byte(swap.path, offset)
    out = torch.empty(swap.meta.nbytes, dtype=torch.uint8)
    with pytest.raises(CorruptFileError) as info:
        nvme.read(swap, out)
    assert str(swap.path) in str(info.value)
    with pytest.raises(CorruptFileError):
        nvme.read_step(swap)
    flip_byte(swap.path, offset)
    nvme.read(swap, out)
    assert torch.equal(out, as_bytes(data)) and nvme.read_step(swap) == 9


def test_never_written_file_reads_as_corrupt(nvme: NVMeDirectory) -> None:
    swap = nvme.create(TensorKey("empty"), TensorMeta(torch.float32, 10))
    with pytest.raises(CorruptFileError, match="magic") as info:
        nvme.read(swap, torch.empty(40, dtype=torch.uint8))
    assert str(swap.path) in str(info.value)


def test_header_of_another_tensor_is_refused(nvme: NVMeDirectory) -> None:
    """A valid header that describes different meta (a file swapped in from another key) is corrupt."""
    a = nvme.create(TensorKey("a"), TensorMeta(torch.float32, 10))
    b = nvme.create(TensorKey("b"), TensorMeta(torch.float32, 10))
    nvme.write(a, torch.zeros(40, dtype=torch.uint8))
    with open(a.path, "rb") as f:
        header = f.read(HEADER_NBYTES)
    os.pwrite(b.fd_buffered, header, 0)
    with pytest.raises(CorruptFileError, match="expected b"):
        nvme.read(b, torch.empty(40, dtype=torch.uint8))


@pytest.mark.parametrize("buffer", ["arena", "unaligned"])
@pytest.mark.parametrize("cut", ["payload", "payload_aligned", "header"])
def test_truncated_file_names_file_and_offset(nvme: NVMeDirectory, cut: str, buffer: str) -> None:
    swap, _ = _written(nvme, numel=5000)  # 20000 payload bytes
    size = {"payload": HEADER_NBYTES + 1000, "payload_aligned": HEADER_NBYTES + 2 * IO_ALIGNMENT, "header": 100}[cut]
    os.truncate(swap.path, size)
    keep: list = []
    with pytest.raises(StoreIOError) as info:
        nvme.read(swap, _io_buffer(buffer, swap.meta.nbytes, keep))
    for arena in keep:
        arena.close()
    exc = info.value
    assert exc.path == str(swap.path) and str(swap.path) in str(exc)
    assert exc.offset == size and f"offset {size}" in str(exc)


# ---- locking --------------------------------------------------------------------------------------------
def test_second_directory_in_this_process_is_refused(nvme_dir: Path) -> None:
    first = NVMeDirectory(nvme_dir, 1 << 20)
    try:
        with pytest.raises(DirectoryLockedError) as info:
            NVMeDirectory(nvme_dir, 1 << 20)
        assert str(nvme_dir) in str(info.value) and str(os.getpid()) in str(info.value)
    finally:
        first.close()
    NVMeDirectory(nvme_dir, 1 << 20).close()  # released on close


def _try_lock(path: str, queue) -> None:  # runs in a forked child
    try:
        NVMeDirectory(path, 1 << 20).close()
        queue.put("locked")
    except DirectoryLockedError as exc:
        queue.put(f"refused: {exc}")


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_forked_child_is_refused(nvme_dir: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    first = NVMeDirectory(nvme_dir, 1 << 20)
    try:
        queue = ctx.Queue()
        child = ctx.Process(target=_try_lock, args=(str(nvme_dir), queue))
        child.start()
        result = queue.get(timeout=60)
        child.join(timeout=60)
        assert result.startswith("refused") and str(os.getpid()) in result
    finally:
        first.close()


@pytest.mark.slow
def test_other_process_is_refused_until_close(tmpfs_dir: Path) -> None:
    """A separate interpreter is refused while this process holds the directory, and gets it after close."""
    script = textwrap.dedent(
        f"""
        import sys
        from tierstore import DirectoryLockedError, NVMeDirectory
        for line in sys.stdin:
            try:
                NVMeDirectory({str(tmpfs_dir)!r}, 1 << 20).close()
                print("locked", flush=True)
            except DirectoryLockedError:
                print("refused", flush=True)
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[3]), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        first = NVMeDirectory(tmpfs_dir, 1 << 20)
        child.stdin.write("try\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "refused"
        first.close()
        child.stdin.write("try\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "locked"
    finally:
        child.stdin.close()
        child.wait(timeout=60)
    assert child.returncode == 0
