"""The checkpoint root, attacked: a second run into a used root, two runs at once, dead and live saves,
links planted at every name the checkpoint writer creates, and the modes of what it writes."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from runtime import CheckpointError, CheckpointRoot, save_checkpoint
from runtime.bundled.data import ByteBatches
from runtime.checkpoint.files import LATEST_NAME, list_checkpoints, read_latest, verify_checkpoint, write_latest
from runtime.checkpoint.root import LOCK_NAME
from tests.integration.checkpoint_training import tiny_cli_config
from tests.unit.runtime.checkpoint.sessions import CORPUS, make_session, step
from tierstore import DirectoryLockedError

REPO = Path(__file__).resolve().parents[4]
VICTIM_TEXT = b"someone else's file\n"


def tree_digest(root: Path) -> dict[str, str]:
    """Every file under root (links not followed) -> sha256 of its content, or where the link points."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            path = Path(dirpath) / name
            rel = str(path.relative_to(root))
            out[rel] = "-> " + os.readlink(path) if path.is_symlink() else hashlib.sha256(path.read_bytes()).hexdigest()
    return out


@pytest.fixture
def earlier_run(trained, tmp_path: Path) -> Path:
    """A root holding step-000002 and step-000004 of an earlier run (another session), latest -> step 4."""
    model, optimizer, session, data = trained
    root = tmp_path / "ckpt"
    with CheckpointRoot(root) as held:
        save_checkpoint(session, held, data)
        step(model, optimizer, data, 2)
        save_checkpoint(session, held, data)
    return root


def second_session(tmp_path: Path):
    (tmp_path / "swap2").mkdir()
    return make_session(tmp_path / "swap2")


# ---- a run never deletes what it did not write --------------------------------------------------------------
def test_a_new_run_into_a_used_root_is_refused_and_deletes_nothing(earlier_run: Path, tmp_path: Path):
    """The issue's probe: a fresh run saving every step into a root with steps 2 and 4 of another run used
    to leave step 1 and 2 and delete step 4. Now it is refused, saying how to go on."""
    before = tree_digest(earlier_run)
    model, optimizer, session = second_session(tmp_path)
    try:
        with pytest.raises(CheckpointError, match=r"is not empty \(latest, step-000002, step-000004\).*--resume.*--overwrite"):
            CheckpointRoot(earlier_run)
        with pytest.raises(CheckpointError, match="is not empty"):
            save_checkpoint(session, earlier_run)  # a plain path: the same rule for one save
    finally:
        session.close()
    assert tree_digest(earlier_run) == before


def test_cli_train_into_a_used_root_is_refused_and_deletes_nothing(earlier_run: Path, tmp_path: Path, capsys):
    from runtime.cli.main import main as cli_main

    before = tree_digest(earlier_run)
    assert cli_main(["train", "--config", str(tiny_cli_config(tmp_path / "cli")), "--steps", "2", "--checkpoint-dir", str(earlier_run),
                     "--save-every", "1"]) == 2
    err = capsys.readouterr().err
    assert "is not empty" in err and "--resume" in err and "--overwrite" in err
    assert tree_digest(earlier_run) == before


def test_overwrite_lets_the_run_replace_and_prune(earlier_run: Path, tmp_path: Path):
    model, optimizer, session = second_session(tmp_path)
    try:
        with CheckpointRoot(earlier_run, overwrite=True) as root:
            step(model, optimizer, ByteBatches(CORPUS, 2, 16, seed=1), 1)
            save_checkpoint(session, root, keep_last=1)
    finally:
        session.close()
    assert [s for s, _ in list_checkpoints(earlier_run)] == [1] and read_latest(earlier_run) == "step-000001"


def test_resume_prunes_its_lineage_but_refuses_a_newer_foreign_checkpoint(earlier_run: Path, tmp_path: Path, trained):
    model, optimizer, session, data = trained
    write_latest(earlier_run, "step-000002")  # as if step 4 came from somewhere else: make it another lineage
    meta = earlier_run / "step-000004" / "meta.json"
    text = meta.read_text()
    lineage = text.split('"lineage": "')[1].split('"')[0]
    rewrite(earlier_run / "step-000004", "meta.json", text.replace(lineage, "f" * 32))
    before = tree_digest(earlier_run)
    with pytest.raises(CheckpointError, match=r"step-000004 is newer than the checkpoint to resume \(step-000002\).*--overwrite"):
        CheckpointRoot(earlier_run, resume=True)
    assert tree_digest(earlier_run) == before
    rewrite(earlier_run / "step-000004", "meta.json", text)  # its own lineage again: a save killed before latest moved
    with CheckpointRoot(earlier_run, resume=True) as root:
        assert root.owns("step-000002") and root.owns("step-000004")


def test_a_checkpoint_is_not_a_root(earlier_run: Path):
    """--checkpoint-dir DIR/step-000004 --resume: a lock file inside would make that checkpoint unlisted-file
    dirty (refused by verification), and saves would nest in it."""
    before = tree_digest(earlier_run)
    with pytest.raises(CheckpointError, match=r"step-000004 is one checkpoint, not a checkpoint root; pass its parent"):
        CheckpointRoot(earlier_run / "step-000004", resume=True)
    assert tree_digest(earlier_run) == before


def test_path_saves_of_one_session_own_their_checkpoints_only(trained, tmp_path: Path):
    model, optimizer, session, data = trained
    root = tmp_path / "ckpt"
    for _ in range(3):
        step(model, optimizer, data)
        save_checkpoint(session, root, data, keep_last=2)
    assert [s for s, _ in list_checkpoints(root)] == [4, 5]
    _, _, other = second_session(tmp_path)
    try:
        with pytest.raises(CheckpointError, match="is not empty"):
            save_checkpoint(other, root)
        assert [s for s, _ in list_checkpoints(root)] == [4, 5]
    finally:
        other.close()


# ---- one writer at a time; dead saves judged by the lock --------------------------------------------------------
@pytest.mark.slow
def test_two_runs_on_one_root_one_is_refused(tmp_path: Path):
    root = tmp_path / "ckpt"
    with CheckpointRoot(root):
        other = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
            from runtime import CheckpointRoot
            from tierstore import DirectoryLockedError
            try:
                CheckpointRoot({str(root)!r})
            except DirectoryLockedError as exc:
                print("refused:", exc)
            """)], capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert f"refused: checkpoint directory {root} is in use by another run (pid {os.getpid()}" in other.stdout, other.stderr
        with pytest.raises(DirectoryLockedError, match="--checkpoint-dir"):
            CheckpointRoot(root, resume=True)  # a second root in this process too
    CheckpointRoot(root).close()  # released with the first


def test_scratch_of_a_dead_save_is_removed_whatever_its_pid(tmp_path: Path):
    """Judged by the lock: holding it, every scratch directory is a dead save's, even one whose pid is alive
    (pid 1, or a pid reused on this host, or a save from another host on a shared file system)."""
    root = tmp_path / "ckpt"
    root.mkdir()
    for name in (".tmp-step-000009-1", f".del-step-000003-{os.getpid()}"):
        (root / name).mkdir()
        (root / name / "block0.master.bin").write_bytes(b"partial")
    (root / ".old-step-000005-1").mkdir()  # killed while replacing step 5: the only copy of step 5
    (root / ".old-step-000005-1" / "manifest.json").write_text("{}")
    with CheckpointRoot(root, resume=True):
        assert sorted(os.listdir(root)) == [LOCK_NAME, "step-000005"]  # restored, not deleted


def test_a_live_save_is_never_touched(tmp_path: Path):
    root = tmp_path / "ckpt"
    with CheckpointRoot(root) as held:
        pending = held.begin(7)
        (pending.tmp / "block0.master.bin").write_bytes(b"in progress")
        with pytest.raises(DirectoryLockedError):
            CheckpointRoot(root, overwrite=True)
        assert (pending.tmp / "block0.master.bin").read_bytes() == b"in progress"
        pending.abort()


# ---- links and modes ------------------------------------------------------------------------------------
def test_links_planted_at_every_checkpoint_name_are_never_written_through(trained, tmp_path: Path):
    _, _, session, data = trained
    root = tmp_path / "ckpt"
    root.mkdir()
    victims = tmp_path / "victims"
    victims.mkdir()
    (victims / "file").write_bytes(VICTIM_TEXT)
    (victims / "dir").mkdir()
    (victims / "dir" / "inside").write_bytes(VICTIM_TEXT)
    (root / f"{LATEST_NAME}.tmp").symlink_to(victims / "file")
    (root / f".tmp-step-000002-{os.getpid()}").symlink_to(victims / "dir")
    before = tree_digest(victims)
    path = save_checkpoint(session, root, data)
    assert tree_digest(victims) == before
    verify_checkpoint(path)
    (root / f"{LATEST_NAME}.tmp").symlink_to(victims / "file")  # and straight at the pointer's writer
    write_latest(root, "step-000002")
    assert (victims / "file").read_bytes() == VICTIM_TEXT and read_latest(root) == "step-000002"
    assert not os.path.lexists(root / LOCK_NAME)  # the save's root removed it at close
    (root / LOCK_NAME).symlink_to(victims / "file")
    with pytest.raises(DirectoryLockedError, match=r"lock file .*\.lock is a symbolic link"):
        CheckpointRoot(root, resume=True)
    assert tree_digest(victims) == before


def test_a_planted_step_directory_is_not_replaced(trained, tmp_path: Path):
    model, optimizer, session, data = trained
    root = tmp_path / "ckpt"
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "manifest.json").write_bytes(VICTIM_TEXT)
    with CheckpointRoot(root) as held:
        (root / "step-000002").symlink_to(victim)
        with pytest.raises(CheckpointError, match=r"step-000002 exists and was not written by this run"):
            save_checkpoint(session, held, data)
    assert (victim / "manifest.json").read_bytes() == VICTIM_TEXT


def test_checkpoints_are_private(trained, tmp_path: Path):
    _, _, session, data = trained
    old = os.umask(0)
    try:
        path = save_checkpoint(session, tmp_path / "new" / "ckpt", data)
    finally:
        os.umask(old)
    root = path.parent
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in [root, path, root / LATEST_NAME, *path.iterdir()]}
    assert modes.pop(root.name) == 0o700 and modes.pop(path.name) == 0o700
    assert set(modes.values()) == {0o600}, modes


# ---- helpers --------------------------------------------------------------------------------------------
def rewrite(checkpoint: Path, name: str, text: str) -> None:
    """Replace a file and fix its manifest entry (so only the meaning changes, not the integrity)."""
    content = text.encode()
    (checkpoint / name).write_bytes(content)
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["files"][name] = {"nbytes": len(content), "sha256": hashlib.sha256(content).hexdigest()}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o770], ids=["world-writable", "sticky-world-writable", "group-writable"])
def test_a_checkpoint_root_others_can_write_to_is_refused_as_a_swap_directory_is(tmp_path: Path, mode: int):
    """A world- or group-writable root was accepted (the same modes are refused for swap directories): another user
    could plant links or replace checkpoint files there."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, mode)
    with pytest.raises(CheckpointError, match=r"writable by .*(--checkpoint-dir|checkpoint_dir)"):
        CheckpointRoot(shared)
    assert list(shared.iterdir()) == []  # refused before its lock file was made
    private = shared / "mine"
    CheckpointRoot(private).close()  # the subdirectory the message suggests is made private, and accepted
    assert stat.S_IMODE(private.stat().st_mode) == 0o700


def test_resume_never_prunes_an_older_checkpoint_of_another_run(earlier_run: Path, tmp_path: Path, trained):
    """A checkpoint copied in from another run, older than the one resumed, was owned (every older one was) and
    deleted by keep_last, although checkpoints of another run are never deleted."""
    model, optimizer, session, data = trained
    meta = earlier_run / "step-000002" / "meta.json"
    text = meta.read_text()
    lineage = text.split('"lineage": "')[1].split('"')[0]
    rewrite(earlier_run / "step-000002", "meta.json", text.replace(lineage, "f" * 32))  # another run's step 2
    copied = tree_digest(earlier_run / "step-000002")
    with CheckpointRoot(earlier_run, resume=True) as root:
        assert root.owns("step-000004") and not root.owns("step-000002")
        step(model, optimizer, data, 2)
        save_checkpoint(session, root, data, keep_last=1)  # prunes this run's own older ones only
    names = sorted(p.name for _, p in list_checkpoints(earlier_run))
    assert "step-000002" in names and "step-000004" not in names, names
    assert tree_digest(earlier_run / "step-000002") == copied
