"""Checkpoint files: format, manifest verification (tampering refused, naming the file), atomic publication,
retention, and what save / load read and write in each tier."""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from runtime import CheckpointError, bench_checkpoint, load_checkpoint, offload, save_checkpoint
from runtime.bundled.data import ByteBatches
from runtime.bundled.example_model import ExampleLM, ModelShape
from runtime.checkpoint.files import find_checkpoint, read_latest, verify_checkpoint
from runtime.checkpoint.root import LOCK_NAME
from runtime.checkpoint.state import save_due
from tests.unit.runtime.checkpoint.sessions import CORPUS, SHAPE, make_session, step
from tierstore import HEADER_NBYTES, CopyState, CorruptFileError, TierName


@pytest.fixture
def saved(trained, tmp_path: Path) -> Path:
    return save_checkpoint(trained[2], tmp_path / "ckpt", trained[3])


# ---- format ----------------------------------------------------------------------------------------
def test_layout_manifest_and_raw_tensors(trained, saved, tmp_path):
    _, _, session, data = trained
    assert saved == tmp_path / "ckpt" / "step-000002"
    assert read_latest(tmp_path / "ckpt") == "step-000002"
    manifest = json.loads((saved / "manifest.json").read_text())
    on_disk = sorted(p.name for p in saved.iterdir() if p.name != "manifest.json")
    assert sorted(manifest["files"]) == on_disk
    for name, entry in manifest["files"].items():
        content = (saved / name).read_bytes()
        assert entry == {"nbytes": len(content), "sha256": hashlib.sha256(content).hexdigest()}
    meta = json.loads((saved / "meta.json").read_text())
    assert meta["step"] == 2 and meta["data"]["position"] == 2
    for block in session.blocks:
        for kind in ("master", "exp_avg", "exp_avg_sq"):
            entry = meta["tensors"][block.key(kind)]
            raw = np.fromfile(saved / entry["file"], dtype="<f4")  # raw little-endian, no pickle
            assert entry["dtype"] == "float32" and raw.size == entry["numel"] == block.numel
        master = torch.cat([v.reshape(-1) for v in session.access.block_values(block, "master").values()])
        assert master.numpy().tobytes() == (saved / f"{block.key('master')}.bin").read_bytes()
        assert meta["blocks"][block.index]["param_steps"] == [2.0] * len(block.slots)
    assert (saved / "rng.torch_cpu.bin").read_bytes() == torch.get_rng_state().numpy().tobytes()
    assert (saved / "data.generator.bin").read_bytes() == data.generator.get_state().numpy().tobytes()
    assert "placement:" in (saved / "config.yaml").read_text()
    assert not any(b"\x80\x04" in (saved / name).read_bytes()[:2] for name in on_disk)  # no pickle streams


def test_nvme_state_is_streamed_from_swap_files_not_staged(trained, tmp_path):
    """Moments living on NVMe are copied file to file: no host copy is made for them."""
    _, _, session, data = trained
    store = session.store
    keys = [b.key(k) for b in session.blocks for k in ("exp_avg", "exp_avg_sq")]
    session.controller.synchronize()  # the last update's write-backs land, then their host copies go
    assert all(store.record(k).home is TierName.NVME and store.state(k, TierName.HOST) is CopyState.ABSENT for k in keys)
    used = store.usage()["host"]["used_nbytes"]
    path = save_checkpoint(session, tmp_path / "ckpt", data)
    assert all(store.state(k, TierName.HOST) is CopyState.ABSENT for k in keys)
    assert store.usage()["host"]["used_nbytes"] == used
    for key in keys:
        swap = store.tiers[TierName.NVME].directory.get(store.record(key).key).path
        payload = swap.read_bytes()[HEADER_NBYTES : HEADER_NBYTES + store.record(key).meta.nbytes]
        assert (path / f"{key}.bin").read_bytes() == payload


def test_corrupt_swap_file_is_not_checkpointed(trained, saved, tmp_path):
    _, _, session, data = trained
    store = session.store
    key = session.blocks[0].key("exp_avg")
    swap = store.tiers[TierName.NVME].directory.get(store.record(key).key).path
    with open(swap, "r+b") as f:
        f.seek(HEADER_NBYTES + 5)
        byte = f.read(1)
        f.seek(HEADER_NBYTES + 5)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(CorruptFileError, match="checkpointing"):
        save_checkpoint(session, tmp_path / "ckpt", data)
    root = tmp_path / "ckpt"
    assert read_latest(root) == saved.name  # the previous checkpoint stays latest
    assert sorted(p.name for p in root.iterdir() if p.name != LOCK_NAME) == ["latest", saved.name]  # no partial directory left behind


# ---- verification: tampering is refused, naming the file --------------------------------------------
def rewrite_manifest(path: Path, edit) -> None:
    manifest = json.loads((path / "manifest.json").read_text())
    edit(manifest["files"])
    (path / "manifest.json").write_text(json.dumps(manifest))


def test_flipped_bit_is_refused(saved):
    target = saved / "block1.exp_avg_sq.bin"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x01
    target.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"block1\.exp_avg_sq\.bin: sha256"):
        verify_checkpoint(saved)


def test_truncated_file_is_refused(saved):
    target = saved / "block0.master.bin"
    os.truncate(target, target.stat().st_size - 4)
    with pytest.raises(CheckpointError, match=r"block0\.master\.bin: .*truncated"):
        verify_checkpoint(saved)


def test_missing_file_is_refused(saved):
    (saved / "rng.torch_cpu.bin").unlink()
    with pytest.raises(CheckpointError, match=r"rng\.torch_cpu\.bin: listed .* but missing"):
        verify_checkpoint(saved)


def test_extra_file_is_refused(saved):
    (saved / "notes.txt").write_text("hello")
    with pytest.raises(CheckpointError, match=r"notes\.txt: not listed"):
        verify_checkpoint(saved)


@pytest.mark.parametrize("name, message", [
    ("../x", r"'\.\./x' leaves the checkpoint"),
    ("a/../../x", r"leaves the checkpoint"),
    ("/etc/passwd", r"'/etc/passwd' is an absolute path"),
    ("sub/file.bin", r"'sub/file.bin' is not a plain file name"),
    ("manifest.json", r"cannot list itself"),
])
def test_manifest_entries_outside_the_directory_are_refused(saved, name, message):
    rewrite_manifest(saved, lambda files: files.__setitem__(name, {"nbytes": 0, "sha256": "0" * 64}))
    with pytest.raises(CheckpointError, match=message):
        verify_checkpoint(saved)


def test_symlinked_file_is_refused(saved, tmp_path):
    target = saved / "block0.master.bin"
    outside = tmp_path / "outside.bin"
    outside.write_bytes(target.read_bytes())
    target.unlink()
    target.symlink_to(outside)
    with pytest.raises(CheckpointError, match=r"block0\.master\.bin: not a regular file"):
        verify_checkpoint(saved)


def test_tampered_meta_and_garbled_manifest_are_refused(saved):
    meta = saved / "meta.json"
    meta.write_text(meta.read_text().replace('"step": 2', '"step": 9'))
    with pytest.raises(CheckpointError, match=r"meta\.json: .*"):
        verify_checkpoint(saved)
    (saved / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"manifest\.json: unreadable"):
        verify_checkpoint(saved)


@pytest.mark.parametrize("tamper", ["truncated tensor", "unlisted file", "rng state", "meta value"])
def test_refused_checkpoint_leaves_the_session_untouched(trained, saved, tamper):
    """Everything checked before the first tensor is restored: listing, sizes, meta.json's values and the
    small files' hashes. A refusal there leaves the session exactly as it was."""
    model, optimizer, session, data = trained
    step(model, optimizer, data)
    before = session.master_state_dict()
    if tamper == "truncated tensor":
        os.truncate(saved / "block2.master.bin", 8)
    elif tamper == "unlisted file":
        (saved / "extra.bin").write_bytes(b"x")
    elif tamper == "rng state":
        (saved / "rng.torch_cpu.bin").write_bytes(b"\1" * (saved / "rng.torch_cpu.bin").stat().st_size)
    else:
        rewrite_file_and_manifest(saved, "meta.json", lambda text: text.replace('"step": 2', '"step": -2'))
    with pytest.raises(CheckpointError, match=r"(block2\.master\.bin|extra\.bin|rng\.torch_cpu\.bin|meta\.json: step)"):
        load_checkpoint(session, saved, data)
    after = session.master_state_dict()
    assert session.controller.optimizer_step == 3 and data.position == 3
    assert all(torch.equal(before[k], after[k]) for k in before)


def rewrite_file_and_manifest(path: Path, name: str, edit) -> None:
    """Change a file and give the manifest its new sha256: tampering that the hashes alone do not catch."""
    content = edit((path / name).read_text()).encode()
    (path / name).write_bytes(content)
    rewrite_manifest(path, lambda files: files.__setitem__(name, {"nbytes": len(content),
                                                                 "sha256": hashlib.sha256(content).hexdigest()}))


def test_tensor_file_is_hashed_as_it_is_loaded(trained, saved, monkeypatch):
    """A tensor file replaced after the listing was checked (same size, other bytes) is refused naming it:
    the bytes loaded are the bytes hashed, in one read. The session is then part-loaded, and says so."""
    import runtime.checkpoint.state as checkpoint_module

    _, _, session, data = trained
    target = saved / "block1.exp_avg.bin"
    real_check = checkpoint_module.check_listing

    def check_then_swap(path):
        files = real_check(path)  # the listing passed; now the file is swapped for another of the same size
        replacement = saved / "replacement"
        replacement.write_bytes(np.full(target.stat().st_size // 4, np.nan, dtype="<f4").tobytes())
        os.replace(replacement, target)
        return files

    monkeypatch.setattr(checkpoint_module, "check_listing", check_then_swap)
    reads = []
    real_read = checkpoint_module.read_verified_into
    monkeypatch.setattr(checkpoint_module, "read_verified_into",
                        lambda path, dst, entry: (reads.append(path.name), real_read(path, dst, entry)))
    with pytest.raises(CheckpointError, match=r"block1\.exp_avg\.bin: sha256 .* does not match .*holds a mix of its own state"):
        load_checkpoint(session, saved, data)
    assert "a checkpoint load was cut short" in session.controller.interrupted
    assert reads.count("block1.exp_avg.bin") == 1  # read once: verified and loaded together
    key = session.blocks[1].key("exp_avg")  # its home is a swap file: the half-read staging copy was dropped
    assert session.store.record(key).home is TierName.NVME and session.store.state(key, TierName.HOST) is CopyState.ABSENT


@pytest.mark.parametrize("name, content, message", [
    ("manifest.json", b"[" * 200_000 + b"]" * 200_000, r"manifest\.json: unreadable \(nested too deeply\)"),
    ("manifest.json", b"{\"format\": " + b" " * (65 << 20) + b"1}", r"manifest\.json: .* bytes, more than"),
    ("manifest.json", b"\xff\xfe{}", r"manifest\.json: unreadable"),
    ("latest", b"step-000002" + b" " * 1000, r"latest: .* bytes, more than"),
])
def test_malformed_or_huge_json_is_a_checkpoint_error(saved, name, content, message):
    target = saved / name if name != "latest" else saved.parent / name
    target.write_bytes(content)
    with pytest.raises(CheckpointError, match=message):
        verify_checkpoint(saved) if name != "latest" else find_checkpoint(saved.parent)


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.replace('"step": 2', '"step": NaN'), r"step is nan, expected an integer"),
    (lambda t: t.replace('"step": 2', '"step": 1e300'), r"step is 1e\+300"),
    (lambda t: t.replace('"position": 2', '"position": -1'), r"data\.position is -1"),
    (lambda t: t.replace('"param_steps": [\n    2.0', '"param_steps": [\n    Infinity'), r"param_steps\[0\] is inf"),
    (lambda t: t.replace('"MT19937"', '"PCG64"'), r"rng\.numpy\[0\] is 'PCG64'"),
    (lambda t: "[" * 100_000 + "]" * 100_000, r"meta\.json: unreadable \(nested too deeply\)"),
])
def test_meta_values_are_range_checked(trained, saved, edit, message):
    _, _, session, data = trained
    rewrite_file_and_manifest(saved, "meta.json", edit)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(session, saved, data)
    assert session.controller.optimizer_step == 2


def test_other_model_is_refused(saved, tmp_path):
    (tmp_path / "swap2").mkdir()
    other = ModelShape(vocab_size=256, hidden_size=16, num_layers=2, num_heads=2, ffn_size=48, max_seq_len=32)
    _, _, session = make_session(tmp_path / "swap2", other)
    try:
        with pytest.raises(CheckpointError, match=r"meta\.json: block \d+ is"):
            load_checkpoint(session, saved)
    finally:
        session.close()


# ---- publication, latest, retention -----------------------------------------------------------------
def test_keep_last_prunes_only_after_the_new_one_is_in_place(trained, tmp_path):
    model, optimizer, session, data = trained
    root = tmp_path / "ckpt"
    seen = []
    for _ in range(4):
        step(model, optimizer, data)
        save_checkpoint(session, root, data, keep_last=2,
                        progress=lambda what: seen.append((what, sorted(p.name for p in root.iterdir() if p.name != LOCK_NAME))))
    assert sorted(p.name for p in root.iterdir() if p.name != LOCK_NAME) == ["latest", "step-000005", "step-000006"]
    # when latest was repointed to step 6, steps 4 and 5 were both still there
    at_latest = [names for what, names in seen if what == "latest"][-1]
    assert {"step-000004", "step-000005", "step-000006"} <= set(at_latest)


def test_partial_and_stale_directories_are_never_latest(trained, tmp_path):
    _, _, session, data = trained
    root = tmp_path / "ckpt"
    first = save_checkpoint(session, root, data)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = root / f".tmp-step-000009-{int(dead.stdout)}"  # a save killed half-way (its process is gone)
    stale.mkdir()
    (stale / "block0.master.bin").write_bytes(b"partial")
    assert find_checkpoint(root) == first
    (root / "latest").unlink()  # even without the pointer, only complete step-* directories count
    assert find_checkpoint(root) == first
    save_checkpoint(session, root, data)  # the next save clears leftovers of dead processes
    assert not stale.exists()


def test_resaving_a_step_replaces_it_whole(trained, tmp_path):
    model, optimizer, session, data = trained
    root = tmp_path / "ckpt"
    save_checkpoint(session, root, data)
    again = save_checkpoint(session, root, data)
    assert sorted(p.name for p in root.iterdir() if p.name != LOCK_NAME) == ["latest", "step-000002"]
    verify_checkpoint(again)


def test_checkpoint_dir_inside_the_swap_directory_is_refused(trained, tmp_path):
    _, _, session, data = trained
    with pytest.raises(CheckpointError, match="overlaps the NVMe swap directory"):
        save_checkpoint(session, tmp_path / "swap" / "ckpt", data)


def test_save_and_load_refused_mid_step(trained, saved):
    model, optimizer, session, data = trained
    x, y = data.next()
    model(x, y).backward()
    with pytest.raises(RuntimeError, match="between steps"):
        save_checkpoint(session, saved.parent, data)
    with pytest.raises(RuntimeError, match="between steps"):
        load_checkpoint(session, saved, data)
    optimizer.step()


def test_no_checkpoint_is_a_clear_error(tmp_path):
    (tmp_path / "swap").mkdir()
    _, _, session = make_session(tmp_path / "swap")
    try:
        with pytest.raises(CheckpointError, match="no checkpoint here"):
            load_checkpoint(session, tmp_path / "empty")
    finally:
        session.close()


# ---- load: each home, counters, scaler, RNG, data ---------------------------------------------------
@pytest.mark.parametrize("layout", [{"moments": "nvme"}, {"master": "nvme", "moments": "host"},
                                    {"moments": "host", "gpu_update_fraction": 0.5}], ids=["nvme-moments", "nvme-master", "device-updated"])
def test_load_restores_every_home_and_counter(trained, saved, tmp_path, layout):
    _, _, source, _ = trained
    expected = source.master_state_dict()
    (tmp_path / "swap2").mkdir()
    model, optimizer, session, = make_session(tmp_path / "swap2", **dict(layout))
    try:
        if "gpu_update_fraction" in layout:
            assert session.controller.gpu_updated  # some blocks' state really is GPU-home here
        torch.manual_seed(123)
        random.seed(123)
        np.random.seed(123)
        data = ByteBatches(CORPUS, 2, 16, seed=99)
        assert load_checkpoint(session, saved.parent, data) == 2
        got = session.master_state_dict()
        assert all(torch.equal(got[k], expected[k]) for k in expected)
        controller = session.controller
        for block in session.blocks:
            for kind in ("exp_avg", "exp_avg_sq"):
                key = block.key(kind)
                home = session.store.record(key).home
                if home is TierName.NVME:  # written through to the swap file, no host copy left over
                    assert session.store.state(key, TierName.HOST) is CopyState.ABSENT
                    session.store.fetch(key, TierName.HOST).wait()
                value = session.store.tensor(key, home if home is not TierName.NVME else TierName.HOST)
                assert value.numpy().tobytes() == (saved / f"{key}.bin").read_bytes()
            counters = controller.gpu_param_steps.get(block.index) or controller.worker.param_steps[block.index]
            assert [float(c) for c in counters] == [2.0] * len(block.slots)
        assert controller.optimizer_step == 2 and controller.worker.updated_step(0) == 2
        assert torch.equal(torch.get_rng_state(), torch.from_numpy(np.fromfile(saved / "rng.torch_cpu.bin", dtype=np.uint8)))
        assert data.position == 2
        step(model, optimizer, data)  # and training goes on from there
        assert controller.optimizer_step == 3
    finally:
        session.close()


def test_load_refreshes_weights_already_on_the_device(trained, tmp_path):
    """Compute weights fetched before the load (kept resident by the schedule) must not survive it."""
    model, optimizer, session, data = trained
    path = save_checkpoint(session, tmp_path / "ckpt", data)
    x, y = ByteBatches(CORPUS, 2, 16, seed=5).next()
    with torch.no_grad():
        expected = model(x, y).item()
    step(model, optimizer, data, 2)
    with torch.no_grad():
        for block in session.blocks:  # fetch every block's (newer) weights to the device
            session.controller.weights.fetch(block.index)
            session.controller.weights.wait(block.index)
    load_checkpoint(session, path, data)
    with torch.no_grad():
        assert model(x, y).item() == expected


def test_resident_weights_are_refreshed_from_the_loaded_master(tmp_path):
    (tmp_path / "swap").mkdir()
    torch.manual_seed(0)
    config = {"dtype": "fp32", "device": "cpu", "optimizer": {"grad_clip": None}, "tiers": {"nvme": {"path": str(tmp_path / "swap")}},
              "placement": {"weights": "gpu", "master": "host", "moments": "nvme"}}
    model, optimizer = offload(ExampleLM(SHAPE), config)
    session = optimizer.session
    try:
        data = ByteBatches(CORPUS, 2, 16, seed=0)
        step(model, optimizer, data)
        path = save_checkpoint(session, tmp_path / "ckpt", data)
        x, y = ByteBatches(CORPUS, 2, 16, seed=5).next()
        with torch.no_grad():
            expected = model(x, y).item()
        step(model, optimizer, data, 2)
        load_checkpoint(session, path, data)
        with torch.no_grad():
            assert model(x, y).item() == expected
    finally:
        session.close()


def test_save_due():
    assert [s for s in range(1, 8) if save_due(s, 7, 3)] == [3, 6, 7]
    assert [s for s in range(1, 8) if save_due(s, 7, 0)] == [7]


def test_bench_checkpoint_reports_seconds_and_bytes(trained, tmp_path):
    _, _, session, data = trained
    result = bench_checkpoint(session, tmp_path / "bench", data)
    tensor_nbytes = 3 * 4 * sum(b.numel for b in session.blocks)
    assert result["tensor_nbytes"] == tensor_nbytes and result["nbytes"] > tensor_nbytes
    assert all(result[k] > 0 for k in ("save_s", "verify_s", "load_s", "save_GBps", "load_GBps"))
    assert session.controller.optimizer_step == 2
