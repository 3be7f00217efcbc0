"""The example configs validate, and their comments agree with the schema (issue 41: tiers.yaml said
``gradients: ... (gpu or host)`` where gpu is refused, and "the defaults, written out" beside values that were not)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from runtime.config.loader import TierstoreConfig, load_config
from runtime.config.units import ChoiceSpec

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
KEY_LINE = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z_]\w*):(?P<value>[^#]*)(#(?P<comment>.*))?$")
# "gpu, host, nvme or auto": a list of choices in a comment.
CHOICE_LIST = re.compile(r"\b\w+(?:, \w+)* or \w+\b")


def _section(cls: type, name: str) -> type | None:
    """The dataclass of section ``name`` in ``cls``, None when ``name`` is a leaf or unknown."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            return f.metadata.get("section")
    return None


def _choices(cls: type) -> dict[str, tuple[str, ...]]:
    """The choice keys of a section and what each accepts."""
    return {f.name: f.metadata["spec"].choices for f in dataclasses.fields(cls)
            if isinstance(f.metadata.get("spec"), ChoiceSpec)}


def _lines(example: Path) -> list[tuple[int, type, str, str, str, list[str]]]:
    """Per key line: (line number, its section's dataclass, key, value, comment, the comment lines above it and the
    continuation lines after it). Two-space indentation, as the examples are written."""
    out: list[tuple[int, type, str, str, str, list[str]]] = []
    stack: list[type] = [TierstoreConfig]
    above: list[str] = []
    comment_column, comment_line = -1, -1  # where the last key line's comment starts, and the line it goes on to
    for number, text in enumerate(example.read_text().splitlines(), 1):
        stripped = text.strip()
        if stripped.startswith("#"):
            if number == comment_line + 1 and text.index("#") == comment_column:
                # a comment lined up under a key line's comment goes on with it
                out[-1] = (*out[-1][:4], f"{out[-1][4]} {stripped.lstrip('# ')}", out[-1][5])
                comment_line = number
                continue
            above.append(stripped.lstrip("# "))
            continue
        match = KEY_LINE.match(text)
        if not match:
            above = []
            continue
        comment_column, comment_line = (text.index("#"), number) if match["comment"] is not None else (-1, -1)
        depth = len(match["indent"]) // 2
        del stack[depth + 1:]
        cls, key = stack[depth], match["key"]
        out.append((number, cls, key, match["value"].strip(), (match["comment"] or "").strip(), above))
        above = []
        section = _section(cls, key)
        if section is not None:
            stack.append(section)
    return out


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_example_validates(example: Path) -> None:
    load_config(example)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_a_key_comment_names_only_choices_the_key_accepts(example: Path) -> None:
    """A comment beside a choice key that names another key's choice (``gradients: host  # (gpu or host)``) says
    the key takes a value the loader refuses."""
    wrong = []
    for number, cls, key, _value, comment, _above in _lines(example):
        choices = _choices(cls)
        if key not in choices:
            continue
        vocabulary = {c for accepted in choices.values() for c in accepted}
        named = set(re.findall(r"\b[a-z_]+\b", comment)) & vocabulary
        if named - set(choices[key]):
            wrong.append(f"{example.name}:{number}: {key} accepts {choices[key]}, its comment names {sorted(named)}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_a_section_comment_lists_only_choices_its_keys_accept(example: Path) -> None:
    """A comment above a section that lists choices ("gpu, host, nvme or auto") holds for each choice key in it."""
    wrong = []
    for number, cls, key, _value, _comment, above in _lines(example):
        section = _section(cls, key)
        if section is None or not _choices(section):
            continue
        choices = _choices(section)
        vocabulary = {c for accepted in choices.values() for c in accepted}
        for listed in CHOICE_LIST.findall(" ".join(above)):
            words = set(re.findall(r"\w+", listed)) - {"or"}
            if not words <= vocabulary:
                continue  # English, not a list of choices
            for name, accepted in choices.items():
                if words - set(accepted):
                    wrong.append(f"{example.name}:{number}: the comment above {key} lists {listed!r}, but "
                                 f"{key}.{name} accepts {accepted}")
    assert not wrong, "\n".join(wrong)


def test_tiers_yaml_is_the_defaults_written_out() -> None:
    """Its first line says so: every value it sets is the schema's default, grad_clip excepted (written as the
    number its default ``auto`` means for a loop that does not clip, as the README tells)."""
    example = load_config(REPO / "examples" / "tiers.yaml")
    assert example.optimizer.grad_clip == 1.0
    assert "defaults, written out" in (REPO / "examples" / "tiers.yaml").read_text().splitlines()[0]
    default = load_config(None)
    assert dataclasses.replace(example, optimizer=dataclasses.replace(example.optimizer, grad_clip="auto")) == default


def test_the_checks_catch_the_comments_issue_41_found(tmp_path: Path) -> None:
    """The two comment checks refuse what tiers.yaml said before (so they would have caught it)."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("# Where each kind of training state lives between uses: gpu, host, nvme or auto.\n"
                   "placement:\n"
                   "  gradients: host   # moved off the GPU as each block's backward completes (gpu or host)\n")
    with pytest.raises(AssertionError, match="gradients accepts"):
        test_a_key_comment_names_only_choices_the_key_accepts(bad)
    with pytest.raises(AssertionError, match="lists 'gpu, host, nvme or auto'"):
        test_a_section_comment_lists_only_choices_its_keys_accept(bad)
