"""Property tests: a mutated config either loads or raises ConfigError, never anything else."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.config.loader import ConfigError, TierstoreConfig, dump_config, load_config

REPO = Path(__file__).resolve().parents[4]
EXAMPLE_TEXTS = [p.read_text() for p in sorted((REPO / "examples").glob("*.yaml"))]
SETTINGS = settings(max_examples=200, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def _plain(cfg: TierstoreConfig) -> dict[str, Any]:
    """A valid config as a plain nested dict (lists, not tuples) to mutate."""
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


BASES = [
    _plain(TierstoreConfig()),
    {},
    {"tiers": {"nvme": {"path": "tmp"}}, "placement": {"master": "nvme", "moments": "nvme"}},
    {"placement": {"weights": "gpu"}, "optimizer": {"gpu_update_fraction": 0.25},
     "blocks": {"modules": ["model.layers.*"]}, "dtype": "fp16"},
]

BOUNDARY_VALUES = [0, -1, 1, 2, 7, 8, 64, 65, 4096, 2**31, 2**63, 2**64, 10**30, -(2**63),
                   0.0, -0.0, 0.5, 1.0, 1.5, -1.5, 1e-300, 1e308, 1e8, float("inf"),
                   float("nan"), "1e8", "1e-3", "64MiB", "-1GiB", "12 GiBs", "auto", "tmp", "",
                   " ", "on", "off", "null", "nvme", "gpu", "host", "~", "\0", True, False, None,
                   [], {}, [0.9, 0.999], ["a", 1]]

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
    st.sampled_from(BOUNDARY_VALUES),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=6,
)


def _key_paths(tree: dict[str, Any], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    paths = []
    for key, value in tree.items():
        paths.append((*prefix, key))
        if isinstance(value, dict):
            paths.extend(_key_paths(value, (*prefix, key)))
    return paths


def _mutate(tree: dict[str, Any], data: st.DataObject) -> dict[str, Any]:
    tree = copy.deepcopy(tree)
    paths = _key_paths(tree)
    op = data.draw(st.sampled_from(["drop", "rename", "set", "set_new", "wrap"]))
    if not paths:
        op = "set_new"
    if op == "set_new":
        # A key that may or may not exist, anywhere.
        parent = tree
        for _ in range(data.draw(st.integers(0, 2))):
            children = [v for v in parent.values() if isinstance(v, dict)]
            if not children:
                break
            parent = data.draw(st.sampled_from(children))
        key = data.draw(st.one_of(st.text(max_size=10),
                                  st.sampled_from(["seed", "path", "io_threads", "lr", "nvme"])))
        parent[key] = data.draw(values)
        return tree
    path = data.draw(st.sampled_from(paths))
    parent = tree
    for key in path[:-1]:
        parent = parent[key]
    last = path[-1]
    if op == "drop":
        del parent[last]
    elif op == "rename":
        new = data.draw(st.one_of(st.text(max_size=10), st.just(last.upper()),
                                  st.just(last[:-1]), st.just(last + "s")))
        parent[new] = parent.pop(last)
    elif op == "set":
        parent[last] = data.draw(values)
    else:  # wrap: a value turned into a list or mapping of itself
        parent[last] = data.draw(st.sampled_from([[parent[last]], {"value": parent[last]}]))
    return tree


def _load_ok_or_config_error(source: Any, workdir: Path, round_trip: bool = False) -> None:
    try:
        cfg = load_config(source)
    except ConfigError as exc:
        assert exc.kind and exc.yaml_path and exc.message
        assert exc.line is None or exc.line >= 1
        str(exc)
    else:
        assert isinstance(cfg, TierstoreConfig)
        if round_trip:
            # Whatever loads must survive its own dump (checked on the dict path only: the
            # pure-Python YAML reader is slow enough to matter at 200 examples per test).
            assert load_config(_write_text(workdir, dump_config(cfg))) == cfg


def _write_text(workdir: Path, text: str, name: str = "dumped.yaml") -> Path:
    path = workdir / name
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One directory for every example: Hypothesis reruns a test body many times."""
    return tmp_path_factory.mktemp("config_property")


@SETTINGS
@given(base=st.sampled_from(BASES), data=st.data())
def test_mutated_dict_loads_or_raises_config_error(workdir: Path, base: dict[str, Any],
                                                   data: st.DataObject) -> None:
    mutated = _mutate(base, data)
    if data.draw(st.booleans()):
        mutated = _mutate(mutated, data)
    _load_ok_or_config_error(mutated, workdir, round_trip=True)


@SETTINGS
@given(base=st.sampled_from(BASES), data=st.data())
def test_mutated_yaml_loads_or_raises_config_error(workdir: Path, base: dict[str, Any],
                                                   data: st.DataObject) -> None:
    # JSON is YAML: the mutated tree written as a document exercises the YAML reader too.
    mutated = _mutate(base, data)
    _load_ok_or_config_error(_write_text(workdir, json.dumps(mutated), "mutated.yaml"), workdir)


TEXT_TOKENS = ["0", "-1", "1e8", "1.0e+8", "1.5", "99999999999999999999999", "true", "off",
               "null", "~", "[]", "{}", "[1, 2, 3]", ".nan", "-.inf", "010", "0x1F", "12 GiBs",
               "'unterminated", "&a 1", "*a", "!!binary aGk=", "!!python/name:os.system",
               "!!int x", "!custom 3", "|\n  text", "{a: 1, a: 2}", "[*a]", "2001-12-14", "1:30"]


def _mutate_lines(lines: list[str], data: st.DataObject) -> None:
    index = data.draw(st.integers(0, len(lines) - 1))
    op = data.draw(st.sampled_from(["duplicate", "delete", "value", "value", "value", "insert",
                                    "indent"]))
    line = lines[index]
    if op == "duplicate":
        lines.insert(index, line)
    elif op == "delete":
        del lines[index]
    elif op == "value" and ":" in line:
        token = data.draw(st.one_of(st.sampled_from(TEXT_TOKENS), st.sampled_from(TEXT_TOKENS),
                                    st.text(max_size=15)))
        lines[index] = line.split(":", 1)[0] + ": " + token
    elif op == "insert":
        lines.insert(index, data.draw(st.text(max_size=20)))
    else:
        lines[index] = data.draw(st.sampled_from(["  ", "\t", "    "])) + line


@SETTINGS
@given(text=st.sampled_from([dump_config(TierstoreConfig()), *EXAMPLE_TEXTS]), data=st.data())
def test_mutated_text_loads_or_raises_config_error(workdir: Path, text: str,
                                                   data: st.DataObject) -> None:
    lines = text.splitlines()
    for _ in range(data.draw(st.integers(1, 3))):
        if lines:
            _mutate_lines(lines, data)
    _load_ok_or_config_error(_write_text(workdir, "\n".join(lines) + "\n", "text.yaml"), workdir)
