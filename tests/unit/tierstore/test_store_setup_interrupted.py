"""A store whose construction is cut short after its swap directory was opened (a signal or an error as its tiers
are assembled or as it registers for exit) leaves the directory as found, and one built whole is closed at exit
(issue 41: the directory's lock file stayed, since the undo never closed the NVMe tier, and a signal landing as the
store registered for exit left a store nothing closed)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import tierstore.store as store_module
from tierstore import StoreConfig, TierStore


class Planted(KeyboardInterrupt):
    """The interrupt the test plants (a BaseException, as SIGTERM's Terminated and Ctrl-C's KeyboardInterrupt are)."""


@pytest.mark.parametrize("where", ["Tiers", "close_at_exit"])
def test_a_store_cut_short_after_opening_its_swap_directory_leaves_it_as_found(tmp_path: Path, monkeypatch, where):
    def interrupt(*args, **kwargs):
        assert os.listdir(tmp_path), "the swap directory is not open yet: this test would prove nothing"
        raise Planted()

    monkeypatch.setattr(store_module, where, interrupt)
    with pytest.raises(Planted):
        TierStore(StoreConfig(nvme_path=str(tmp_path), host_budget_nbytes=4096))
    assert os.listdir(tmp_path) == []
    monkeypatch.undo()
    TierStore(StoreConfig(nvme_path=str(tmp_path), host_budget_nbytes=4096)).close()  # the directory is free
    assert os.listdir(tmp_path) == []


def test_a_store_undone_after_it_registered_for_exit_is_not_closed_again_there(tmp_path: Path, monkeypatch):
    """The exit hook is registered before the undo is let go: undone after all, the store counts as closed."""
    registered: list[TierStore] = []

    def register_then_interrupt(obj, close):
        registered.append(obj)
        raise Planted()

    monkeypatch.setattr(store_module, "close_at_exit", register_then_interrupt)
    with pytest.raises(Planted):
        TierStore(StoreConfig(nvme_path=str(tmp_path), host_budget_nbytes=4096))
    assert registered and registered[0].closed
    registered[0].close()  # what the exit hook would do: nothing
    assert os.listdir(tmp_path) == []
