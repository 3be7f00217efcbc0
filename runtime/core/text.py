"""Words for counts in what a person reads: "1 step", "2 steps". Nothing else."""

from __future__ import annotations


def counted(number: int, noun: str) -> str:
    """``number`` and ``noun``, the noun plural unless the number is one ("1 step", "0 steps", "1,024 steps")."""
    return f"{number:,} {noun}{'' if number == 1 else 's'}"
