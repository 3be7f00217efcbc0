"""``tierstore train --model DIR --data FILE`` end to end on the CPU: a tiny Llama directory made by the test (config,
``save_pretrained``, a tokenizer trained offline), a text file and a JSONL file. Loss falls, a stopped run resumed
from its checkpoint equals the run never stopped bit for bit (fp32), ``--output`` loads with ``from_pretrained``
and holds the session's weights, and each wrong input ends with one message naming what to change."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.cli import train as cli_train
from runtime.cli.main import main as cli_main
from tests.unit.runtime.cli.hf_model_dir import TEXT, make_model_dir, write_jsonl

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")  # the saved shards, read as they are

FLAGS = ["--seq", "32", "--micro-batch", "4", "--lr", "1e-2"]


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return make_model_dir(tmp_path / "model")


@pytest.fixture
def fp32(tmp_path: Path) -> Path:
    """A three-line config: the CPU in fp32 (bit-for-bit comparisons, on a GPU machine too), every step logged."""
    path = tmp_path / "fp32.yaml"
    path.write_text("device: cpu\ndtype: fp32\ntrain: {log_every: 1}\n")
    return path


class Recorder:
    """The losses each step shows and the model the run offloaded (it holds the trained weights after close)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.losses: list[float] = []
        self.models: list[torch.nn.Module] = []
        update, offload = cli_train.Progress.update, cli_train.offload

        def record_update(progress: Any, step: int, loss: float, tokens_per_s: float) -> None:
            self.losses.append(loss)
            update(progress, step, loss, tokens_per_s)

        def record_offload(model: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            self.models.append(model)
            return offload(model, *args, **kwargs)

        monkeypatch.setattr(cli_train.Progress, "update", record_update)
        monkeypatch.setattr(cli_train, "offload", record_offload)


def test_a_text_file_trains_the_model_and_the_output_loads_with_from_pretrained(tmp_path, model_dir, fp32, monkeypatch,
                                                                                capsys):
    """Loss falls; the output directory loads with AutoModelForCausalLM / AutoTokenizer.from_pretrained, and its
    weights are the trained ones, exactly (fp32)."""
    data = tmp_path / "data.txt"
    data.write_text(TEXT)
    out = tmp_path / "out"
    recorder = Recorder(monkeypatch)
    assert cli_main(["train", "--model", str(model_dir), "--data", str(data), "--config", str(fp32), "--steps", "8",
                     "--output", str(out), *FLAGS]) == 0
    err = capsys.readouterr().err
    assert "gradient checkpointing on" in err and f"written to {out}" in err
    assert len(recorder.losses) == 8 and recorder.losses[-1] < recorder.losses[0] - 0.5
    trained = dict(recorder.models[0].named_parameters())
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert loaded.config.use_cache is True  # as the model's own config had it, not the training run's False
    for name, param in loaded.named_parameters():
        assert torch.equal(param, trained[name]), name
    original = transformers.AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    assert not torch.equal(original.lm_head.weight, loaded.lm_head.weight)  # it did train
    tokenizer = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    source = transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    assert tokenizer("the lazy dog")["input_ids"] == source("the lazy dog")["input_ids"]


def test_a_jsonl_file_trains_a_tied_model(tmp_path, fp32, monkeypatch):
    """JSON Lines with a `text` or `content` field, one document a line; a model with tied embeddings."""
    model_dir = make_model_dir(tmp_path / "tied", tied=True)
    lines = TEXT.splitlines()
    data = write_jsonl(tmp_path / "data.jsonl", lines[:60])
    with open(data, "a") as file:
        file.write('\n{"content": "' + " ".join(lines[60:]) + '"}\n')  # a blank line, then a `content` record
    recorder = Recorder(monkeypatch)
    assert cli_main(["train", "--model", str(model_dir), "--data", str(data), "--config", str(fp32), "--steps", "8",
                     *FLAGS]) == 0
    assert recorder.losses[-1] < recorder.losses[0] - 0.5


def test_a_stopped_run_resumed_from_its_checkpoint_equals_the_run_never_stopped(tmp_path, model_dir, fp32,
                                                                                 monkeypatch):
    """Four steps in one run; two, then --resume to four: the same losses and output weights, bit for bit. The data
    holds 20 sequences and a step takes 8, so the resumed run crosses an epoch (a new shuffled order)."""
    data = tmp_path / "data.txt"
    data.write_text(TEXT[: len(TEXT) // 5])
    base = ["train", "--model", str(model_dir), "--data", str(data), "--config", str(fp32), "--accumulation", "2",
            *FLAGS]
    whole = Recorder(monkeypatch)
    assert cli_main([*base, "--steps", "4", "--output", str(tmp_path / "whole")]) == 0
    expected = list(whole.losses)  # the recorders chain: the first one sees the later runs too
    ckpt = tmp_path / "ckpt"
    parts = Recorder(monkeypatch)
    assert cli_main([*base, "--steps", "2", "--checkpoint-dir", str(ckpt)]) == 0
    assert cli_main([*base, "--steps", "4", "--checkpoint-dir", str(ckpt), "--resume",
                     "--output", str(tmp_path / "resumed")]) == 0
    assert len(expected) == 4 and parts.losses == expected  # floats compared exactly
    # A requeued job of the finished run trains nothing and still writes --output, from the checkpoint.
    assert cli_main([*base, "--steps", "4", "--checkpoint-dir", str(ckpt), "--resume",
                     "--output", str(tmp_path / "again")]) == 0
    reference = dict(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "whole").named_parameters())
    for output in ("resumed", "again"):
        resumed = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / output, local_files_only=True)
        for name, param in resumed.named_parameters():
            assert torch.equal(param, reference[name]), (output, name)


def test_an_output_directory_holding_a_model_is_refused_without_overwrite(tmp_path, model_dir, fp32, capsys):
    data = tmp_path / "data.txt"
    data.write_text(TEXT)
    out = make_model_dir(tmp_path / "other")
    args = ["train", "--model", str(model_dir), "--data", str(data), "--config", str(fp32), "--steps", "1",
            "--output", str(out), *FLAGS]
    assert cli_main(args) == 2
    err = capsys.readouterr().err
    assert f"--output {out} already holds a model" in err and "add --overwrite to replace it" in err
    assert cli_main([*args, "--overwrite"]) == 0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert loaded.config.hidden_size == 32


def _refusal(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("damage, expected", [
    ("config", "no config.json there"),
    ("tokenizer", "no tokenizer there"),
    ("weights", "no safetensors weights there"),
])
def test_a_model_directory_missing_a_part_is_refused_naming_it(tmp_path, model_dir, capsys, damage, expected):
    data = tmp_path / "data.txt"
    data.write_text(TEXT)
    gone = {"config": ["config.json"], "tokenizer": ["tokenizer.json", "tokenizer_config.json"],
            "weights": ["model.safetensors"]}[damage]
    for name in gone:
        (model_dir / name).unlink()
    err = _refusal(["train", "--model", str(model_dir), "--data", str(data), "--steps", "1"], capsys)
    assert expected in err and "save_pretrained" in err


def test_empty_and_short_data_files_are_refused_naming_what_to_change(tmp_path, model_dir, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    err = _refusal(["train", "--model", str(model_dir), "--data", str(empty), "--steps", "1"], capsys)
    assert "no text in it" in err
    short = tmp_path / "short.txt"
    short.write_text("the lazy dog")
    err = _refusal(["train", "--model", str(model_dir), "--data", str(short), "--steps", "1", "--seq", "64"], capsys)
    assert "fewer than one sequence of --seq 64" in err and "smaller --seq" in err
    err = _refusal(["train", "--model", str(model_dir), "--data", str(tmp_path / "absent.txt")], capsys)
    assert "no such file" in err
    err = _refusal(["train", "--model", str(model_dir)], capsys)
    assert "needs --data FILE" in err


def test_a_jsonl_line_without_text_is_refused_with_its_line(tmp_path, model_dir, capsys):
    data = write_jsonl(tmp_path / "data.jsonl", ["a document"])
    with open(data, "a") as file:
        file.write('{"body": "no text field"}\n')
    err = _refusal(["train", "--model", str(model_dir), "--data", str(data)], capsys)
    assert f"{data}:2: no text field" in err and "'text' or 'content'" in err and "'body'" in err


def test_without_transformers_the_error_names_the_install_command(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers raises ImportError
    err = _refusal(["train", "--model", str(tmp_path), "--data", str(tmp_path / "x.txt")], capsys)
    assert "pip install -e '.[hf]'" in err


def test_data_and_output_without_model_are_refused(tmp_path, capsys):
    err = _refusal(["train", "--data", str(tmp_path / "x.txt")], capsys)
    assert "--data goes with --model DIR" in err


@pytest.mark.gpu
def test_on_the_gpu_with_the_documented_defaults_the_model_trains_resumes_and_saves(tmp_path, model_dir, monkeypatch):
    """The same on CUDA with no --config (bf16, auto placement): loss falls; two steps then --resume to six give the
    losses of the run never stopped (within bf16 rounding: GPU kernels need not repeat bit for bit); the output
    holds the session's weights in the compute dtype."""
    data = tmp_path / "data.txt"
    data.write_text(TEXT)
    base = ["train", "--model", str(model_dir), "--data", str(data), *FLAGS]
    whole = Recorder(monkeypatch)
    assert cli_main([*base, "--steps", "6", "--output", str(tmp_path / "whole")]) == 0
    expected, trained = list(whole.losses), dict(whole.models[0].named_parameters())
    assert expected[-1] < expected[0] - 0.5
    saved: dict[str, torch.Tensor] = {}
    for shard in (tmp_path / "whole").glob("*.safetensors"):
        saved.update(safetensors_torch.load_file(shard))
    assert saved
    for name, tensor in saved.items():  # the files hold the compute dtype
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, trained[name].to(torch.bfloat16)), name
    # from_pretrained may widen them to the dtype config.json names (the model directory's, fp32): the values stay.
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "whole", local_files_only=True)
    for name, param in loaded.named_parameters():
        assert torch.equal(param.to(torch.bfloat16), trained[name].to(torch.bfloat16)), name
    ckpt = tmp_path / "ckpt"
    parts = Recorder(monkeypatch)
    assert cli_main([*base, "--steps", "2", "--checkpoint-dir", str(ckpt)]) == 0
    assert cli_main([*base, "--steps", "6", "--checkpoint-dir", str(ckpt), "--resume"]) == 0
    assert parts.losses == pytest.approx(expected, rel=2e-2)
