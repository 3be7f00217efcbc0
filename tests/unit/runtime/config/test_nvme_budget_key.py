"""An NVMe budget below one block is reported at the key the user wrote (issue 41), not at a default beside it."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.config.loader import ConfigError, load_config


def _refusal(tmp_path: Path, text: str) -> ConfigError:
    path = tmp_path / "tiers.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    return info.value


def test_a_budget_below_the_default_block_names_the_budget(tmp_path: Path) -> None:
    err = _refusal(tmp_path, "tiers:\n  nvme:\n    path: tmp\n    budget: 1MiB\n")
    assert (err.kind, err.yaml_path, err.line) == ("bad_value", "tiers.nvme.budget", 4), str(err)
    assert "tiers.nvme.budget: 1MiB is below one block of 64MiB (tiers.nvme.block_size, the default)" in str(err)


def test_both_written_points_at_the_block_as_before(tmp_path: Path) -> None:
    err = _refusal(tmp_path, "tiers:\n  nvme:\n    path: tmp\n    budget: 16MiB\n    block_size: 32MiB\n")
    assert (err.yaml_path, err.line) == ("tiers.nvme.block_size", 5), str(err)
    assert "32MiB is above the NVMe budget of 16MiB (tiers.nvme.budget)" in str(err)


def test_an_override_counts_as_written() -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"tiers": {"nvme": {"path": "tmp"}}}, overrides={"tiers.nvme.budget": "1MiB"})
    assert info.value.yaml_path == "tiers.nvme.budget", str(info.value)

