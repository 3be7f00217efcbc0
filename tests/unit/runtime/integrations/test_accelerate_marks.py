"""With several processes ``offload()`` marks the model for accelerate and DDP (``runtime.session._reduced_here``):
prepared (accelerate >= 1.14 leaves it unwrapped), every parameter ignored by DDP (an older accelerate's DDP then
refuses it), an accelerate older than 1.14 named in a warning first, and the marks taken off at close."""

from __future__ import annotations

import importlib.metadata
import logging
import sys
import types

import pytest
import torch
from torch import nn

import runtime.session as session


@pytest.mark.parametrize(("installed", "warned"), [("1.13.2", True), ("1.14.0", False), ("2.0.1", False), (None, False)])
def test_the_marks_and_the_warning_about_an_old_accelerate(monkeypatch, caplog, installed, warned):
    if installed is None:
        monkeypatch.delitem(sys.modules, "accelerate", raising=False)
    else:
        monkeypatch.setitem(sys.modules, "accelerate", types.ModuleType("accelerate"))
        monkeypatch.setattr(importlib.metadata, "version", lambda name: installed)
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    with caplog.at_level(logging.WARNING, logger="runtime.session"):
        unmark = session._reduced_here(model)
    assert model._is_accelerate_prepared is True
    assert model._ddp_params_and_buffers_to_ignore == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert ("pip install 'accelerate>=1.14'" in caplog.text) == warned
    if warned:
        assert f"accelerate {installed} is installed" in caplog.text
    unmark()
    assert not hasattr(model, "_is_accelerate_prepared") and not hasattr(model, "_ddp_params_and_buffers_to_ignore")


def test_ddp_refuses_a_marked_model_instead_of_reducing_its_gradients_again():
    model = nn.Linear(2, 2)
    session._reduced_here(model)
    ddp = torch.nn.parallel.DistributedDataParallel
    with pytest.raises(RuntimeError, match="DistributedDataParallel is not needed"):
        ddp(model, process_group=_FakeGroup())


class _FakeGroup:
    """DDP refuses the module before it uses its process group."""
