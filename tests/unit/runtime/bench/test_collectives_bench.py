"""runtime.bench.collectives_bench: its arithmetic, and a run of two processes over gloo."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.bench.collectives_bench import MIB, Row, table

ROOT = Path(__file__).resolve().parents[4]


def test_bandwidth_and_the_share_the_overlap_hid():
    row = Row("broadcast", 448 * MIB, call_s=0.01, compute_s=0.03, both_s=0.035)
    assert row.gb_per_s == pytest.approx(448 * MIB / 0.01 / 1e9)
    assert row.hidden == pytest.approx(0.5)  # 5 ms of the call's 10 hidden behind the compute
    assert Row("reduce", MIB, 0.01, 0.03, 0.04).hidden == 0.0  # one after the other
    assert Row("reduce", MIB, 0.01, 0.03, 0.03).hidden == 1.0  # the call wholly hidden
    assert "448" in table([row]) and "50%" in table([row])


@pytest.mark.slow
def test_two_processes_over_gloo_print_a_row_a_call_and_size():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "RANK": str(rank),
               "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, "-m", "runtime.bench.collectives_bench", "--sizes", "0.5,1",
                                       "--iters", "2", "--compute-n", "64"], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outputs = [proc.communicate(timeout=120)[0] for proc in procs]
    assert all(proc.returncode == 0 for proc in procs), outputs
    lines = outputs[0].splitlines()
    assert lines[0].startswith("2 ranks, gloo")
    rows = [line.split() for line in lines[2:]]
    assert [(row[0], row[1]) for row in rows] == [("broadcast", "0.5"), ("broadcast", "1.0"), ("reduce", "0.5"),
                                           ("reduce", "1.0")]
    assert all(float(row[2]) > 0 and float(row[3]) > 0 for row in rows)
    assert outputs[1].strip() == ""  # rank 1 prints nothing
