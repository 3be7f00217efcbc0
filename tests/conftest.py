"""Shared fixtures: the compute device (CUDA when present, else CPU), tmpfs and disk directories, gpu marker; failures
reported as they happen on request."""

from __future__ import annotations

import os
import signal
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With TIERSTORE_FAILURES_NOW set (tests/gpu_session.sh sets it), a failure's traceback is written as the test
    ends, not in pytest's summary: a device call cut by its time limit still brings back why a test failed."""
    if report.failed and os.environ.get("TIERSTORE_FAILURES_NOW"):
        sys.stderr.write(f"\n{report.nodeid} {report.when} FAILED:\n{report.longreprtext}\n")
        sys.stderr.flush()


@pytest.hookimpl(tryfirst=True)  # before -m selects: the slow marks given here count
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark slow the cases of a long parametrisation that its ``quick_cases`` mark leaves out; skip tests marked gpu
    when CUDA is absent (they run on the lent GPU machine)."""
    for item in items:
        quick = item.get_closest_marker("quick_cases")
        params = getattr(getattr(item, "callspec", None), "params", {})
        if quick is not None and not any(all(params.get(name) == value for name, value in case.items())
                                         for case in quick.args):
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA; run on the GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def device() -> torch.device:
    """The compute device: CUDA when available, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def default_sigint() -> Iterator[None]:
    """SIGINT at Python's default (KeyboardInterrupt) during the test, as an interactive run has it, and as before
    after it: offload() takes over only a signal left at its default, and pytest may start with SIGINT ignored
    (under nohup, or a CI runner that ignores it), where a test's own Ctrl-C would reach no handler."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture
def tmpfs_dir() -> Iterator[Path]:
    """A fresh directory on tmpfs (/dev/shm) where available, else the system temp dir."""
    root = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    with tempfile.TemporaryDirectory(prefix="tierstore-test-", dir=root) as path:
        yield Path(path)


@pytest.fixture
def disk_dir(tmp_path: Path) -> Path:
    """A directory on the ordinary disk (pytest's tmp_path)."""
    return tmp_path


@pytest.fixture(params=["tmpfs", "disk"])
def nvme_dir(request: pytest.FixtureRequest, tmpfs_dir: Path, disk_dir: Path) -> Path:
    """Both kinds of swap directory, so each NVMe test runs on tmpfs and on disk."""
    return tmpfs_dir if request.param == "tmpfs" else disk_dir
