"""The profiler's advice with Adam moments on NVMe: fp32 moments get the compact formats suggested, a run with compact
moments does not get them again; a GPU update fraction is advised with the device bytes of its format (issue 43)."""

from __future__ import annotations

from typing import Any

import pytest

from runtime.profiler.advice import advise
from tests.unit.runtime.profiler.test_profiler import META, _steady


def _summary(moment_dtype: str | None) -> dict[str, Any]:
    config = dict(META["config"])
    if moment_dtype is not None:  # profiles that predate compact moments have no such key: fp32
        config["moment_dtype"] = moment_dtype
    return {**META, "config": config, "totals": {"paths": {}},
            "steady": _steady(update=0.4, inputs=0.3, by_block={"0": 0.35, "3": 0.05})}


@pytest.mark.parametrize("moment_dtype", [None, "fp32"])
def test_fp32_moments_on_nvme_get_compact_moments_suggested(moment_dtype):
    advice = advise(_summary(moment_dtype))
    compact = next(a for a in advice if "optimizer.moment_dtype: bf16" in a["change"])
    assert compact["saves_s"] == pytest.approx(0.15)  # half the bytes read from NVMe: half the input wait
    assert "approximate" in compact["change"]
    assert any("gpu_update_fraction" in a["change"] for a in advice)


@pytest.mark.parametrize("moment_dtype", ["bf16", "int8"])
def test_compact_moments_are_not_suggested_again_and_their_device_bytes_are_smaller(moment_dtype):
    advice = advise(_summary(moment_dtype))
    changes = [a["change"] for a in advice]
    assert not any("moment_dtype" in c for c in changes)
    assert any(c.startswith("move placement.moments from nvme to host") for c in changes)  # the rest stays
    ours = next(a for a in advice if "gpu_update_fraction" in a["change"])["change"]
    theirs = next(a for a in advise(_summary("fp32")) if "gpu_update_fraction" in a["change"])["change"]
    assert ours != theirs  # the same blocks need less device memory with compact moments ("needs about ...")
