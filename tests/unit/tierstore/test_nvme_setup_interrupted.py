"""An NVMeDirectory whose setup is cut short after it took the directory's lock (the O_DIRECT probe interrupted by
SIGTERM or Ctrl-C, or failing) leaves the directory as found: no lock file, no probe file, and the lock free
(issue 41: found by the SIGTERM sweep of tests/integration/test_sigterm_setup.py, which left ``.tierstore.lock``
in the user's swap directory when the signal landed in the probe)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import tierstore.nvme
from tierstore import NVMeDirectory


class Planted(KeyboardInterrupt):
    """The interrupt the test plants (a BaseException, as SIGTERM's Terminated and Ctrl-C's KeyboardInterrupt are)."""


@pytest.mark.parametrize("failure", [Planted, OSError])
def test_a_probe_cut_short_leaves_the_directory_as_found(tmp_path: Path, monkeypatch, failure):
    real_probe = tierstore.nvme.probe_direct_io

    def probe(directory, *, dir_fd=None):
        assert sorted(os.listdir(directory)) == [tierstore.nvme.LOCK_NAME]  # taken before the probe
        raise failure("planted")

    monkeypatch.setattr(tierstore.nvme, "probe_direct_io", probe)
    with pytest.raises(failure, match="planted"):
        NVMeDirectory(tmp_path, 1 << 20)
    assert os.listdir(tmp_path) == []
    monkeypatch.setattr(tierstore.nvme, "probe_direct_io", real_probe)
    NVMeDirectory(tmp_path, 1 << 20).close()  # the lock is free
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("where", ["posix_fallocate", "_reopen_direct", "SwapFile"])
def test_a_swap_file_cut_short_as_it_is_created_is_removed(tmp_path: Path, monkeypatch, where):
    """An interrupt while a swap file is created (SIGTERM's exception lands between any two calls of the main thread)
    removes the file and gives its bytes back (the SIGTERM sweep left ``block3.exp_avg.tsw`` when it landed in the
    O_DIRECT reopen: only an OSError was undone there)."""
    import torch

    from tierstore import TensorKey, TensorMeta

    directory = NVMeDirectory(tmp_path, 1 << 24)
    try:
        def planted(*args, **kwargs):
            raise Planted("planted")

        if where == "posix_fallocate":
            monkeypatch.setattr(tierstore.nvme.os, "posix_fallocate", planted)
        elif where == "_reopen_direct":
            monkeypatch.setattr(NVMeDirectory, "_reopen_direct", planted)
            monkeypatch.setattr(directory, "direct_io", True)
        else:
            monkeypatch.setattr(tierstore.nvme, "SwapFile", planted)
        with pytest.raises(Planted, match="planted"):
            directory.create(TensorKey("block3.exp_avg"), TensorMeta(torch.float32, 1000))
        monkeypatch.undo()
        assert [name for name in os.listdir(tmp_path) if name.endswith(tierstore.nvme.SUFFIX)] == []
        assert directory.used_nbytes == 0
        directory.create(TensorKey("block3.exp_avg"), TensorMeta(torch.float32, 1000))  # the key is free again
    finally:
        directory.close()
