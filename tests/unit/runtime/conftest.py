"""Fixtures shared by the runtime's unit tests of several packages (checkpoint, bench)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from runtime.bundled.data import ByteBatches
from runtime.session import OffloadSession
from tests.unit.runtime.checkpoint.sessions import CORPUS, make_session, step


@pytest.fixture
def trained(tmp_path: Path) -> Iterator[tuple[torch.nn.Module, object, OffloadSession, ByteBatches]]:
    """A session two steps in, moments in swap files, master in host memory."""
    (tmp_path / "swap").mkdir()
    model, optimizer, session = make_session(tmp_path / "swap", moments="nvme")
    data = ByteBatches(CORPUS, 2, 16, seed=0)
    step(model, optimizer, data, 2)
    yield model, optimizer, session, data
    session.close()
