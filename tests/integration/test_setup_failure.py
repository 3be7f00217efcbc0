"""Failures that leave the user's data behind: an ``offload()`` that fails or is interrupted part-way through its
setup gives the model back as it was (and the directory, the threads, the original error); ``close()`` after the
optimizer worker failed hands back the masters it can and names the rest.
"""

from __future__ import annotations

import errno
import logging
import threading

import pytest
import torch

import runtime.engine.controller
import runtime.session
from runtime import offload
from tests.integration.test_parity import make_batches
from tests.integration.test_user_contract import config, fresh_model, offloaded_step, plain_model, plain_step
from tierstore.nvme import HEADER_NBYTES, SUFFIX, NVMeDirectory

SWAP_FILES = 15  # the tiny model's 5 blocks times master and two moments, all on NVMe (config())


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def assert_given_back(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> None:
    """Every parameter a plain one again, with its original values (bit for bit), shape, device and dtype."""
    for name, p in model.named_parameters():
        assert type(p) is torch.nn.Parameter, name
        assert (p.shape, p.dtype, p.device) == (before[name].shape, before[name].dtype, before[name].device), name
        assert torch.equal(p.detach(), before[name]), name


def assert_released(tmp_path, threads_before: set[threading.Thread]) -> None:
    """No swap file left, the directory unlocked (a new session opens it) and no thread of the session alive."""
    assert not list((tmp_path / "swap").glob("*.tsw"))
    assert {t for t in threading.enumerate() if t.is_alive()} <= threads_before
    _, optimizer = offload(fresh_model(seed=1), config(tmp_path))
    optimizer.session.close()


class Planted(KeyboardInterrupt):
    """The interrupt the tests plant (a KeyboardInterrupt: no ``except Exception`` may swallow it)."""


@pytest.mark.parametrize("fail_at", range(1, SWAP_FILES + 1))
@pytest.mark.quick_cases({"fail_at": 1}, {"fail_at": 8}, {"fail_at": SWAP_FILES})
def test_a_disk_filling_during_setup_gives_the_model_back(tmp_path, monkeypatch, fail_at):
    """ENOSPC at the n-th swap file's create, as posix_fallocate reports a disk filling: every parameter comes
    back and the error raised is that one (the give-back once fetched every NVMe master into the host tier and
    raised CapacityError instead, and emptied the parameters of the block being registered)."""
    real_create, created = NVMeDirectory.create, []

    def create(self, key, meta):
        created.append(key)
        if len(created) == fail_at:
            raise OSError(errno.ENOSPC, "No space left on device (planted)")
        return real_create(self, key, meta)

    model, threads = fresh_model(), set(threading.enumerate())
    before = snapshot(model)
    monkeypatch.setattr(NVMeDirectory, "create", create)
    with pytest.raises(OSError, match="planted") as raised:
        offload(model, config(tmp_path))
    assert raised.value.errno == errno.ENOSPC
    monkeypatch.setattr(NVMeDirectory, "create", real_create)
    assert len(created) == fail_at
    assert_given_back(model, before)
    assert_released(tmp_path, threads)


@pytest.mark.parametrize("where", [
    (runtime.engine.controller, "GradClipper"),  # in the controller's setup, its optimizer worker started
    (runtime.session, "OffloadAdamW"),  # the hooks and the parameter guard installed
    (runtime.session, "_listen"),  # the last step: the session is whole
])
def test_an_interrupt_during_setup_gives_the_model_back(tmp_path, monkeypatch, where):
    """Ctrl-C at the setup's later steps: the model, the directory and the threads as they were, and the
    KeyboardInterrupt raised (a worker thread once stayed alive, and an interrupt past the setup's try left the
    session open with nothing to close it)."""
    module, name = where

    def interrupt(*args, **kwargs):
        raise Planted()

    model, threads = fresh_model(), set(threading.enumerate())
    before = snapshot(model)
    monkeypatch.setattr(module, name, interrupt)
    with pytest.raises(Planted):
        offload(model, config(tmp_path))
    monkeypatch.undo()
    assert_given_back(model, before)
    assert_released(tmp_path, threads)
    model(*make_batches(1)[0]).backward()  # an ordinary module again


def test_a_failing_cleanup_step_does_not_hide_the_setup_error(tmp_path, monkeypatch, caplog):
    """A step of the undo that fails is logged; the others run (the store still closes) and the setup's own error
    is what offload() raises."""

    def interrupt(*args, **kwargs):
        raise Planted()

    def remove(self):
        raise RuntimeError("the hooks would not come off (planted)")

    model, threads = fresh_model(), set(threading.enumerate())
    before = snapshot(model)
    monkeypatch.setattr(runtime.session, "OffloadAdamW", interrupt)
    monkeypatch.setattr(runtime.session.HookSet, "remove", remove)
    with caplog.at_level(logging.ERROR, logger="runtime.session"), pytest.raises(Planted):
        offload(model, config(tmp_path))
    monkeypatch.undo()
    assert "would not come off" in caplog.text
    assert_given_back(model, before)
    assert_released(tmp_path, threads)


def test_close_after_the_worker_failed_hands_back_the_intact_masters(tmp_path, caplog):
    """A moment's swap file corrupted mid-run fails one block's update: close() hands back every master, each at the
    step its last finished update left it, and names in a warning the parameters not at the committed step (it
    once left every parameter on the meta device and deleted the swap files, saying nothing)."""
    batches = make_batches(3)
    plain, plain_opt = plain_model()
    model, optimizer = offload(fresh_model(), config(tmp_path, grad_clip=1.0))  # updates run after the commit
    for batch in batches[:2]:
        plain_step(plain, plain_opt, batch, clip=1.0)
        offloaded_step(model, optimizer, batch)
    step2 = snapshot(model)
    plain_step(plain, plain_opt, batches[2], clip=1.0)
    step3 = snapshot(plain)
    swap = tmp_path / "swap" / f"block2.exp_avg{SUFFIX}"
    with open(swap, "r+b") as file:  # one payload byte flipped: the block's update fails on its checksum
        file.seek(HEADER_NBYTES + 17)
        byte = file.read(1)
        file.seek(HEADER_NBYTES + 17)
        file.write(bytes([byte[0] ^ 0xFF]))
    offloaded_step(model, optimizer, batches[2])  # committed; the update fails on the worker
    with pytest.raises(RuntimeError, match="optimizer worker failed"):
        model.state_dict()
    with caplog.at_level(logging.WARNING, logger="runtime.session"), \
            pytest.raises(RuntimeError, match="optimizer worker had failed; the parameters were given back"):
        optimizer.session.close()  # raised once given back: a last step's failure would be reported nowhere else
    warned = [r.getMessage() for r in caplog.records if "optimizer worker had failed" in r.getMessage()]
    assert len(warned) == 1
    failed = {name for name in step2 if name.startswith("layers.1.")}  # block 2: the embedding is block 0
    for name, p in model.named_parameters():
        assert type(p) is torch.nn.Parameter and not p.is_meta, name
        if f"  {name}: given back at step 2" in warned[0]:
            assert torch.equal(p.detach(), step2[name]), name
        else:
            assert name not in failed and torch.equal(p.detach(), step3[name]), name
    assert all(f"  {name}: given back at step 2" in warned[0] for name in failed)



def test_several_processes_without_a_launcher_are_refused_and_the_model_given_back(tmp_path, monkeypatch):
    """WORLD_SIZE asks for several processes but nothing says how to reach them (no RANK / MASTER_ADDR /
    MASTER_PORT, no process group): refused, naming what to run, with the model as it was. (Several processes that
    do join train with DDP's result: tests/integration/test_ranks.py.)"""
    for name in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    model, threads = fresh_model(), set(threading.enumerate())
    before = snapshot(model)
    with pytest.raises(ValueError, match="WORLD_SIZE=2 asks for several processes") as refused:
        offload(model, config(tmp_path))
    assert "torchrun --nproc-per-node N" in str(refused.value)
    assert_given_back(model, before)
    monkeypatch.setenv("WORLD_SIZE", "1")  # torchrun with one process: an ordinary run (assert_released offloads)
    assert_released(tmp_path, threads)
