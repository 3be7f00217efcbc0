"""Kinds of config values: byte sizes, and the specs that check one field's value.

Sizes are written as people write them in configs: ``"512MiB"``, ``"1.5GB"``, ``"1e9"``. Decimal
units (KB, MB, GB, TB) are powers of 1000 and binary units (KiB, MiB, GiB, TiB) powers of 1024, as
the IEC defines them. Single letters (``K``, ``G``) are refused because half the world reads them
one way and half the other, and a factor of 1.07 in a memory budget is a real bug.

A spec (:class:`IntSpec`, :class:`SizeSpec`, ...) checks and normalises one value and says in
words what it accepts; it knows nothing of YAML, paths of keys or line numbers, which
:mod:`runtime.config.loader` adds.
"""

from __future__ import annotations

import decimal
import difflib
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "MAX_NBYTES",
    "SIZE_UNITS",
    "BoolSpec",
    "ChoiceSpec",
    "FloatListSpec",
    "FloatSpec",
    "IntSpec",
    "PathSpec",
    "PatternListSpec",
    "SizeSpec",
    "Spec",
    "SpecError",
    "describe_value",
    "format_size",
    "parse_size",
    "size_to_nbytes",
]

#: Units accepted by :func:`parse_size`, in the spelling used in messages and docs.
SIZE_UNITS: dict[str, int] = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KiB": 2**10,
    "MiB": 2**20,
    "GiB": 2**30,
    "TiB": 2**40,
}

#: Largest size accepted: file offsets and torch sizes are signed 64-bit.
MAX_NBYTES = 2**63 - 1

# Units are matched without regard to case ("gib", "GIB"): no unit here has a second meaning that
# differs only by case (bits are never meant in a memory budget).
_UNITS_BY_LOWER = {name.lower(): (name, factor) for name, factor in SIZE_UNITS.items()}
_AMBIGUOUS = {"k": "Ki", "m": "Mi", "g": "Gi", "t": "Ti"}
_SIZE_RE = re.compile(
    r"^\s*(?P<sign>[-+]?)(?P<num>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE](?P<exp>[-+]?[0-9]+))?"
    r"\s*(?P<unit>[A-Za-z]*)\s*$"
)
_UNIT_LIST = ", ".join(SIZE_UNITS)


def _unit_factor(unit: str, text: str) -> int:
    """Return the byte factor of ``unit`` or raise ValueError naming the units that exist."""
    if not unit:
        return 1
    found = _UNITS_BY_LOWER.get(unit.lower())
    if found is not None:
        return found[1]
    lower = unit.lower()
    if lower in _AMBIGUOUS or lower in {"ki", "mi", "gi", "ti"}:
        letter = lower[0].upper()
        raise ValueError(
            f"unit `{unit}` in {text!r} is ambiguous; write `{letter}iB` (powers of 1024) "
            f"or `{letter}B` (powers of 1000)"
        )
    close = difflib.get_close_matches(lower, list(_UNITS_BY_LOWER), n=1, cutoff=0.5)
    hint = f"; did you mean `{_UNITS_BY_LOWER[close[0]][0]}`?" if close else ""
    raise ValueError(f"unknown unit `{unit}` in {text!r}{hint or '.'} Units: {_UNIT_LIST}")


def size_to_nbytes(value: int | float | str) -> int:
    """Convert a size to bytes like :func:`parse_size`, but let negative sizes through.

    Callers that check a range themselves use this so that ``-1GiB`` is reported as out of range
    rather than as malformed.
    """
    if isinstance(value, bool):
        # bool is an int subclass; `budget: true` is a mistake, not one byte.
        raise ValueError(f"expected a size such as `64MiB`, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError(f"expected a size such as `64MiB`, got {value!r}")
        if not value.is_integer():
            raise ValueError(f"size {value!r} is not a whole number of bytes")
        return int(value)
    if not isinstance(value, str):
        raise ValueError(f"expected a size such as `64MiB`, got a {type(value).__name__}")
    match = _SIZE_RE.match(value)
    if match is None:
        raise ValueError(
            f"cannot read {value!r} as a size; write a number and a unit, e.g. `64MiB` or "
            f"`1.5GB`. Units: {_UNIT_LIST}"
        )
    factor = _unit_factor(match["unit"], value)
    try:
        number = decimal.Decimal(match["num"] + (f"e{match['exp']}" if match["exp"] else ""))
    except decimal.InvalidOperation as exc:  # pragma: no cover - the regex admits only decimals
        raise ValueError(f"cannot read {value!r} as a size") from exc
    # Refuse absurd exponents before building the integer: int(Decimal("1e999999999")) would
    # allocate a billion-digit number.
    if number != 0 and number.adjusted() > 30:
        raise ValueError(f"size {value!r} is larger than {MAX_NBYTES} bytes")
    nbytes_exact = number * factor
    if nbytes_exact != nbytes_exact.to_integral_value():
        if factor == 1:
            raise ValueError(f"size {value!r} is not a whole number of bytes")
        # "0.1GiB" is a sensible thing to write; the sub-byte remainder is meaningless.
        nbytes_exact = nbytes_exact.to_integral_value(rounding=decimal.ROUND_HALF_UP)
    nbytes = int(nbytes_exact)
    return -nbytes if match["sign"] == "-" else nbytes


def parse_size(value: int | float | str) -> int:
    """Return the number of bytes in a size written as an int or a string with a unit.

    Accepted: ints (bytes, passed through), integral floats, and strings such as ``"512MiB"``,
    ``"20GiB"``, ``"1.5GB"``, ``"64 KiB"``, ``"1e9"`` (bytes). Unit case is ignored. Fractional
    results of a unit larger than a byte are rounded to the nearest byte; a fractional number of
    plain bytes is refused.

    Raises:
        ValueError: on a malformed string, an unknown or ambiguous unit, a negative size, a size
            above :data:`MAX_NBYTES`, or a value of another type (bool included).
    """
    nbytes = size_to_nbytes(value)
    if nbytes < 0:
        raise ValueError(f"size {value!r} is negative; sizes are >= 0 bytes")
    if nbytes > MAX_NBYTES:
        raise ValueError(f"size {value!r} is larger than {MAX_NBYTES} bytes")
    return nbytes


def format_size(nbytes: int) -> str:
    """Return ``nbytes`` in the largest binary unit that divides it exactly, e.g. ``"64MiB"``.

    Sizes that are no exact multiple of a KiB come back as a plain decimal string of bytes, so
    ``parse_size(format_size(n)) == n`` always holds.
    """
    for name in ("TiB", "GiB", "MiB", "KiB"):
        factor = SIZE_UNITS[name]
        if nbytes and nbytes % factor == 0:
            return f"{nbytes // factor}{name}"
    return str(nbytes)


# A decimal number as text: what a float field accepts when it arrives as a string (`"1e-3"` from
# a quoted YAML scalar or a dict). Python's float() would also take "nan", "infinity" and "1_0".
_DECIMAL_RE = re.compile(r"^[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?$")


def approx_size(nbytes: int) -> str:
    """``nbytes`` for a person, rounded: ``"1.50 GiB"``, ``"64.00 TiB"``, ``"12.0 MiB"`` (``format_size`` is the
    exact form a config takes)."""
    for name in ("TiB", "GiB"):
        if abs(nbytes) >= SIZE_UNITS[name]:
            return f"{nbytes / SIZE_UNITS[name]:.2f} {name}"
    return f"{nbytes / SIZE_UNITS['MiB']:.1f} MiB"


class SpecError(Exception):
    """A value failed its field's spec; :mod:`runtime.config.loader` adds the YAML path and line.

    Attributes:
        kind: one of the :class:`runtime.config.loader.ConfigError` kinds.
        message: what was expected and what was found, without the location.
        hint: a replacement for the generic "Write e.g. `key: default`." suggestion.
        index: position inside a list value, when the problem is one element.
    """

    def __init__(self, kind: str, message: str, hint: str | None = None,
                 index: int | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.hint = hint
        self.index = index


def describe_value(value: object) -> str:
    """Return a short, user-facing rendering of a config value for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        text = str(value) if abs(value) < 10**30 else f"an integer of {len(str(abs(value)))} digits"
        return text
    if isinstance(value, float):
        return f"{value!r} (a float)"
    if isinstance(value, str):
        shown = value if len(value) <= 60 else value[:57] + "..."
        return f"{shown!r} (text)"
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return f"a {type(value).__name__}"


def _num(x: float) -> str:
    """Render a bound compactly: 0, 1, 1e-08."""
    return f"{x:g}"


@dataclass(frozen=True)
class Spec:
    """Base of all field specs: how to check a value and how to show the field's type."""

    nullable: bool = field(default=False, kw_only=True)

    def describe(self) -> str:
        """Return what the field accepts, as a phrase: "an integer in 1..64"."""
        raise NotImplementedError

    def check(self, value: object) -> object:
        """Return ``value`` normalised (e.g. a size in bytes) or raise :class:`SpecError`.

        ``value`` is never None here: null is handled by the caller using :attr:`nullable`.
        """
        raise NotImplementedError

    def to_plain(self, value: Any) -> object:
        """Return ``value`` as plain YAML-ready data (lists, str, int, float, bool)."""
        return value

    def wrong_type(self, value: object, hint: str | None = None) -> SpecError:
        """Build the standard "expected X, got Y" error of kind ``wrong_type``."""
        return SpecError("wrong_type", f"expected {self.describe()}, got {describe_value(value)}",
                         hint)


@dataclass(frozen=True)
class IntSpec(Spec):
    """An integer within ``[min, max]``; bools and floats are refused, ``auto`` if allowed."""

    min: int | None = None
    max: int | None = None
    auto: bool = False

    def describe(self) -> str:
        """See :meth:`Spec.describe`."""
        if self.min is not None and self.max is not None:
            text = f"an integer in {self.min}..{self.max}"
        elif self.min is not None:
            text = f"an integer >= {self.min}"
        elif self.max is not None:
            text = f"an integer <= {self.max}"
        else:
            text = "an integer"
        return f"`auto` or {text}" if self.auto else text

    def check(self, value: object) -> object:
        """See :meth:`Spec.check`."""
        if self.auto and value == "auto":
            return "auto"
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.wrong_type(value, self._whole_number_hint(value))
        if (self.min is not None and value < self.min) or (
                self.max is not None and value > self.max):
            raise SpecError("out_of_range", f"expected {self.describe()}, got {value}")
        return value

    @staticmethod
    def _whole_number_hint(value: object) -> str | None:
        # Policy: `1e8` and `100.0` are refused for integer fields even when exact, because a
        # float literal in an integer field is more often a typo than shorthand. The hint tells
        # the user the exact integer to write instead.
        number: float | None = None
        if isinstance(value, float) and math.isfinite(value):
            number = value
        elif isinstance(value, str) and _DECIMAL_RE.match(value.strip()):
            number = float(value)
        if number is not None and math.isfinite(number) and number.is_integer():
            return f"Write the whole number `{int(number)}` (no exponent, no quotes)."
        return None


@dataclass(frozen=True)
class FloatSpec(Spec):
    """A finite number within bounds; ints and decimal strings such as ``"1e-3"`` are accepted, ``auto`` if
    allowed."""

    min: float | None = None
    max: float | None = None
    min_open: bool = False
    max_open: bool = False
    auto: bool = False

    def describe(self) -> str:
        """See :meth:`Spec.describe`."""
        text = self._describe_number()
        return f"`auto` or {text}" if self.auto else text

    def _describe_number(self) -> str:
        if self.min is not None and self.max is not None:
            left = "(" if self.min_open else "["
            right = ")" if self.max_open else "]"
            return f"a number in {left}{_num(self.min)}, {_num(self.max)}{right}"
        if self.min is not None:
            return f"a number {'>' if self.min_open else '>='} {_num(self.min)}"
        if self.max is not None:
            return f"a number {'<' if self.max_open else '<='} {_num(self.max)}"
        return "a number"

    def check(self, value: object) -> object:
        """See :meth:`Spec.check`."""
        if self.auto and value == "auto":
            return "auto"
        if isinstance(value, bool):
            raise self.wrong_type(value)
        if isinstance(value, str) and _DECIMAL_RE.match(value.strip()):
            # YAML 1.1 readers hand `1e-3` over as text; it is a number in every other reader.
            value = float(value)
        if isinstance(value, int):
            try:
                value = float(value)
            except OverflowError:
                message = f"expected {self.describe()}, got {describe_value(value)}"
                raise SpecError("out_of_range", message) from None
        if not isinstance(value, float):
            raise self.wrong_type(value)
        if not math.isfinite(value):
            raise SpecError("out_of_range", f"expected {self.describe()}, got {value!r}")
        too_low = self.min is not None and (
            value < self.min or (self.min_open and value == self.min))
        too_high = self.max is not None and (
            value > self.max or (self.max_open and value == self.max))
        if too_low or too_high:
            raise SpecError("out_of_range", f"expected {self.describe()}, got {value!r}")
        return value


@dataclass(frozen=True)
class BoolSpec(Spec):
    """``true`` or ``false`` (only those spellings), or ``auto`` when allowed."""

    auto: bool = False

    def describe(self) -> str:
        """See :meth:`Spec.describe`."""
        return "`auto`, true or false" if self.auto else "true or false"

    def check(self, value: object) -> object:
        """See :meth:`Spec.check`."""
        if self.auto and value == "auto":
            return "auto"
        if not isinstance(value, bool):
            raise self.wrong_type(value)
        return value


@dataclass(frozen=True)
class ChoiceSpec(Spec):
    """One string out of a fixed set; ``true``/``false`` map to ``bool_aliases`` if given."""

    choices: tuple[str, ...] = ()
    #: (name for true, name for false): lets ``direct_io: true`` mean ``on``.
    bool_aliases: tuple[str, str] | None = None
    #: Why a value that is not a choice is refused, when the reason is not obvious.
    note: str = ""

    def describe(self) -> str:
        """See :meth:`Spec.describe`."""
        return "one of " + ", ".join(f"`{c}`" for c in self.choices)

    def check(self, value: object) -> object:
        """See :meth:`Spec.check`."""
        if isinstance(value, bool) and self.bool_aliases is not None:
            return self.bool_aliases[0] if value else self.bool_aliases[1]
        if not isinstance(value, str):
            raise self.wrong_type(value)
        if value in self.choices:
            return value
        lowered = [c for c in self.choices if c.lower() == value.strip().lower()]
        hint = f" Did you mean `{lowered[0]}`?" if lowered else ""
        note = f" {self.note}" if self.note else ""
        raise SpecError("bad_value",
                        f"expected {self.describe()}, got {describe_value(value)}.{note}{hint}")


@dataclass(frozen=True)
class SizeSpec(Spec):
    """A byte size (int or string with a unit, see :func:`runtime.config.units.parse_size`)."""

    min_nbytes: int = 0
    max_nbytes: int = MAX_NBYTES
    multiple_of: int = 1
    auto: bool = False

    def describe(self) -> str:
        """See :meth:`Spec.describe`."""
        limits = []
        if self.min_nbytes == 1:
            limits.append("> 0")
        elif self.min_nbytes > 1:
            limits.append(f">= {format_size(self.min_nbytes)}")
        if self.max_nbytes < MAX_NBYTES:
            limits.append(f"<= {format_size(self.max_nbytes)}")
        if self.multiple_of > 1:
            limits.append(f"a multiple of {self.multiple_of} bytes")
        text = "a size such as `64MiB`" + (f" ({', '.join(limits)})" if limits else "")
        return f"`auto` or {text}" if self.auto else text

    def check(self, value: object) -> object:
        """See :meth:`Spec.check`."""
        if self.auto and value == "auto":
            return "auto"
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise self.wrong_type(value)
        try:
            nbytes = size_to_nbytes(value)
        except ValueError as exc:
            raise SpecError("bad_value", f"{exc}. `auto` is accepted too" if self.auto else f"{exc}") from None
        if not self.min_nbytes <= nbytes <= self.max_nbytes:
            raise SpecError("out_of_range",
                            f"expected {self.describe()}, got {describe_value(value)}")
        if nbytes % self.multiple_of:
            raise SpecError("bad_value", f"expected {self.describe()}, got "
                            f"{describe_value(value)} = {nbytes} bytes, which is not a multiple "
                            f"of {self.multiple_of}")
        return nbytes

    def to_plain(self, value: Any) -> object:
        """Sizes are dumped in the largest exact binary unit, e.g. ``64MiB``."""
        return value if value == "auto" else format_size(value)


@dataclass(frozen=True)
class PathSpec(Spec):
    """A file-system path as text; a leading ``~`` is expanded to the home directory."""

    def describe(self) -> str:
        """See :meth:`Spec.describe`."""
        text = "a directory path"
        return f"{text} or null" if self.nullable else text

    def check(self, value: object) -> object:
        """See :meth:`Spec.check`."""
        if not isinstance(value, str):
            raise self.wrong_type(value, "Quote the path if it looks like a number, e.g. "
                                  "`path: \"2024\"`." if isinstance(value, (int, float)) else None)
        if not value.strip():
            raise SpecError("bad_value", "the path is empty" +
                            ("; write null to leave it unset" if self.nullable else ""))
        if "\0" in value:
            raise SpecError("bad_value", "the path contains a NUL character")
        return os.path.expanduser(value)


@dataclass(frozen=True)
class PatternListSpec(Spec):
    """A non-empty list of module-name glob patterns such as ``model.layers.*``."""

    def describe(self) -> str:
        """See :meth:`Spec.describe`."""
        text = "a list of module-name patterns such as `[\"model.layers.*\"]`"
        return f"{text} or null" if self.nullable else text

    def check(self, value: object) -> object:
        """See :meth:`Spec.check`."""
        if not isinstance(value, (list, tuple)):
            raise self.wrong_type(value)
        if not value:
            raise SpecError("bad_value", "the list is empty; write null for the automatic grouping")
        for index, item in enumerate(value):
            if not isinstance(item, str):
                raise SpecError("wrong_type", f"expected a module-name pattern (text), got "
                                f"{describe_value(item)}", index=index)
            if not item.strip():
                raise SpecError("bad_value", "the pattern is empty", index=index)
        return tuple(value)

    def to_plain(self, value: Any) -> object:
        """Tuples are stored (frozen dataclasses must hold immutable values); YAML wants lists."""
        return None if value is None else list(value)


@dataclass(frozen=True)
class FloatListSpec(Spec):
    """A list of exactly ``length`` numbers, each checked by ``item``."""

    length: int = 2
    item: FloatSpec = FloatSpec()

    def describe(self) -> str:
        """See :meth:`Spec.describe`."""
        each = self.item.describe().removeprefix("a number ")
        return f"a list of {self.length} numbers, each {each}"

    def check(self, value: object) -> object:
        """See :meth:`Spec.check`."""
        if not isinstance(value, (list, tuple)):
            raise self.wrong_type(value)
        if len(value) != self.length:
            raise SpecError("bad_value", f"expected {self.describe()}, got a list of {len(value)}")
        checked = []
        for index, item in enumerate(value):
            if item is None:
                raise SpecError("wrong_type", f"expected {self.item.describe()}, got null",
                                index=index)
            try:
                checked.append(self.item.check(item))
            except SpecError as exc:
                exc.index = index
                raise
        return tuple(checked)

    def to_plain(self, value: Any) -> object:
        """Dump as a list."""
        return list(value)
