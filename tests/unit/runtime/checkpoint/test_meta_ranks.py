"""meta.json's ``ranks`` (each rank's RNG states and data position, written by a save of several processes) is
range-checked like the one process's ``rng`` and ``data``, naming the rank's entry."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest

from runtime.checkpoint.files import META_NAME, CheckpointError, PendingFiles, hash_file, json_bytes
from runtime.checkpoint.meta import FORMAT, VERSION, read_meta
from runtime.checkpoint.state import _random_state


def read_with(tmp_path: Path, edit: Any) -> dict[str, Any]:
    """read_meta of a meta.json with two ranks' entries, as ``edit`` changes them."""
    tmp_path = Path(tempfile.mkdtemp(dir=tmp_path))
    rng, _ = _random_state(None, PendingFiles(tmp_path))
    data = {"position": 2, "generator": "data.generator.bin", "batch_size": 3, "seq_len": 32}
    ranks = [{"rng": rng, "data": data}, {"rng": dict(rng), "data": dict(data)}]
    edit(ranks)
    meta = {"format": FORMAT, "version": VERSION, "byte_order": "little", "step": 2, "blocks": [], "tensors": {},
            "rng": rng, "data": data, "ranks": ranks}
    (tmp_path / META_NAME).write_bytes(json_bytes(meta))
    return read_meta(tmp_path, {META_NAME: hash_file(tmp_path / META_NAME)})


def test_each_ranks_entry_is_checked(tmp_path):
    assert len(read_with(tmp_path, lambda ranks: None)["ranks"]) == 2
    with pytest.raises(CheckpointError, match=r"ranks\[1\]\.data\.position is -1"):
        read_with(tmp_path, lambda ranks: ranks[1]["data"].update(position=-1))
    with pytest.raises(CheckpointError, match=r"ranks\[1\]\.rng\.numpy\[0\] is 'PCG64'"):
        read_with(tmp_path, lambda ranks: ranks[1]["rng"].update(numpy=["PCG64", *ranks[1]["rng"]["numpy"][1:]]))
    with pytest.raises(CheckpointError, match=r"ranks\[0\] is 7, expected a mapping"):
        read_with(tmp_path, lambda ranks: ranks.__setitem__(0, 7))
