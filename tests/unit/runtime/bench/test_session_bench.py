"""session_bench's checkpoint figures: written in a private directory of its own, the only thing it removes."""

from __future__ import annotations

from pathlib import Path

from runtime.bench import session_bench


def test_checkpoint_figures_remove_only_what_they_created(trained, tmp_path: Path, monkeypatch):
    _, _, session, _ = trained
    target = tmp_path / "user-dir"
    target.mkdir()
    (target / "notes.txt").write_text("the user's own file")
    (target / "step-000001").mkdir()  # even something that looks like ours
    seen = []
    real = session_bench.bench_checkpoint
    monkeypatch.setattr(session_bench, "bench_checkpoint",
                        lambda session, path: (seen.append(path.parent), real(session, path))[1])
    ckpt, ceiling = session_bench.checkpoint_figures(session, target)
    assert ckpt["nbytes"] > 0 and ceiling["write_GBps"] > 0
    work = seen[0]
    assert work.parent == target and work.name.startswith("session-bench-") and not work.exists()
    assert sorted(p.name for p in target.iterdir()) == ["notes.txt", "step-000001"]
    assert (target / "notes.txt").read_text() == "the user's own file"
