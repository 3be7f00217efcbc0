"""`tierstore bench store` runs every path and reports store and raw figures for the same bytes."""

from __future__ import annotations

import json

import pytest

from runtime.bench.store_bench import run_store_bench
from runtime.cli.main import main


def test_store_bench_measures_every_path(tmpfs_dir):
    results = run_store_bench(str(tmpfs_dir), total_nbytes=8 << 20, transfer_nbytes=1 << 20, repeats=1)
    assert [r.path for r in results] == ["host->gpu", "gpu->host", "nvme->host", "host->nvme"]
    for r in results:
        assert r.nbytes == 8 << 20
        assert r.store_s > 0 and r.raw_s > 0 and r.ratio > 0
    assert not list(tmpfs_dir.glob("*.tsw")) and not (tmpfs_dir / "bench.dd.raw").exists()  # nothing left behind


def test_store_bench_cli_writes_json(tmpfs_dir, capsys):
    out = tmpfs_dir / "bench.json"
    assert main(["bench", "store", "--nvme-dir", str(tmpfs_dir), "--total", "4MiB", "--transfer", "1MiB",
                 "--repeats", "1", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "store/raw" in printed and "nvme->host" in printed
    assert "8 x 512KiB in flight" in printed and "single stream (dd" in printed and "not the ceiling" in printed
    data = json.loads(out.read_text())
    assert {r["path"] for r in data["results"]} == {"host->gpu", "gpu->host", "nvme->host", "host->nvme"}
    assert data["single_stream"]["read_gbps"] > 0 and "1 stream" in data["single_stream"]["method"]


def test_disk_ceiling_is_the_parallel_probe(tmpfs_dir, monkeypatch):
    """The ratios use the disk ceiling with several IOs in flight over the store's bytes, not dd's one stream."""
    from runtime.bench import store_bench
    from runtime.profiler.ceilings import DiskCeiling

    calls = []

    def fake(directory, **kwargs):
        calls.append(kwargs)
        return DiskCeiling(read_gbps=2.0, write_gbps=1.0, io_mode="direct", ios_in_flight=kwargs["ios_in_flight"],
                           block_nbytes=1 << 20, nbytes=kwargs["total_nbytes"])

    monkeypatch.setattr(store_bench, "measure_disk_ceiling", fake)
    results = run_store_bench(str(tmpfs_dir), total_nbytes=4 << 20, transfer_nbytes=1 << 20, repeats=1, ceiling_ios=6)
    read, write = results[2:]
    assert calls[0]["ios_in_flight"] == 6 and calls[0]["total_nbytes"] == 4 << 20
    assert read.raw_gbps == pytest.approx(2.0) and write.raw_gbps == pytest.approx(1.0)
    assert read.raw_method.startswith("6 x")


def test_dd_file_never_written_through_a_planted_link(tmpfs_dir, tmp_path):
    """dd opens its output by name, following links: it writes in a private directory of its own instead."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"someone else's file\n")
    (tmpfs_dir / "bench.dd.raw").symlink_to(victim)
    run_store_bench(str(tmpfs_dir), total_nbytes=2 << 20, transfer_nbytes=1 << 20, repeats=1)
    assert victim.read_bytes() == b"someone else's file\n"
    assert sorted(p.name for p in tmpfs_dir.iterdir() if not p.name.endswith(".lock")) == ["bench.dd.raw"]
