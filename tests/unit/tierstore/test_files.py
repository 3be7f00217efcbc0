"""Attacks on the swap directory: links planted at every name the store creates, directories others can
write to, a rolled-back swap file, and the helpers in tierstore.files."""

from __future__ import annotations

import fcntl
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch

from tests.unit.tierstore.tensors import as_bytes, random_tensor
from tierstore import CorruptFileError, DirectoryLockedError, NVMeDirectory, StoreConfig, TierStore, UnsafeDirectoryError
from tierstore.files import create_new, lock_file, shared_directory_problem
from tierstore.keys import TensorMeta
from tierstore.nvme import LOCK_NAME, PROBE_NAME, SUFFIX

VICTIM_TEXT = b"a file of someone else's that must survive\n"


def plant_links(directory: Path, names: list[str], victims: Path) -> dict[Path, Path]:
    """A symlink at each name, each pointing at its own victim file; returns link -> victim."""
    victims.mkdir(exist_ok=True)
    planted = {}
    for i, name in enumerate(names):
        victim = victims / f"victim{i}"
        victim.write_bytes(VICTIM_TEXT)
        victim.chmod(0o644)
        (directory / name).symlink_to(victim)
        planted[directory / name] = victim
    return planted


def assert_victims_unchanged(planted: dict[Path, Path]) -> None:
    for link, victim in planted.items():
        assert victim.read_bytes() == VICTIM_TEXT, f"{victim} was written through {link.name}"
        assert stat.S_IMODE(victim.stat().st_mode) == 0o644, f"{victim} was chmodded through {link.name}"


def test_links_at_every_swap_name_are_never_written_through(nvme_dir: Path, tmp_path: Path) -> None:
    """Links planted at the lock file, the O_DIRECT probe and every swap file a session creates: a whole
    store life (register on NVMe, write back, read, close) leaves every victim byte for byte unchanged."""
    keys = [f"block{i}.exp_avg" for i in range(3)]
    planted = plant_links(nvme_dir, [PROBE_NAME] + [f"{k}{SUFFIX}" for k in keys], tmp_path / "victims")
    lock_link = plant_links(nvme_dir, [LOCK_NAME], tmp_path / "victims-lock")
    # The lock file is reopened by name (it outlives runs), so a link there is refused, not replaced.
    with pytest.raises(DirectoryLockedError, match=r"lock file \.tierstore\.lock is a symbolic link"):
        TierStore(StoreConfig(device="cpu", host_budget_nbytes=4 << 20, nvme_path=str(nvme_dir)))
    assert_victims_unchanged(lock_link)
    (nvme_dir / LOCK_NAME).unlink()
    with TierStore(StoreConfig(device="cpu", host_budget_nbytes=4 << 20, nvme_path=str(nvme_dir))) as store:
        for i, key in enumerate(keys):
            data = random_tensor(torch.float32, 1000, seed=i)
            store.register(key, TensorMeta.of(data), "nvme", init=data)
            store.fetch(key, "host").wait()
            store.mark_dirty(key, "host", step=1)
            store.evict(key, "host").wait()
            store.fetch(key, "host").wait()
            assert torch.equal(as_bytes(store.tensor(key, "host")), as_bytes(data))
            assert not (nvme_dir / f"{key}{SUFFIX}").is_symlink()  # the link was replaced by our own file
    assert_victims_unchanged(planted)


def test_hard_linked_lock_file_is_refused(nvme_dir: Path, tmp_path: Path) -> None:
    victim = nvme_dir / "victim"
    victim.write_bytes(VICTIM_TEXT)
    os.link(victim, nvme_dir / LOCK_NAME)
    with pytest.raises(DirectoryLockedError, match="one link"):
        NVMeDirectory(nvme_dir, 1 << 20)
    assert victim.read_bytes() == VICTIM_TEXT


@pytest.mark.parametrize("mode", [0o2775, 0o1777, 0o0777, 0o0770])
def test_directory_others_can_write_is_refused(tmp_path: Path, mode: int) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(mode)
    with pytest.raises(UnsafeDirectoryError, match=rf"mode {mode:04o}.*tiers\.nvme\.path"):
        NVMeDirectory(shared, 1 << 20)
    assert list(shared.iterdir()) == []  # refused before anything was created, the lock file included
    private = shared / "mine"
    private.mkdir(mode=0o700)  # a private subdirectory of ours inside it is fine
    NVMeDirectory(private, 1 << 20).close()


def test_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, os.geteuid() + 1, -1) if os.geteuid() == 0 else pytest.skip("needs root to give a directory away")
    with pytest.raises(UnsafeDirectoryError, match="belongs to uid"):
        NVMeDirectory(theirs, 1 << 20)


def test_tmp_swap_directory_is_private(tmp_path: Path) -> None:
    with TierStore(StoreConfig(device="cpu", host_budget_nbytes=1 << 20, nvme_path="tmp")) as store:
        path = store.tiers["nvme"].directory.path
        assert shared_directory_problem(path.stat()) is None and stat.S_IMODE(path.stat().st_mode) == 0o700


# ---- stale state ----------------------------------------------------------------------------------------
def test_rolled_back_swap_file_is_refused_naming_it(nvme_dir: Path, tmp_path: Path) -> None:
    """Step 2's file copied aside, step 3 written, step 2's file put back (header and checksum intact):
    the next read refuses it instead of handing out step 2's moments as step 3's."""
    with TierStore(StoreConfig(device="cpu", host_budget_nbytes=4 << 20, nvme_path=str(nvme_dir))) as store:
        old, new = random_tensor(torch.float32, 2000, seed=2), random_tensor(torch.float32, 2000, seed=3)
        store.register("m", TensorMeta.of(old), "nvme", init=old)
        path = nvme_dir / f"m{SUFFIX}"
        for step, value in ((2, old), (3, new)):
            store.fetch("m", "host").wait()
            store.tensor("m", "host").view(torch.uint8).copy_(as_bytes(value))
            store.mark_dirty("m", "host", step=step)
            store.evict("m", "host").wait()
            if step == 2:
                shutil.copyfile(path, tmp_path / "step2.tsw")
        store.fetch("m", "host").wait()  # step 3's own file reads fine
        assert torch.equal(as_bytes(store.tensor("m", "host")), as_bytes(new))
        store.release("m", "host")
        with open(path, "r+b") as f:  # in place: the store's descriptors still point at this inode
            f.write((tmp_path / "step2.tsw").read_bytes())
        with pytest.raises(CorruptFileError, match=rf"m{SUFFIX} is corrupt: header records step 2, but the store expects step 3"):
            store.fetch("m", "host").wait()


# ---- helpers --------------------------------------------------------------------------------------------
def test_create_new_never_follows_or_reuses(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(VICTIM_TEXT)
    (tmp_path / "link").symlink_to(victim)
    with pytest.raises(FileExistsError):
        create_new(tmp_path / "link")
    fd = create_new(tmp_path / "link", replace_stale=True)  # the link goes, the victim stays
    os.close(fd)
    assert victim.read_bytes() == VICTIM_TEXT and not (tmp_path / "link").is_symlink()
    old = os.umask(0)
    try:
        os.close(create_new(tmp_path / "fresh"))
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "fresh").stat().st_mode) == 0o600


def test_lock_file_is_exclusive_and_names_the_holder(tmp_path: Path) -> None:
    fd = lock_file(tmp_path / "lock", "the thing", "Use another one.")
    try:
        # Held in this very process: the message says so (a notebook cell run again), not 'another run'.
        with pytest.raises(DirectoryLockedError, match=rf"the thing is held by an object of this same process \(pid "
                                                       rf"{os.getpid()} .*never closed.*Use another one"):
            lock_file(tmp_path / "lock", "the thing", "Use another one.")
        os.pwrite(fd, b"1 otherhost", 0)  # as another process's lock file reads
        with pytest.raises(DirectoryLockedError, match=r"the thing is in use by another run \(pid 1 otherhost\)\. Use another one"):
            lock_file(tmp_path / "lock", "the thing", "Use another one.")
    finally:
        os.close(fd)
    os.close(lock_file(tmp_path / "lock", "the thing", "Use another one."))  # released with its descriptor


def test_a_closed_swap_directory_keeps_no_lock_file(nvme_dir: Path) -> None:
    """The user's directory is left as found: the lock file stayed behind after every session."""
    directory = NVMeDirectory(nvme_dir, 1 << 20)
    assert (nvme_dir / LOCK_NAME).exists()
    directory.close()
    assert not (nvme_dir / LOCK_NAME).exists()
    NVMeDirectory(nvme_dir, 1 << 20).close()  # and the next run takes it as before


def test_a_lock_taken_on_a_file_its_holder_just_unlinked_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Between our open and our flock the holder unlinks the file and lets go (unlink_lock_file): the lock we then
    get is on a file no longer at that name, and a third run would lock the new one beside us."""
    name = tmp_path / "dir.lock"
    real_flock = fcntl.flock

    def holder_lets_go_first(fd: int, operation: int) -> None:
        if operation & fcntl.LOCK_EX and name.exists():
            name.unlink()  # the holder's release
            name.write_text("")  # a third run creates the name anew (and would lock it)
        real_flock(fd, operation)

    monkeypatch.setattr("tierstore.files.fcntl.flock", holder_lets_go_first)
    with pytest.raises(DirectoryLockedError, match="being released"):
        lock_file(name, "the directory", "")
