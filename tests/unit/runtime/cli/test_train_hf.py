"""runtime.cli.train_hf.load_model: a local HF directory's model is built on the meta device and its parameters are
filled from the safetensors files one at a time (offload's ``init``), under their own names or those of a checkpoint
of the bare model; a checkpoint whose names only HF's loader converts is loaded whole by from_pretrained instead."""

from __future__ import annotations

import pytest
import torch

from tests.unit.runtime.cli.hf_model_dir import make_model_dir

transformers = pytest.importorskip("transformers")
from runtime.cli import train_hf  # noqa: E402  (needs transformers, skipped above without it)


def _filled(model: torch.nn.Module, init: train_hf.SafetensorsInit) -> dict[str, torch.Tensor]:
    out = {}
    for name, param in model.named_parameters():
        value = torch.empty(param.shape, dtype=param.dtype)
        init(name, value)
        out[name] = value
    return out


@pytest.mark.parametrize("tied", [False, True])
def test_the_model_is_built_on_meta_and_filled_from_the_files_with_the_saved_values(tmp_path, tied):
    directory = make_model_dir(tmp_path / "m", tied=tied)
    saved = transformers.AutoModelForCausalLM.from_pretrained(directory, local_files_only=True)
    model, init = train_hf.load_model(directory)
    assert init is not None and all(p.is_meta for p in model.parameters())
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert any(getattr(module, "gradient_checkpointing", False) is True for module in model.modules())
    assert (model.lm_head.weight is model.model.embed_tokens.weight) is tied  # one parameter, as in the file
    values = _filled(model, init)
    for name, param in saved.named_parameters():
        assert torch.equal(values[name], param), name


def test_a_checkpoint_of_the_bare_model_is_read_under_the_prefixed_names(tmp_path):
    from safetensors.torch import load_file, save_file

    directory = make_model_dir(tmp_path / "m")
    file = directory / "model.safetensors"
    tensors = load_file(file)
    save_file({name.removeprefix("model."): value for name, value in tensors.items()}, file, metadata={"format": "pt"})
    model, init = train_hf.load_model(directory)
    assert init is not None
    assert torch.equal(_filled(model, init)["model.norm.weight"], tensors["model.norm.weight"])


def test_names_the_files_do_not_hold_load_the_model_whole_with_from_pretrained(tmp_path, monkeypatch):
    directory = make_model_dir(tmp_path / "m")
    monkeypatch.setattr(train_hf, "match_names", lambda model, keys: None)
    model, init = train_hf.load_model(directory)
    saved = transformers.AutoModelForCausalLM.from_pretrained(directory, local_files_only=True)
    assert init is None and not any(p.is_meta for p in model.parameters())
    assert torch.equal(model.lm_head.weight, saved.lm_head.weight)


def test_weights_that_disagree_with_config_json_are_refused_naming_both(tmp_path):
    directory = make_model_dir(tmp_path / "m")
    model, init = train_hf.load_model(directory)
    assert init is not None
    with pytest.raises(ValueError, match=r"model.norm.weight has shape \(32,\), the model built from config.json "
                                         r"wants \(16,\)"):
        init("model.norm.weight", torch.empty(16))


def test_sharded_weights_are_read_through_their_index(tmp_path):
    directory = make_model_dir(tmp_path / "m")
    saved = transformers.AutoModelForCausalLM.from_pretrained(directory, local_files_only=True)
    (directory / "model.safetensors").unlink()
    saved.save_pretrained(directory, max_shard_size="20KB")
    assert (directory / train_hf.WEIGHTS_INDEX).is_file() and len(list(directory.glob("*.safetensors"))) > 1
    model, init = train_hf.load_model(directory)
    assert init is not None
    values = _filled(model, init)
    for name, param in saved.named_parameters():
        assert torch.equal(values[name], param), name
    (directory / train_hf.WEIGHTS_INDEX).write_text("{not json")
    with pytest.raises(ValueError, match=r"not a safetensors index .* save the model again with save_pretrained"):
        train_hf.weight_files(directory)
