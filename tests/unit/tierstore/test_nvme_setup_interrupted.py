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
