"""The checkpoint root's lock file lasts as long as the lock: ``close()`` removes it, as the swap directory's
``.tierstore.lock`` is removed (issue 41: it stayed in the user's checkpoint directory after every run)."""

from __future__ import annotations

import fcntl
import os
import stat
from pathlib import Path

import pytest

from runtime import CheckpointError, CheckpointRoot
from runtime.checkpoint.root import LOCK_NAME
from tierstore import DirectoryLockedError


def test_the_lock_file_is_private_while_held_and_gone_after_close(tmp_path: Path):
    root = tmp_path / "ckpt"
    with CheckpointRoot(root):
        assert sorted(os.listdir(root)) == [LOCK_NAME]
        assert stat.S_IMODE((root / LOCK_NAME).stat().st_mode) == 0o600
        with pytest.raises(DirectoryLockedError, match="in use|held by an object of this same process"):
            CheckpointRoot(root)  # held: a second run is refused
    assert os.listdir(root) == []
    with CheckpointRoot(root):  # and the root is free again: a new lock file, removed again
        assert os.listdir(root) == [LOCK_NAME]
    assert os.listdir(root) == []


def test_a_refused_root_leaves_no_lock_file(tmp_path: Path):
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "notes.txt").write_text("someone's file")
    with pytest.raises(CheckpointError, match="not empty"):
        CheckpointRoot(root)
    assert os.listdir(root) == ["notes.txt"]


def test_a_run_that_opened_the_lock_file_as_it_was_removed_does_not_lock_beside_the_next(tmp_path: Path):
    """Opened by a waiting run just before close() unlinked it: that run gets the lock of a file no longer at the
    name, which ``lock_file`` refuses, so it can never hold a lock while another run holds the file now there."""
    root = tmp_path / "ckpt"
    first = CheckpointRoot(root)
    late = os.open(root / LOCK_NAME, os.O_RDWR)  # the waiting run's open, before the holder lets go
    try:
        first.close()
        assert not (root / LOCK_NAME).exists()
        fcntl.flock(late, fcntl.LOCK_EX | fcntl.LOCK_NB)  # it gets the old inode's lock...
        with CheckpointRoot(root):  # ...but the next run locks the file now at the name
            assert (root / LOCK_NAME).exists()
            assert os.fstat(late).st_nlink == 0  # the late one's file is unlinked: lock_file's inode check refuses it
    finally:
        os.close(late)
