"""`tierstore train`'s settings (issue 41, item 4): a --config file is laid over the documented defaults
(docs/config.md, the schema's), so a two-line file changes two settings and keeps the rest, dtype and sequence length
included; without --config the embedded demonstration differs from those defaults only in the keys it shows."""

from __future__ import annotations

import dataclasses

from runtime.cli.main import build_parser
from runtime.cli.train import DEMONSTRATION, config_source, settings
from runtime.config.loader import load_config


def _args(*argv: str):
    return build_parser().parse_args(["train", *argv])


def test_a_two_line_config_keeps_the_documented_defaults(tmp_path):
    path = tmp_path / "two_line.yaml"
    path.write_text("optimizer: {lr: 0.0003}\ntrain: {steps: 5}\n")
    cfg = settings(_args("--config", str(path)))
    documented = load_config(None)
    assert cfg.dtype == documented.dtype == "bf16" and cfg.train.seq_len == documented.train.seq_len == 256
    assert cfg == dataclasses.replace(documented, optimizer=dataclasses.replace(documented.optimizer, lr=3e-4),
                                      train=dataclasses.replace(documented.train, steps=5))


def test_the_embedded_config_is_the_documented_defaults_with_the_demonstration_shown():
    cfg = settings(_args())
    documented = load_config(None)
    assert cfg.dtype == documented.dtype and cfg.train == documented.train
    assert cfg == load_config(DEMONSTRATION)
    shown = config_source(_args())
    for line in ("tiers.nvme.path: tmp", "placement.moments: nvme", "optimizer.gpu_update_fraction: 0.0"):
        assert line in shown


def test_flags_override_the_config(tmp_path):
    cfg = settings(_args("--seq", "64", "--micro-batch", "2", "--accumulation", "3", "--lr", "0.01", "--steps", "7"))
    assert (cfg.train.seq_len, cfg.train.batch_size, cfg.optimizer.accumulation_steps, cfg.optimizer.lr,
            cfg.train.steps) == (64, 2, 3, 0.01, 7)


def test_model_without_config_trains_on_the_documented_defaults(tmp_path):
    args = _args("--model", str(tmp_path), "--data", str(tmp_path / "x.txt"))
    assert settings(args) == load_config(None)
    assert config_source(args).startswith("the documented defaults")
