"""An unchanged HF Trainer given tierstore's optimizer trains exactly like the plain one, and saves.

Tiny LlamaForCausalLM built from a config (nothing downloaded), fp32 on the CPU: equal means bit for bit.
The plain side is the stock Trainer with ``optim="adamw_torch_fused"`` and the default ``max_grad_norm=1.0``;
ours is the same Trainer given ``optimizers=(optimizer, None)`` after ``offload``.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the HF integration is an optional extra: pip install -e '.[hf]'")

from runtime import offload  # noqa: E402

STEPS = 4


def llama_config() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                    initializer_range=0.2)  # large enough that the default clip at 1.0 acts


def dataset() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    rows = torch.randint(0, 128, (16, 24), generator=generator)
    return [{"input_ids": row, "labels": row.clone()} for row in rows]


def train(tmp_path, offloaded: bool, accumulation: int = 1, activations: str = "keep", weight_decay: float = 0.0,
          epochs: int | None = None):
    """STEPS optimizer steps (or ``epochs`` epochs of the 16 rows) of the stock Trainer, plain or offloaded."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(llama_config())
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / ("ours" if offloaded else "plain")), per_device_train_batch_size=4 // accumulation,
        gradient_accumulation_steps=accumulation, max_steps=STEPS if epochs is None else -1,
        num_train_epochs=epochs or 1, weight_decay=weight_decay,
        learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0,
        optim="adamw_torch_fused", lr_scheduler_type="linear", warmup_steps=1)
    optimizers = (None, None)
    session = None
    if offloaded:
        (tmp_path / "swap").mkdir(exist_ok=True)
        # The user guide's recipe (docs/user-guide.md): the Trainer's weight-decay split as parameter groups.
        decay = set(transformers.Trainer.get_decay_parameter_names(None, model))
        names = [name for name, _ in model.named_parameters()]
        groups = [{"params": [n for n in names if n in decay], "weight_decay": args.weight_decay},
                  {"params": [n for n in names if n not in decay], "weight_decay": 0.0}]
        model, optimizer = offload(model, {
            "device": "cpu", "dtype": "fp32", "tiers": {"nvme": {"path": str(tmp_path / "swap")}},
            "placement": {"moments": "nvme", "activations": activations},
            "optimizer": {"lr": args.learning_rate, "grad_clip": None,
                          "user_grad_clip": True, "betas": [args.adam_beta1, args.adam_beta2], "eps": args.adam_epsilon,
                          "accumulation_steps": accumulation, "accumulate_on": "host" if accumulation > 1 else "gpu"}},
            param_groups=groups)
        optimizers = (optimizer, None)
        session = optimizer.session
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset(), optimizers=optimizers)
    trainer.train()
    logs = [(entry["loss"], entry["grad_norm"]) for entry in trainer.state.log_history if "loss" in entry]
    trainer.save_model(str(tmp_path / ("saved-ours" if offloaded else "saved-plain")))
    weights = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    return logs, weights, session


# accumulation 2: the micro-batches' gradients summed in host memory; recompute: the decoder layers' forwards run
# again in the backward (placement.activations)
# weight decay 0.1: the Trainer's split (no decay on norm weights) as param_groups, the user guide's recipe
@pytest.mark.parametrize("accumulation, activations, weight_decay",
                         [(1, "keep", 0.0), (2, "keep", 0.0), (1, "recompute", 0.0), (1, "keep", 0.1)])
@pytest.mark.quick_cases({"accumulation": 2}, {"weight_decay": 0.1})
def test_unchanged_trainer_matches_the_plain_trainer_and_saves(tmp_path, accumulation, activations, weight_decay):
    plain_logs, plain_weights, _ = train(tmp_path, offloaded=False, accumulation=accumulation, weight_decay=weight_decay)
    ours_logs, ours_weights, session = train(tmp_path, offloaded=True, accumulation=accumulation,
                                             activations=activations, weight_decay=weight_decay)
    assert (session.controller.sums is not None) == (accumulation > 1)
    assert (session.controller.recomputed_acquires > 0) == (activations == "recompute")
    # The Trainer's clip acted, so gradients waited on the device for the commit and were scaled there
    # ([Note: held gradients]): that path is what matched the plain Trainer below.
    assert session.controller.stats.held_grads > 0
    session.close()
    assert len(ours_logs) == STEPS
    assert ours_logs == plain_logs  # the same losses and the same logged grad_norm (the Trainer clips at 1.0)
    assert any(norm > 1.0 for _, norm in plain_logs)  # the default clip did act
    assert ours_weights.keys() == plain_weights.keys()
    for name in plain_weights:
        assert torch.equal(ours_weights[name], plain_weights[name]), name
    loaded = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "saved-ours"))
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, plain_weights[name]), name


def test_an_epoch_the_accumulation_does_not_divide_ends_with_a_short_step_like_the_plain_trainer(tmp_path):
    """16 micro-batches an epoch, gradient_accumulation_steps 3: the Trainer steps after the epoch's last micro-batch,
    the sixth step holding one micro-batch instead of three. Same losses, logged grad norms and weights as the plain
    Trainer (it had raised 'optimizer.step() called after 1 backward pass(es)' at the first epoch's end)."""
    plain_logs, plain_weights, _ = train(tmp_path, offloaded=False, accumulation=3, epochs=2)
    ours_logs, ours_weights, session = train(tmp_path, offloaded=True, accumulation=3, epochs=2)
    session.close()
    assert len(ours_logs) == 12 and ours_logs == plain_logs
    for name in plain_weights:
        assert torch.equal(ours_weights[name], plain_weights[name]), name


def test_sharded_save_a_few_blocks_at_a_time_loads_with_from_pretrained(tmp_path):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(llama_config())
    (tmp_path / "swap").mkdir()
    model, optimizer = offload(model, {"device": "cpu", "dtype": "fp32", "tiers": {"nvme": {"path": str(tmp_path / "swap")}},
                                       "placement": {"master": "nvme", "moments": "nvme"}, "optimizer": {"grad_clip": None}})
    with optimizer.session as session:
        for row in dataset()[:2]:
            model(input_ids=row["input_ids"][None], labels=row["labels"][None]).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        expected = session.master_state_dict()
        session.save_pretrained(tmp_path / "sharded", max_shard_nbytes=40_000)  # several shards
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    loaded = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "sharded"))
    for name, tensor in expected.items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


@pytest.mark.gpu
def test_unchanged_trainer_on_the_gpu_trains_like_the_plain_bf16_trainer_and_saves(tmp_path):
    """On CUDA, bf16: the plain Trainer (bf16 autocast over fp32 weights) and ours (bf16 weights, fp32 masters)
    differ by bf16 rounding only: losses and logged grad norms agree within 2%, the saved model loads."""
    def run(offloaded: bool):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(llama_config())
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / f"gpu-{offloaded}"), per_device_train_batch_size=4, max_steps=STEPS,
            learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[], seed=0, bf16=True,
            optim="adamw_torch_fused")
        optimizers = (None, None)
        if offloaded:
            model, optimizer = offload(model, {
                "dtype": "bf16", "tiers": {"nvme": {"path": "tmp"}}, "placement": {"moments": "nvme"},
                "optimizer": {"lr": args.learning_rate, "weight_decay": args.weight_decay, "grad_clip": None,
                              "user_grad_clip": True}})
            optimizers = (optimizer, None)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset(), optimizers=optimizers)
        trainer.train()
        trainer.save_model(str(tmp_path / f"saved-gpu-{offloaded}"))
        if offloaded:
            optimizers[0].session.close()
        return [(e["loss"], e["grad_norm"]) for e in trainer.state.log_history if "loss" in e]

    plain, ours = run(False), run(True)
    assert len(ours) == len(plain) == STEPS
    for (loss, norm), (ref_loss, ref_norm) in zip(ours, plain, strict=True):
        assert loss == pytest.approx(ref_loss, rel=2e-2)
        assert norm == pytest.approx(ref_norm, rel=2e-2)
    loaded = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "saved-gpu-True"))
    assert all(torch.isfinite(p).all() for p in loaded.parameters())


def test_sharded_save_never_writes_through_a_link_planted_at_its_temporary_names(tmp_path):
    """save_pretrained wrote ``model.safetensors.index.json.tmp`` (and each shard's ``.tmp``) by path: a link planted
    at that name had its target overwritten, and the index then was a link to the victim."""
    model = transformers.LlamaForCausalLM(llama_config())
    model, optimizer = offload(model, {"device": "cpu", "dtype": "fp32", "optimizer": {"grad_clip": None}})
    out = tmp_path / "out"
    out.mkdir()
    victims = {name: tmp_path / f"victim-{i}" for i, name in
               enumerate(["model.safetensors.index.json.tmp", "model-00001-of-00001.safetensors.tmp"])}
    for name, victim in victims.items():
        victim.write_text("precious")
        (out / name).symlink_to(victim)
    with optimizer.session as session:
        session.save_pretrained(out)
    index = out / "model.safetensors.index.json"
    assert all(victim.read_text() == "precious" for victim in victims.values())
    files = list(out.iterdir())
    assert not any(path.is_symlink() for path in files), files
    assert not any(path.name.endswith(".tmp") for path in files), files
    assert json.loads(index.read_text())["weight_map"]
    assert oct(index.stat().st_mode & 0o777) == oct(0o644)
    loaded = transformers.LlamaForCausalLM.from_pretrained(str(out))
    assert torch.equal(loaded.model.embed_tokens.weight, model.model.embed_tokens.weight.detach())
