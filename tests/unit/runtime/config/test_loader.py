"""Tests of runtime.config.loader: strict loading, error locations, round trips, environment checks."""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import stat
import textwrap
from pathlib import Path

import pytest

from runtime.config import loader as config_module
from runtime.config.loader import (
    ConfigError,
    TierstoreConfig,
    check_environment,
    config_reference_markdown,
    dump_config,
    load_config,
    parse_size,
)
from runtime.config.schema import schema_paths
from runtime.config.units import format_size

REPO = Path(__file__).resolve().parents[4]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


def _write(tmp_path: Path, text: str, name: str = "tiers.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def _load_text(tmp_path: Path, text: str) -> TierstoreConfig:
    return load_config(_write(tmp_path, text))


# (yaml text, kind, yaml_path, 1-based line). Text is dedented before writing.
BAD_CONFIGS = [
    # --- unknown keys, at every depth
    pytest.param("devise: cpu\n", "unknown_key", "devise", 1, id="unknown-root"),
    pytest.param("""\
        tiers:
          nvme:
            io_thread: 4
        """, "unknown_key", "tiers.nvme.io_thread", 3, id="unknown-nested-typo"),
    pytest.param("placement:\n  weight: host\n", "unknown_key", "placement.weight", 2,
                 id="unknown-placement"),
    pytest.param("io_threads: 4\n", "unknown_key", "io_threads", 1, id="key-in-wrong-section"),
    pytest.param("optimizer:\n  <<: {lr: 0.1}\n", "unknown_key", "optimizer.<<", 2,
                 id="merge-key"),
    pytest.param("1: one\n", "unknown_key", "1", 1, id="numeric-key"),
    pytest.param("? [a, b]\n: 1\n", "unknown_key", "<root>", 1, id="complex-key"),
    pytest.param("train:\n  model:\n    layers: 4\n", "unknown_key", "train.model.layers", 3,
                 id="unknown-deep"),
    # --- duplicate keys
    pytest.param("seed: 1\nseed: 2\n", "duplicate_key", "seed", 2, id="duplicate-root"),
    pytest.param("tiers:\n  gpu: {}\n  gpu: {}\n", "duplicate_key", "tiers.gpu", 3,
                 id="duplicate-section"),
    pytest.param("prefetch: {depth: 1, depth: 2}\n", "duplicate_key", "prefetch.depth", 1,
                 id="duplicate-flow"),
    pytest.param("""\
        optimizer:
          lr: 0.1
        train:
          steps: 3
        optimizer:
          eps: 1.0e-6
        """, "duplicate_key", "optimizer", 5, id="duplicate-distant-section"),
    pytest.param('"seed": 1\nseed: 2\n', "duplicate_key", "seed", 2, id="duplicate-quoted"),
    # --- wrong types
    pytest.param("seed: true\n", "wrong_type", "seed", 1, id="bool-for-int"),
    pytest.param("train:\n  steps: 10.0\n", "wrong_type", "train.steps", 2, id="float-for-int"),
    pytest.param("train:\n  steps: 1e8\n", "wrong_type", "train.steps", 2, id="exp-for-int"),
    pytest.param('train:\n  batch_size: "8"\n', "wrong_type", "train.batch_size", 2,
                 id="quoted-int"),
    pytest.param("optimizer:\n  lr: fast\n", "wrong_type", "optimizer.lr", 2, id="text-for-float"),
    pytest.param("optimizer:\n  eps: false\n", "wrong_type", "optimizer.eps", 2,
                 id="bool-for-float"),
    pytest.param("dtype: [bf16]\n", "wrong_type", "dtype", 1, id="list-for-enum"),
    pytest.param("seed: {a: 1}\n", "wrong_type", "seed", 1, id="mapping-for-int"),
    pytest.param("tiers: big\n", "wrong_type", "tiers", 1, id="scalar-for-section"),
    pytest.param("optimizer:\n  - lr\n", "wrong_type", "optimizer", 2, id="list-for-section"),
    pytest.param("train:\n  steps:\n", "wrong_type", "train.steps", 2, id="null-int"),
    pytest.param("placement:\n  weights: null\n", "wrong_type", "placement.weights", 2,
                 id="null-enum"),
    pytest.param("tiers:\n  host:\n    pin: yes\n", "wrong_type", "tiers.host.pin", 3,
                 id="yes-is-text"),
    pytest.param("profile:\n  trace: 1\n", "wrong_type", "profile.trace", 2, id="int-for-bool"),
    pytest.param("prefetch:\n  budget: true\n", "wrong_type", "prefetch.budget", 2,
                 id="bool-for-size"),
    pytest.param("blocks:\n  modules: model.layers.*\n", "wrong_type", "blocks.modules", 2,
                 id="text-for-list"),
    pytest.param("blocks:\n  modules:\n    - model.a\n    - 3\n", "wrong_type",
                 "blocks.modules[1]", 4, id="int-in-pattern-list"),
    pytest.param("tiers:\n  nvme:\n    path: 2024\n", "wrong_type", "tiers.nvme.path", 3,
                 id="int-for-path"),
    pytest.param("optimizer:\n  cpu_threads: all\n", "wrong_type", "optimizer.cpu_threads", 2,
                 id="bad-auto-int"),
    pytest.param("seed: !!binary aGVsbG8=\n", "wrong_type", "seed", 1, id="binary-for-int"),
    # --- out of range
    pytest.param("""\
        tiers:
          nvme:
            io_threads: 0
        """, "out_of_range", "tiers.nvme.io_threads", 3, id="io-threads-zero"),
    pytest.param("tiers:\n  nvme:\n    io_threads: 65\n", "out_of_range",
                 "tiers.nvme.io_threads", 3, id="io-threads-too-many"),
    pytest.param("prefetch:\n  depth: -1\n", "out_of_range", "prefetch.depth", 2,
                 id="depth-negative"),
    pytest.param("optimizer:\n  lr: 0\n", "out_of_range", "optimizer.lr", 2, id="lr-zero"),
    pytest.param("optimizer:\n  lr: -1e-3\n", "out_of_range", "optimizer.lr", 2,
                 id="lr-negative"),
    pytest.param("optimizer:\n  lr: .inf\n", "out_of_range", "optimizer.lr", 2, id="lr-inf"),
    pytest.param("optimizer:\n  betas: [0.9, 1.0]\n", "out_of_range", "optimizer.betas[1]", 2,
                 id="beta-one"),
    pytest.param("optimizer:\n  betas:\n    - 0.9\n    - -0.1\n", "out_of_range",
                 "optimizer.betas[1]", 4, id="beta-negative-block-list"),
    pytest.param("optimizer:\n  gpu_update_fraction: 1.5\n", "out_of_range",
                 "optimizer.gpu_update_fraction", 2, id="fraction-above-one"),
    pytest.param("""\
        dtype: fp16
        optimizer:
          loss_scale:
            backoff_factor: 1.0
        """, "out_of_range", "optimizer.loss_scale.backoff_factor", 4, id="backoff-one"),
    pytest.param("optimizer:\n  loss_scale:\n    growth_factor: 1\n", "out_of_range",
                 "optimizer.loss_scale.growth_factor", 3, id="growth-one"),
    pytest.param("seed: -1\n", "out_of_range", "seed", 1, id="seed-negative"),
    pytest.param(f"seed: {2**64}\n", "out_of_range", "seed", 1, id="seed-huge"),
    pytest.param("train:\n  keep_last: 0\n", "out_of_range", "train.keep_last", 2,
                 id="keep-last-zero"),
    pytest.param("train:\n  seq_len: 4\n", "out_of_range", "train.seq_len", 2,
                 id="seq-len-too-short"),
    pytest.param("optimizer:\n  cpu_threads: 0\n", "out_of_range", "optimizer.cpu_threads", 2,
                 id="cpu-threads-zero"),
    pytest.param("prefetch:\n  budget: -1\n", "out_of_range", "prefetch.budget", 2,
                 id="size-negative-int"),
    pytest.param("prefetch:\n  budget: -1GiB\n", "out_of_range", "prefetch.budget", 2,
                 id="size-negative-text"),
    pytest.param("tiers:\n  nvme:\n    block_size: 1KiB\n", "out_of_range",
                 "tiers.nvme.block_size", 3, id="block-size-small"),
    pytest.param("tiers:\n  nvme:\n    block_size: 2GiB\n", "out_of_range",
                 "tiers.nvme.block_size", 3, id="block-size-large"),
    pytest.param("tiers:\n  gpu:\n    budget: 0\n", "out_of_range", "tiers.gpu.budget", 3,
                 id="gpu-budget-zero"),
    # --- bad values
    pytest.param("device: gpu\n", "bad_value", "device", 1, id="enum-device"),
    pytest.param("dtype: float16\n", "bad_value", "dtype", 1, id="enum-dtype"),
    pytest.param("placement:\n  gradients: nvme\n", "bad_value", "placement.gradients", 2,
                 id="gradients-on-nvme"),
    pytest.param("optimizer:\n  overlap: async\n", "bad_value", "optimizer.overlap", 2,
                 id="enum-overlap"),
    pytest.param("tiers:\n  nvme:\n    direct_io: maybe\n", "bad_value", "tiers.nvme.direct_io",
                 3, id="enum-direct-io"),
    pytest.param("prefetch:\n  budget: 12 GiBs\n", "bad_value", "prefetch.budget", 2,
                 id="size-bad-unit"),
    pytest.param("prefetch:\n  budget: 2G\n", "bad_value", "prefetch.budget", 2,
                 id="size-ambiguous-unit"),
    pytest.param("tiers:\n  gpu:\n    budget: most\n", "bad_value", "tiers.gpu.budget", 3,
                 id="size-not-a-size"),
    pytest.param("tiers:\n  nvme:\n    block_size: 5000\n", "bad_value",
                 "tiers.nvme.block_size", 3, id="block-size-not-multiple"),
    pytest.param("optimizer:\n  betas: [0.9, 0.99, 0.999]\n", "bad_value", "optimizer.betas", 2,
                 id="betas-three"),
    pytest.param("blocks:\n  modules: []\n", "bad_value", "blocks.modules", 2,
                 id="patterns-empty"),
    pytest.param('tiers:\n  nvme:\n    path: ""\n', "bad_value", "tiers.nvme.path", 3,
                 id="path-empty"),
    pytest.param("seed: !!python/name:os.system\n", "bad_value", "seed", 1, id="python-tag"),
    pytest.param("blocks:\n  modules: &a [*a]\n", "bad_value", "blocks.modules[0]", 2,
                 id="recursive-alias"),
    # --- contradictions between settings
    pytest.param("""\
        train:
          model:
            hidden_size: 250
        """, "bad_value", "train.model.hidden_size", 3, id="hidden-not-divisible"),
    pytest.param("""\
        train:
          model:
            num_heads: 3
        """, "bad_value", "train.model.hidden_size", 3, id="heads-not-dividing-default"),
    pytest.param("""\
        train:
          seq_len: 2048
        """, "out_of_range", "train.seq_len", 2, id="seq-len-beyond-model"),
    pytest.param("""\
        tiers:
          nvme:
            path: tmp
            budget: 16MiB
            block_size: 32MiB
        """, "bad_value", "tiers.nvme.block_size", 5, id="block-larger-than-budget"),
    # --- missing keys
    pytest.param("""\
        seed: 1
        placement:
          moments: nvme
        """, "missing_key", "tiers.nvme.path", 3, id="nvme-placement-without-path"),
    pytest.param("""\
        tiers:
          nvme:
            path: null
        placement:
          master: nvme
        """, "missing_key", "tiers.nvme.path", 3, id="nvme-placement-null-path"),
    pytest.param("""\
        train:
          save_every: 10
        """, "missing_key", "train.checkpoint_dir", 2, id="save-every-without-dir"),
    # --- documents that are not configs
    pytest.param("", "empty", "<root>", None, id="empty-file"),
    pytest.param("# only a comment\n\n", "empty", "<root>", None, id="comments-only"),
    pytest.param("- a\n- b\n", "not_mapping", "<root>", 1, id="root-list"),
    pytest.param("\nhello\n", "not_mapping", "<root>", 2, id="root-scalar"),
    pytest.param("seed: [1, 2\ndtype: bf16\n", "yaml_syntax", "<root>", 2, id="unclosed-flow"),
    pytest.param("tiers:\n\tgpu: {}\n", "yaml_syntax", "<root>", 2, id="tab-indent"),
    pytest.param("seed: 1\n---\nseed: 2\n", "yaml_syntax", "<root>", 2, id="two-documents"),
    pytest.param("seed: 1\ndtype: 'bf16\n", "yaml_syntax", "<root>", 3, id="unclosed-quote"),
    pytest.param("seed: 1\x07\n", "yaml_syntax", "<root>", 1, id="control-character"),
    # --- environment
    pytest.param("""\
        tiers:
          nvme:
            path: /nonexistent-tierstore-test/swap
        """, "environment", "tiers.nvme.path", 3, id="nvme-path-missing"),
]


@pytest.mark.parametrize(("text", "kind", "yaml_path", "line"), BAD_CONFIGS)
def test_bad_config_is_refused_with_location(tmp_path: Path, text: str, kind: str,
                                             yaml_path: str, line: int | None) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    err = info.value
    assert (err.kind, err.yaml_path, err.line) == (kind, yaml_path, line), str(err)
    assert err.source == str(path)
    # The rendered message leads with file, line and key path, so an editor can jump there.
    prefix = f"{path}:{line}: " if line is not None else f"{path}: "
    assert str(err).startswith(prefix + yaml_path + ": ")
    assert err.message and err.message in str(err)


def test_bad_config_count() -> None:
    assert len(BAD_CONFIGS) >= 40


def test_message_matches_brief_example(tmp_path: Path) -> None:
    path = _write(tmp_path, "seed: 0\n\ntiers:\n  nvme:\n    io_threads: 0\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == (f"{path}:5: tiers.nvme.io_threads: expected an integer in 1..64, "
                               "got 0. Write e.g. `io_threads: 4`.")


@pytest.mark.parametrize(("text", "needle"), [
    ("tiers:\n  nvme:\n    io_thread: 4\n", "did you mean `io_threads`?"),
    ("Seed: 3\n", "did you mean `seed`?"),
    ("io_threads: 4\n", "it belongs at `tiers.nvme.io_threads`"),
    ("seed: 1\nseed: 2\n", "first on line 1"),
    ("train:\n  steps: 1e8\n", "`100000000`"),
    ("device: gpu\n", "`auto`, `cuda`, `cpu`"),
    ("device: CPU\n", "Did you mean `cpu`?"),
    ("prefetch:\n  budget: 12 GiBs\n", "did you mean `GiB`?"),
    ("placement:\n  master: nvme\n", "placement.master"),
    ("tiers:\n\tgpu: {}\n", "tabs"),
    ("train:\n  model:\n    hidden_size: 250\n", "num_heads 4"),
    ("", "`{}`"),
    ("optimizer:\n  moment_kernel: compiled\n", "only bf16 and int8 moments have one"),  # fp32 moments: it would never run
])
def test_messages_say_what_to_write(tmp_path: Path, text: str, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        _load_text(tmp_path, text)
    assert needle in str(info.value)


# --- what is accepted, and how it is read

def test_defaults() -> None:
    cfg = load_config()
    assert cfg == TierstoreConfig() == load_config({})
    assert cfg.tiers.nvme.path is None
    assert cfg.tiers.nvme.budget == 64 * 2**30
    assert cfg.tiers.nvme.block_size == 64 * 2**20
    assert cfg.optimizer.betas == (0.9, 0.999)
    assert cfg.placement.gradients == "host"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.seed = 3  # type: ignore[misc]


def test_yaml_12_scalars(tmp_path: Path) -> None:
    cfg = _load_text(tmp_path, """\
        seed: 010
        tiers:
          nvme:
            direct_io: off
        optimizer:
          lr: 1e-3
          eps: "1e-6"
          weight_decay: 0
        """)
    assert cfg.seed == 10  # not octal 8
    assert cfg.tiers.nvme.direct_io == "off"  # the text, not the boolean false
    assert cfg.optimizer.lr == 1e-3 and isinstance(cfg.optimizer.lr, float)
    assert cfg.optimizer.eps == 1e-6
    assert cfg.optimizer.weight_decay == 0.0 and isinstance(cfg.optimizer.weight_decay, float)


def test_sizes_autos_and_aliases(tmp_path: Path) -> None:
    cfg = _load_text(tmp_path, """\
        tiers:
          gpu: {budget: 20GiB}
          host: {budget: "1.5GB", pin: false}
          nvme: {path: tmp, budget: 1e12, block_size: 4 KiB, direct_io: true}
        prefetch: {budget: 0}
        optimizer: {cpu_threads: 6, grad_clip: null}
        """)
    assert cfg.tiers.gpu.budget == 20 * 2**30
    assert cfg.tiers.host.budget == 1_500_000_000
    assert cfg.tiers.host.pin is False
    assert cfg.tiers.nvme.budget == 10**12
    assert cfg.tiers.nvme.block_size == 4096
    assert cfg.tiers.nvme.direct_io == "on"
    assert cfg.tiers.nvme.path == "tmp"
    assert cfg.prefetch.budget == 0
    assert cfg.optimizer.cpu_threads == 6
    assert cfg.optimizer.grad_clip is None


def test_empty_section_takes_defaults(tmp_path: Path) -> None:
    cfg = _load_text(tmp_path, "tiers:\n  nvme:\n    # path: /mnt/nvme\nseed: 4\n")
    assert cfg.tiers.nvme == TierstoreConfig().tiers.nvme
    assert cfg.seed == 4


def test_home_is_expanded(tmp_path: Path) -> None:
    cfg = load_config({"profile": {"dir": "~/profiles"}})
    assert cfg.profile.dir == os.path.expanduser("~/profiles")


def test_loss_scale_without_fp16_warns(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="runtime.config.loader"):
        load_config({"optimizer": {"loss_scale": {"initial": 1024}}})
    assert "loss_scale" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="runtime.config.loader"):
        load_config({"dtype": "fp16", "optimizer": {"loss_scale": {"initial": 1024}}})
        load_config()
    assert caplog.text == ""


# --- dict input

def test_dict_input_validates_without_lines() -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"tiers": {"nvme": {"io_threads": 0}}})
    err = info.value
    assert (err.kind, err.yaml_path, err.line, err.source) == (
        "out_of_range", "tiers.nvme.io_threads", None, None)
    assert str(err).startswith("tiers.nvme.io_threads: expected")


@pytest.mark.parametrize(("raw", "kind", "yaml_path"), [
    ({"tiers": {"nvme": {"io_thread": 4}}}, "unknown_key", "tiers.nvme.io_thread"),
    ({3: "x"}, "unknown_key", "3"),
    ({"seed": True}, "wrong_type", "seed"),
    ({"seed": 1.0}, "wrong_type", "seed"),
    ({"optimizer": {"betas": (0.9, 2)}}, "out_of_range", "optimizer.betas[1]"),
    ({"tiers": []}, "wrong_type", "tiers"),
    ({"placement": {"master": "nvme"}}, "missing_key", "tiers.nvme.path"),
    ({"optimizer": {"lr": float("nan")}}, "out_of_range", "optimizer.lr"),
    ({"optimizer": {"lr": 10**400}}, "out_of_range", "optimizer.lr"),
    ({"prefetch": {"budget": 1.5}}, "bad_value", "prefetch.budget"),
    ({"profile": {"dir": "a\0b"}}, "bad_value", "profile.dir"),
])
def test_dict_input_errors(raw: dict[object, object], kind: str, yaml_path: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(raw)  # type: ignore[arg-type]
    assert (info.value.kind, info.value.yaml_path, info.value.line) == (kind, yaml_path, None)


def test_dict_input_equals_yaml_input(tmp_path: Path) -> None:
    raw = {"optimizer": {"lr": "1e-3", "betas": (0.8, 0.9)}, "tiers": {"nvme": {"path": "tmp"}},
           "placement": {"master": "nvme"}, "blocks": {"modules": ["model.layers.*"]}}
    before = repr(raw)
    from_dict = load_config(raw)
    assert repr(raw) == before  # the caller's dict is not modified
    from_yaml = _load_text(tmp_path, """\
        optimizer: {lr: 1e-3, betas: [0.8, 0.9]}
        tiers: {nvme: {path: tmp}}
        placement: {master: nvme}
        blocks: {modules: ["model.layers.*"]}
        """)
    assert from_dict == from_yaml
    assert from_dict.blocks.modules == ("model.layers.*",)


def test_source_types(tmp_path: Path) -> None:
    path = _write(tmp_path, "seed: 5\n")
    assert load_config(path).seed == 5
    assert load_config(str(path)).seed == 5
    with pytest.raises(TypeError):
        load_config(42)  # type: ignore[arg-type]
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "absent.yaml")
    assert info.value.kind == "environment" and "absent.yaml" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_config("seed: 5\ndtype: bf16\n")
    assert "not YAML text" in str(info.value)


def test_overrides(tmp_path: Path) -> None:
    path = _write(tmp_path, "train:\n  steps: 5\n  save_every: 2\n")
    with pytest.raises(ConfigError):
        load_config(path)  # save_every without a checkpoint directory
    cfg = load_config(path, overrides={"train.steps": 7,
                                       "train.checkpoint_dir": str(tmp_path / "ckpt")})
    assert cfg.train.steps == 7 and cfg.train.save_every == 2
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides={"train.steps": 0})
    # The bad value came from the override, not from line 2 of the file.
    assert (info.value.kind, info.value.yaml_path, info.value.line) == (
        "out_of_range", "train.steps", None)
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides={"train.stepz": 1})
    assert info.value.kind == "unknown_key"
    with pytest.raises(ConfigError) as info:
        load_config({"seed": 1}, overrides={"seed.x": 1})
    assert info.value.kind == "wrong_type"


# --- examples, round trips, docs

def test_examples_exist() -> None:
    names = {p.name for p in EXAMPLES}
    assert {"tiers.yaml", "tiers_nvme.yaml", "tiers_gpu_resident.yaml"} <= names


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_example_loads_and_round_trips(example: Path, tmp_path: Path) -> None:
    cfg = load_config(example)
    dumped = _write(tmp_path, dump_config(cfg), "dumped.yaml")
    assert load_config(dumped) == cfg
    assert dump_config(load_config(dumped)) == dump_config(cfg)


def test_example_placements() -> None:
    nvme = load_config(REPO / "examples" / "tiers_nvme.yaml")
    assert (nvme.placement.master, nvme.placement.moments) == ("nvme", "nvme")
    assert nvme.tiers.nvme.path == "tmp"
    resident = load_config(REPO / "examples" / "tiers_gpu_resident.yaml")
    assert resident.placement.weights == "gpu"
    assert (resident.placement.master, resident.placement.moments) == ("host", "host")


@pytest.mark.parametrize("raw", [
    {},
    {"seed": 2**64 - 1, "optimizer": {"lr": 1e-300, "eps": 5e-324, "betas": [0.0, 0.5]}},
    {"tiers": {"nvme": {"path": "1e8"}, "host": {"budget": 12345}}, "profile": {"dir": "null"}},
    {"tiers": {"nvme": {"path": "on", "direct_io": False}}, "train": {"checkpoint_dir": "true"}},
    {"blocks": {"modules": ["a.*", "b: c", "#x"]}, "profile": {"dir": "dir with ünicode"}},
])
def test_round_trip(raw: dict[str, object], tmp_path: Path,
                    monkeypatch: pytest.MonkeyPatch) -> None:
    # Relative odd directory names ("1e8", "on") must exist for the environment check.
    monkeypatch.chdir(tmp_path)
    for name in ("1e8", "on"):
        (tmp_path / name).mkdir()
    cfg = load_config(raw)
    dumped = _write(tmp_path, dump_config(cfg), "dumped.yaml")
    assert load_config(dumped) == cfg


def test_docs_match_schema() -> None:
    assert (REPO / "docs" / "config.md").read_text() == config_reference_markdown()


def test_reference_mentions_every_field() -> None:
    text = config_reference_markdown()
    for path in schema_paths():
        assert f"`{path.rsplit('.', 1)[-1]}`" in text, path


def test_every_field_is_documented_and_its_default_valid() -> None:
    def walk(cls: type) -> None:
        for f in dataclasses.fields(cls):
            assert f.metadata.get("doc"), f"{cls.__name__}.{f.name} has no doc"
            if "section" in f.metadata:
                walk(f.metadata["section"])
                continue
            spec = f.metadata["spec"]
            assert f.default is None or spec.check(spec.to_plain(f.default)) == f.default
    walk(TierstoreConfig)


# --- parse_size

@pytest.mark.parametrize(("value", "nbytes"), [
    (0, 0),
    (4096, 4096),
    ("512MiB", 512 * 2**20),
    ("20GiB", 20 * 2**30),
    ("1.5GB", 1_500_000_000),
    ("64 KiB", 64 * 1024),
    ("1e9", 10**9),
    ("1e9B", 10**9),
    ("2tib", 2 * 2**40),
    ("0.5KiB", 512),
    ("0.1GiB", 107374182),  # rounded to the nearest byte
    (".5MB", 500_000),
    (3.0, 3),
])
def test_parse_size(value: int | str, nbytes: int) -> None:
    assert parse_size(value) == nbytes


@pytest.mark.parametrize(("value", "needle"), [
    ("12 GiBs", "did you mean `GiB`"),
    ("2G", "ambiguous"),
    ("10k", "ambiguous"),
    ("-1GiB", "negative"),
    (-1, "negative"),
    ("1.5", "whole number of bytes"),
    ("GiB", "write a number and a unit"),
    ("", "write a number and a unit"),
    ("1e999999999", "larger than"),
    (2**63, "larger than"),
    (True, "expected a size"),
    ([1], "expected a size"),
    (float("inf"), "expected a size"),
    ("1,5GiB", "cannot read"),
])
def test_parse_size_refuses(value: object, needle: str) -> None:
    with pytest.raises(ValueError, match=None) as info:
        parse_size(value)  # type: ignore[arg-type]
    assert needle in str(info.value)


@pytest.mark.parametrize("nbytes", [0, 1, 4095, 4096, 3 * 2**20, 2**40, 10**12 + 1])
def test_format_size_round_trips(nbytes: int) -> None:
    assert parse_size(format_size(nbytes)) == nbytes


# --- environment checks

def _nvme_cfg(path: Path | str, checkpoint_dir: Path | str | None = None) -> dict[str, object]:
    raw: dict[str, object] = {"tiers": {"nvme": {"path": str(path)}}}
    if checkpoint_dir is not None:
        raw["train"] = {"checkpoint_dir": str(checkpoint_dir)}
    return raw


def test_environment_accepts_private_dirs(tmp_path: Path) -> None:
    swap = tmp_path / "swap"
    swap.mkdir(mode=0o700)
    assert load_config(_nvme_cfg(swap)).tiers.nvme.path == str(swap)
    swap.chmod(0o755)  # readable by others is fine: nobody else can create names in it
    load_config(_nvme_cfg(swap, tmp_path / "ckpt"))


@pytest.mark.parametrize("mode", [0o2775, 0o1777, 0o1770], ids=["group-setgid", "sticky-world", "sticky-group"])
def test_environment_refuses_dirs_others_can_write(tmp_path: Path, mode: int) -> None:
    """A group's shared 2775 scratch directory, or /tmp-like 1777: another user could plant links at the swap
    files' names (the sticky bit only stops them deleting ours)."""
    swap = tmp_path / "swap"
    swap.mkdir()
    swap.chmod(mode)
    with pytest.raises(ConfigError) as info:
        load_config(_nvme_cfg(swap))
    err = info.value
    assert (err.kind, err.yaml_path) == ("environment", "tiers.nvme.path")
    assert f"mode {mode:04o}" in err.message and "mkdir -m 700" in err.message and "path: tmp" in err.message
    # chmod is offered only for a directory that is not shared on purpose: on /tmp (sticky) it would break the system
    assert ("chmod go-w" in err.message) == (not mode & 0o1000)


def test_environment_refuses_missing_dir(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(_nvme_cfg(tmp_path / "absent"))
    assert info.value.kind == "environment" and "mkdir -p" in str(info.value)


def test_environment_refuses_file(tmp_path: Path) -> None:
    target = tmp_path / "file"
    target.write_text("x")
    with pytest.raises(ConfigError) as info:
        load_config(_nvme_cfg(target))
    assert info.value.kind == "environment" and "not a directory" in str(info.value)


def test_environment_refuses_world_writable(tmp_path: Path) -> None:
    swap = tmp_path / "swap"
    swap.mkdir()
    swap.chmod(0o777)
    assert not swap.stat().st_mode & stat.S_ISVTX
    path = _write(tmp_path, f"seed: 1\ntiers:\n  nvme:\n    path: {swap}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    err = info.value
    assert (err.kind, err.yaml_path, err.line) == ("environment", "tiers.nvme.path", 4)
    assert "writable by every user" in err.message and str(swap) in err.message


def test_environment_refuses_unwritable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    swap = tmp_path / "swap"
    swap.mkdir()
    # Faked: as root the kernel grants write access whatever the mode says.
    monkeypatch.setattr(config_module.os, "access", lambda *args, **kwargs: False)
    with pytest.raises(ConfigError) as info:
        load_config(_nvme_cfg(swap))
    assert info.value.kind == "environment" and "not writable" in str(info.value)


@pytest.mark.parametrize(("swap_rel", "ckpt_rel"), [
    ("run", "run"),
    ("run/swap", "run"),
    ("run", "run/ckpt"),
])
def test_environment_refuses_overlap_with_checkpoints(tmp_path: Path, swap_rel: str,
                                                      ckpt_rel: str) -> None:
    (tmp_path / swap_rel).mkdir(parents=True, exist_ok=True)
    with pytest.raises(ConfigError) as info:
        load_config(_nvme_cfg(tmp_path / swap_rel, tmp_path / ckpt_rel))
    assert info.value.kind == "environment" and "checkpoint_dir" in str(info.value)


def test_environment_separate_dirs_and_tmp_are_fine(tmp_path: Path) -> None:
    (tmp_path / "swap").mkdir()
    load_config(_nvme_cfg(tmp_path / "swap", tmp_path / "swapped-ckpt"))  # prefix is no parent
    load_config(_nvme_cfg("tmp", tmp_path))


def test_check_environment_directly(tmp_path: Path) -> None:
    cfg = load_config()
    check_environment(cfg)  # NVMe tier off: nothing to check
    bad = dataclasses.replace(cfg, tiers=dataclasses.replace(
        cfg.tiers, nvme=dataclasses.replace(cfg.tiers.nvme, path=str(tmp_path / "absent"))))
    with pytest.raises(ConfigError) as info:
        check_environment(bad)
    assert (info.value.kind, info.value.yaml_path, info.value.line) == (
        "environment", "tiers.nvme.path", None)


# --- the error type itself

def test_config_error_pickles_and_is_value_error() -> None:
    err = ConfigError("bad", "a.b", 3, "out_of_range", "x.yaml")
    again = pickle.loads(pickle.dumps(err))
    assert isinstance(again, ConfigError) and isinstance(again, ValueError)
    assert (again.message, again.yaml_path, again.line, again.kind, again.source) == (
        "bad", "a.b", 3, "out_of_range", "x.yaml")
    assert str(again) == "x.yaml:3: a.b: bad"
    with pytest.raises(RuntimeError):
        ConfigError("bad", kind="no_such_kind")


def test_compute_dtype_host_gradients_under_fp16_are_refused_saying_what_to_set() -> None:
    with pytest.raises(ConfigError, match="host_grad_dtype: compute is for bf16.*`auto` or `fp32`"):
        load_config({"dtype": "fp16", "optimizer": {"host_grad_dtype": "compute"}})
    assert load_config({"dtype": "fp16", "optimizer": {"host_grad_dtype": "auto"}}).optimizer.host_grad_dtype == "auto"
