"""`tierstore bench store` runs every path and reports store and raw figures for the same bytes."""

from __future__ import annotations

import json

from runtime.bench.store_bench import run_store_bench
from runtime.cli import main


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
    data = json.loads(out.read_text())
    assert {r["path"] for r in data["results"]} == {"host->gpu", "gpu->host", "nvme->host", "host->nvme"}


def test_dd_file_never_written_through_a_planted_link(tmpfs_dir, tmp_path):
    """dd opens its output by name, following links: it writes in a private directory of its own instead."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"someone else's file\n")
    (tmpfs_dir / "bench.dd.raw").symlink_to(victim)
    run_store_bench(str(tmpfs_dir), total_nbytes=2 << 20, transfer_nbytes=1 << 20, repeats=1)
    assert victim.read_bytes() == b"someone else's file\n"
    assert sorted(p.name for p in tmpfs_dir.iterdir() if not p.name.endswith(".lock")) == ["bench.dd.raw"]
