"""``tierstore bench train`` rows with compact Adam moments: -bf16m / -int8m set optimizer.moment_dtype (issue 43)."""

from __future__ import annotations

from runtime.bench.train_rows import describe_row, row_config, row_errors
from runtime.config.loader import load_config


def test_moment_suffixes_set_the_moment_dtype():
    for suffix, moment_dtype in (("-bf16m", "bf16"), ("-int8m", "int8")):
        for row in (f"host-clip{suffix}", f"nvme-auto{suffix}", f"host{suffix}-auto-t8"):
            assert not row_errors([row]), row
            config = row_config(row, "/nonexistent")
            assert config["optimizer"]["moment_dtype"] == moment_dtype
            assert f"{moment_dtype} moments" in describe_row(row)
    assert "moment_dtype" not in row_config("host-clip", None)["optimizer"]  # fp32, the default
    load_config(row_config("host-clip-int8m", None))  # a config the loader takes: no GPU update share above 0


def test_moment_suffixes_refuse_a_gpu_update_share_and_two_formats():
    assert "on the CPU" in row_errors(["host-f30-int8m"])[0]
    assert "on the CPU" in row_errors(["host-s20-bf16m"])[0]
    assert row_errors(["host-bf16m-int8m"])
    assert row_errors(["torch-int8m"])  # plain PyTorch rows take -clip and -ckpt only
