"""Reading a checkpoint's ``meta.json`` without trusting it: verified against the manifest as it is read,
size-capped, and every value ``runtime.checkpoint.state`` uses checked for type, range and finiteness before
anything is restored. Keys this module does not know are left to their readers (a newer writer may add
some); a known key with a bad value is a CheckpointError naming the file and the key.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

from runtime.checkpoint.files import META_NAME, CheckpointError, FileEntry, parse_json, read_verified
from runtime.update.moments import MOMENT_DTYPES

FORMAT = "tierstore-checkpoint"
VERSION = 1
MAX_STEP = 1 << 53  # steps are counted in float64 too (AdamW's per-parameter counters): beyond this they round
_MT_WORDS = 624  # Mersenne Twister state words (Python's and NumPy's generators)


def read_meta(path: Path, files: dict[str, FileEntry]) -> dict[str, Any]:
    """The checked content of ``path/meta.json``; ``files``: the manifest's entries (meta.json among them)."""
    meta_path = path / META_NAME
    if META_NAME not in files:
        raise CheckpointError(f"{meta_path}: not listed in the manifest")
    meta = parse_json(read_verified(meta_path, files[META_NAME]), meta_path)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{meta_path}: not a tierstore checkpoint")
    if meta.get("version") != VERSION:
        raise CheckpointError(f"{meta_path}: checkpoint version {meta.get('version')!r}, this tierstore reads {VERSION}")
    if meta.get("byte_order") != "little" or sys.byteorder != "little":
        raise CheckpointError(f"{meta_path}: byte order {meta.get('byte_order')!r} on a {sys.byteorder}-endian host")
    _check_values(meta, meta_path)
    return meta


def _bad(meta_path: Path, key: str, value: Any, wanted: str) -> CheckpointError:
    return CheckpointError(f"{meta_path}: {key} is {_short(value)}, expected {wanted} (corrupted or modified)")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _int(meta_path: Path, key: str, value: Any, low: int, high: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise _bad(meta_path, key, value, f"an integer in {low}..{high}")
    return value


def _number(meta_path: Path, key: str, value: Any, low: float, high: float = math.inf, *, integral: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and low <= value <= high
    if not ok or (integral and value != int(value)):
        raise _bad(meta_path, key, value, f"a finite {'whole ' if integral else ''}number in {low}..{high}")
    return float(value)


def _mapping(meta_path: Path, key: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _bad(meta_path, key, value, "a mapping")
    return value


def _optional_mapping(meta_path: Path, key: str, value: Any) -> dict[str, Any] | None:
    if value is not None and not isinstance(value, dict):
        raise _bad(meta_path, key, value, "a mapping or null")
    return value


def _list(meta_path: Path, key: str, value: Any, length: int | None = None) -> list[Any]:
    if not isinstance(value, list) or (length is not None and len(value) != length):
        raise _bad(meta_path, key, value, "a list" + (f" of {length}" if length is not None else ""))
    return value


def _check_values(meta: dict[str, Any], meta_path: Path) -> None:
    """Types, ranges and finiteness of every value the loader uses (shape agreement with the session is
    checked by the loader, which knows the model)."""
    _int(meta_path, "step", meta.get("step"), 0, MAX_STEP)
    if "lr" in meta and meta["lr"] is not None:
        _number(meta_path, "lr", meta["lr"], 0.0)
    for i, block in enumerate(_list(meta_path, "blocks", meta.get("blocks"))):
        block = _mapping(meta_path, f"blocks[{i}]", block)
        for j, value in enumerate(_list(meta_path, f"blocks[{i}].param_steps", block.get("param_steps"))):
            # Not bounded by ``step``: optimizer.load_state_dict brings counters from another run.
            _number(meta_path, f"blocks[{i}].param_steps[{j}]", value, 0, MAX_STEP, integral=True)
    for key, entry in _mapping(meta_path, "tensors", meta.get("tensors")).items():
        entry = _mapping(meta_path, f"tensors.{key}", entry)
        _int(meta_path, f"tensors.{key}.numel", entry.get("numel"), 0, 1 << 48)
    scaler = _optional_mapping(meta_path, "scaler", meta.get("scaler"))
    if scaler is not None:
        _number(meta_path, "scaler.scale", scaler.get("scale"), math.ulp(0.0))  # > 0
        _int(meta_path, "scaler.growth_tracker", scaler.get("growth_tracker"), 0, MAX_STEP)
    _check_data(meta.get("data"), meta_path, "data")
    if meta.get("moment_dtype", "fp32") not in MOMENT_DTYPES:  # absent: written before compact moments, fp32
        raise _bad(meta_path, "moment_dtype", meta.get("moment_dtype"), f"one of {', '.join(MOMENT_DTYPES)}")
    _check_rng(_mapping(meta_path, "rng", meta.get("rng")), meta_path)
    if "ranks" in meta:  # several processes: each rank's RNG states and data position, rank 0's first
        for rank, entry in enumerate(_list(meta_path, "ranks", meta["ranks"])):
            entry = _mapping(meta_path, f"ranks[{rank}]", entry)
            _check_rng(_mapping(meta_path, f"ranks[{rank}].rng", entry.get("rng")), meta_path, f"ranks[{rank}].rng")
            _check_data(entry.get("data"), meta_path, f"ranks[{rank}].data")


def _check_data(value: Any, meta_path: Path, key: str) -> None:
    data = _optional_mapping(meta_path, key, value)
    if data is not None:
        _int(meta_path, f"{key}.position", data.get("position"), 0, MAX_STEP)


def saved_moment_dtype(meta: dict[str, Any]) -> str:
    """How the checkpoint's moments are stored (``optimizer.moment_dtype`` of the saving run; fp32 before it existed)."""
    return str(meta.get("moment_dtype", "fp32"))


def _check_rng(rng: dict[str, Any], meta_path: Path, key: str = "rng") -> None:
    """Python's and NumPy's Mersenne Twister states, as ``random.getstate`` / ``np.random.get_state`` give them."""
    _list(meta_path, f"{key}.cuda", rng.get("cuda"))
    version, internal, gauss = _list(meta_path, f"{key}.python", rng.get("python"), 3)
    _int(meta_path, f"{key}.python[0]", version, 0, 1 << 16)
    words = _list(meta_path, f"{key}.python[1]", internal, _MT_WORDS + 1)
    for k, word in enumerate(words[:-1]):
        _int(meta_path, f"{key}.python[1][{k}]", word, 0, (1 << 32) - 1)
    _int(meta_path, f"{key}.python[1][{_MT_WORDS}]", words[-1], 0, _MT_WORDS)
    if gauss is not None:
        _number(meta_path, f"{key}.python[2]", gauss, -math.inf)
    name, keys, pos, has_gauss, cached = _list(meta_path, f"{key}.numpy", rng.get("numpy"), 5)
    if name != "MT19937":
        raise _bad(meta_path, f"{key}.numpy[0]", name, "'MT19937'")
    for k, word in enumerate(_list(meta_path, f"{key}.numpy[1]", keys, _MT_WORDS)):
        _int(meta_path, f"{key}.numpy[1][{k}]", word, 0, (1 << 32) - 1)
    _int(meta_path, f"{key}.numpy[2]", pos, 0, _MT_WORDS)
    _int(meta_path, f"{key}.numpy[3]", has_gauss, 0, 1)
    _number(meta_path, f"{key}.numpy[4]", cached, -math.inf)
