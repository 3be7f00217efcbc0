"""runtime.bench.adam_bench prints one table: a row per moment_dtype, fp32's ratio 1, bytes per parameter as
documented (28, 20, about 16)."""

from __future__ import annotations

from runtime.bench.adam_bench import bytes_per_param, layer_sizes, main


def test_layer_sizes_are_close_to_the_asked_numel():
    sizes = layer_sizes(12_000_000)
    assert len(sizes) == 9 and abs(sum(sizes) - 12_000_000) / 12_000_000 < 0.1


def test_bytes_per_param():
    sizes = layer_sizes(1 << 22)
    assert bytes_per_param("fp32", sizes) == 28 and bytes_per_param("bf16", sizes) == 20
    assert 16 < bytes_per_param("int8", sizes) < 16.05  # codes and 0.2% of scales


def test_one_command_prints_the_table(capsys):
    assert main(["--numel", "200000", "--threads", "1", "--repeat", "1", "--piece-numel", "8192"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "1 threads, pieces of 8192 elements" in lines[0] and lines[1].split()[:2] == ["moment_dtype", "B/param"]
    rows = {line.split()[0]: line.split() for line in lines[2:]}
    assert set(rows) == {"fp32", "bf16", "int8"} and rows["fp32"][-1] == "1.00"
    assert all(float(row[3]) > 0 for row in rows.values())  # parameters a second
