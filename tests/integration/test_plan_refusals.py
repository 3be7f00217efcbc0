"""``tierstore plan`` and ``tierstore train`` refuse the same configs with the same message, before training
allocates anything: both run ``runtime.session.plan_model`` (one shared check, one table of cases here).

Each row is a config (over a small base) that must be refused, and a phrase of the message; the RAM rows
replace this machine's memory with a fake one (a cgroup-limited container, a small box), as seen by both
commands. Training is run with a store that refuses to be built, so a refusal that came late would show.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from runtime.cli.main import main as cli_main
from runtime.planning.hostmem import HostMemory
from runtime.planning.memory_plan import MemoryPlan

GiB = 1 << 30
BASE: dict[str, Any] = {"dtype": "fp32", "optimizer": {"grad_clip": None},
                        "train": {"steps": 1, "batch_size": 2, "seq_len": 16, "log_every": 1}}
CGROUP = "cgroup v2 limit 4.00 GiB (memory.max of /sys/fs/cgroup/job)"


def in_container(plan: MemoryPlan) -> HostMemory:
    """A 4 GiB container on a large host with 2 GiB in use: 2 GiB available, all of it headroom."""
    return HostMemory(total_nbytes=4 * GiB, available_nbytes=2 * GiB, limit=CGROUP)


def swap_does_not_fit_in_ram(plan: MemoryPlan) -> HostMemory:
    """Room for the pinned arena and headroom, but not for the swap files on tmpfs too."""
    return HostMemory(total_nbytes=8 * GiB, available_nbytes=plan.host_nbytes + 2 * GiB + plan.nvme_nbytes // 2,
                      limit="a small box")


ROWS: list[tuple[str, dict[str, Any], str, Callable[[MemoryPlan], HostMemory] | None]] = [
    ("host budget under the plan", {"tiers": {"host": {"budget": "1MiB"}}}, "tiers.host.budget is 1.0 MiB", None),
    ("host budget over RAM", {"tiers": {"host": {"budget": "64TiB"}}}, "tiers.host.budget 64.00 TiB is more RAM", None),
    ("gpu budget under the plan", {"tiers": {"gpu": {"budget": "1MiB"}}}, "tiers.gpu.budget is 1.0 MiB", None),
    ("nvme budget", {"placement": {"moments": "nvme"},
                     "tiers": {"nvme": {"path": "tmp", "budget": "1MiB", "block_size": "64KiB"}}},
     "tiers.nvme.budget is 1.0 MiB", None),
    ("cgroup limit", {}, CGROUP, in_container),
    ("tmp swap is RAM", {"placement": {"moments": "nvme"}, "tiers": {"nvme": {"path": "tmp"}}}, "(tmpfs: RAM)",
     swap_does_not_fit_in_ram),
    # Refused by the schema, with the file's line (they were refused at run time, without one)
    ("delayed overlap", {"optimizer": {"overlap": "delayed"}}, "optimizer.overlap: expected one of `exact`", None),
    ("weights on nvme", {"placement": {"weights": "nvme"}, "tiers": {"nvme": {"path": "tmp"}}},
     "placement.weights: expected one of `auto`, `host`, `gpu`", None),
    ("master on the gpu", {"placement": {"master": "gpu"}}, "placement.master: expected one of `auto`, `host`, `nvme`",
     None),
    ("no CUDA", {"device": "cuda"}, "CUDA is not available", None),
]


def merged(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for key, value in extra.items():
        out[key] = {**out.get(key, {}), **value} if isinstance(value, dict) else value
    return out


def run(capsys, *argv: str) -> tuple[int, str]:
    """The CLI in this process: exit status and what it wrote to stderr from the error on."""
    code = cli_main(list(argv))
    err = capsys.readouterr().err
    return code, err[err.find("tierstore: error:"):] if "tierstore: error:" in err else err


@pytest.mark.parametrize("name,extra,phrase,memory", ROWS, ids=[row[0] for row in ROWS])
def test_plan_and_train_refuse_alike(name, extra, phrase, memory, tmp_path, capsys, monkeypatch):
    if name == "tmp swap is RAM":
        from runtime.planning.hostmem import ram_backed
        from tierstore import swap_tmp_root

        if ram_backed(swap_tmp_root()) is None:
            pytest.skip("the tmp swap path is not on tmpfs here")
    if name == "no CUDA" and torch.cuda.is_available():
        pytest.skip("CUDA is available")
    config = tmp_path / "tiers.yaml"
    config.write_text(yaml.safe_dump(merged(BASE, extra)))
    if memory is not None:
        monkeypatch.setattr("runtime.planning.memory_plan.host_memory", lambda: memory(_plan_of(config)))

    def no_store(*args: object, **kwargs: object) -> None:
        raise AssertionError("training built a store for a config its plan refuses")

    monkeypatch.setattr("runtime.session.TierStore", no_store)
    plan_code, plan_err = run(capsys, "plan", "--config", str(config))
    train_code, train_err = run(capsys, "train", "--config", str(config))
    assert (plan_code, train_code) == (2, 2), (plan_err, train_err)
    assert phrase in plan_err
    # The same check, the same words; the RAM available now may move by a few MiB between the two calls.
    assert without_ram_figures(train_err) == without_ram_figures(plan_err)


def without_ram_figures(message: str) -> str:
    """The message with its GiB figures blanked out: the RAM this process may use moves from one call to the next."""
    return re.sub(r"\d+\.\d+ GiB", "_ GiB", message)


def test_a_config_that_fits_is_passed_by_both(tmp_path, capsys):
    config = tmp_path / "tiers.yaml"
    config.write_text(yaml.safe_dump(merged(BASE, {"placement": {"moments": "nvme"}, "tiers": {"nvme": {"path": "tmp"}}})))
    assert cli_main(["plan", "--config", str(config)]) == 0
    assert "the plan fits this machine" in capsys.readouterr().out
    assert cli_main(["train", "--config", str(config)]) == 0


def _plan_of(config: Path) -> MemoryPlan:
    """The plan the CLI computes for a config file (its example model, on the meta device)."""
    from runtime.cli.train import build_model
    from runtime.config.loader import load_config
    from runtime.core.blocks import build_blocks
    from runtime.planning.placement import resolve_plan
    from runtime.planning.settings import resolve_device

    cfg = load_config(config)
    with torch.device("meta"):
        blocks = build_blocks(build_model(cfg), cfg.blocks.min_block_size)
    return resolve_plan(blocks, cfg, resolve_device(cfg)).plan
