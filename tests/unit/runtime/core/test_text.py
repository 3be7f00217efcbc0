"""Counts in what a person reads: "1 step", not "1 steps"."""

from __future__ import annotations

from runtime.core.text import counted


def test_one_is_singular_and_every_other_count_plural() -> None:
    assert counted(1, "step") == "1 step"
    assert [counted(n, "step") for n in (0, 2, 1024)] == ["0 steps", "2 steps", "1,024 steps"]
