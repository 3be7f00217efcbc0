"""tierstore bench store --disk-sweep: every grid point measured with the IO size it names, and a table that says
which settings read and write fastest."""

from __future__ import annotations

from runtime.bench.disk_sweep import disk_sweep, format_disk_sweep
from runtime.cli.main import main


def test_every_point_of_the_grid_moves_its_own_io_size(tmp_path):
    points = disk_sweep(str(tmp_path), ios_in_flight=(1, 4), block_nbytes=(64 << 10, 256 << 10), total_nbytes=256 << 10,
                        repeats=1)
    assert [(p.ios_in_flight, p.block_nbytes) for p in points] == [(1, 64 << 10), (4, 64 << 10), (1, 256 << 10), (4, 256 << 10)]
    assert all(p.read_gbps > 0 and p.write_gbps > 0 for p in points)
    table = format_disk_sweep(points, str(tmp_path)).splitlines()
    assert table[1].split() == ["block_size", "1", "4"]
    assert table[2].startswith("64KiB") and table[3].startswith("256KiB")
    best = max(points, key=lambda p: p.read_gbps)
    assert f"fastest read {best.read_gbps:.2f} GB/s at io_threads: {best.ios_in_flight}" in table[-1]
    assert not list(tmp_path.iterdir())  # the probes' private subdirectories are gone


def test_the_sweep_needs_the_swap_directory(capsys):
    assert main(["bench", "store", "--disk-sweep"]) != 0
    assert "--disk-sweep measures the disk of --nvme-dir" in capsys.readouterr().err


def test_the_sweep_writes_json_when_asked(tmp_path, capsys, monkeypatch):
    import functools
    import json

    import runtime.bench.disk_sweep as sweep

    # The default grid moves up to 2 GiB a point: a small one here, through the same command.
    monkeypatch.setattr(sweep, "disk_sweep", functools.partial(sweep.disk_sweep, ios_in_flight=(1, 2),
                                                                block_nbytes=(64 << 10,)))
    target = tmp_path / "swap"
    target.mkdir()
    out = tmp_path / "sweep.json"
    assert main(["bench", "store", "--nvme-dir", str(target), "--disk-sweep", "--total", "256KiB", "--repeats", "1",
                 "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [(p["ios_in_flight"], p["block_nbytes"]) for p in data["disk_sweep"]] == [(1, 64 << 10), (2, 64 << 10)]
    assert all(p["read_gbps"] > 0 for p in data["disk_sweep"])
    assert "fastest read" in capsys.readouterr().out
