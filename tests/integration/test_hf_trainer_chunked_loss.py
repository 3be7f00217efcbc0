"""An unchanged HF Trainer on an offloaded model with tierstore's chunked loss (use_chunked_loss) trains like the
plain Trainer with HF's own loss; examples/hf_trainer_8b.py runs the 8B scenario's Trainer at a tiny shape.

Tiny LlamaForCausalLM built from a config (nothing downloaded), fp32 on the CPU. The chunked loss adds the
cross-entropy piece by piece where HF takes one mean, so the two agree to fp32 rounding, not bit for bit.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the HF integration is an optional extra: pip install -e '.[hf]'")

from runtime import offload  # noqa: E402
from runtime.integrations.hf_loss import use_chunked_loss  # noqa: E402

STEPS = 2


def llama_config() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                    initializer_range=0.2)  # large enough that the clip at 1.0 acts


def dataset() -> list[dict[str, torch.Tensor]]:
    """Rows with a prompt left out of the loss (-100) of different lengths, so the Trainer's num_items_in_batch
    differs from micro-batch to micro-batch."""
    generator = torch.Generator().manual_seed(0)
    rows = torch.randint(0, 128, (8, 24), generator=generator)
    out = []
    for i, row in enumerate(rows):
        labels = row.clone()
        labels[: 2 + 3 * (i % 3)] = -100
        out.append({"input_ids": row, "labels": labels})
    return out


def train(tmp_path: Path, chunked: bool):
    """STEPS steps of the stock Trainer (accumulation 2, clip at 1.0): the plain model with HF's loss, or the
    offloaded one with the chunked loss."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(llama_config())
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / ("chunked" if chunked else "plain")), per_device_train_batch_size=2,
        gradient_accumulation_steps=2, max_steps=STEPS, learning_rate=1e-3, logging_steps=1, save_strategy="no",
        report_to=[], use_cpu=True, seed=0, optim="adamw_torch_fused", lr_scheduler_type="constant", weight_decay=0.0)
    optimizers = (None, None)
    session = None
    pieces: list[int] = []  # the tokens of each call of the head
    if chunked:
        model, optimizer = offload(model, {
            "device": "cpu", "dtype": "fp32", "blocks": {"min_block_size": 1},  # the head a block of its own
            "optimizer": {"lr": args.learning_rate, "grad_clip": None, "user_grad_clip": True, "weight_decay": 0.0,
                          "betas": [args.adam_beta1, args.adam_beta2], "eps": args.adam_epsilon,
                          "accumulation_steps": 2}})
        use_chunked_loss(model, piece_tokens=16)  # 2 x 24 tokens a micro-batch: 3 pieces
        model.lm_head.register_forward_hook(lambda module, inputs, output: pieces.append(inputs[0].shape[0]))
        optimizers = (optimizer, None)
        session = optimizer.session
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset(), optimizers=optimizers)
    assert trainer.model_accepts_loss_kwargs  # so it passes num_items_in_batch to the forward, chunked or not
    trainer.train()
    logs = [(entry["loss"], entry["grad_norm"]) for entry in trainer.state.log_history if "loss" in entry]
    weights = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    if session is not None:
        session.close()
        assert pieces and max(pieces) == 16  # the head never saw a micro-batch's 48 tokens at once
    return logs, weights


def test_the_trainer_with_the_chunked_loss_on_an_offloaded_model_trains_like_the_plain_trainer(tmp_path):
    plain_logs, plain_weights = train(tmp_path, chunked=False)
    ours_logs, ours_weights = train(tmp_path, chunked=True)
    assert len(ours_logs) == len(plain_logs) == STEPS
    assert any(norm > 1.0 for _, norm in plain_logs)  # the clip acted
    for (loss, norm), (ref_loss, ref_norm) in zip(ours_logs, plain_logs, strict=True):
        assert loss == pytest.approx(ref_loss, rel=1e-5) and norm == pytest.approx(ref_norm, rel=1e-5)
    assert ours_weights.keys() == plain_weights.keys()
    for name, tensor in plain_weights.items():
        torch.testing.assert_close(ours_weights[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


@pytest.fixture
def example(monkeypatch):
    """examples/hf_trainer_8b.py as a module (it imports finetune_8b.py from beside it)."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "examples"))
    return importlib.import_module("hf_trainer_8b")


SMALL = ["--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--ffn", "128", "--vocab", "512",
         "--seq", "64", "--global-batch", "4", "--micro-batch", "2", "--lr", "3e-3", "--host-budget", "1GiB"]


@pytest.mark.slow
def test_the_trainer_8b_example_trains_at_a_tiny_shape_and_prints_finetune_8b_s_step_line(tmp_path, capsys, example):
    """On the CPU --loss auto is the chunked loss; each step prints finetune_8b.py's line (tokens/s, model
    TFLOP/s, peak GPU)."""
    pytest.importorskip("accelerate")
    code = example.main(SMALL + ["--steps", "3", "--nvme-dir", str(tmp_path), "--loss-piece", "40"])
    err = capsys.readouterr().err
    assert code == 0, err[-2000:]
    assert "loss: chunked" in err and "finite and falling" in err
    assert err.count("model TFLOP/s, peak GPU") == 3 and "step 3/3: loss" in err


def test_the_trainer_8b_example_asks_the_trainer_for_the_scenario_s_work(example):
    """The scenario's batch, accumulation and clipping reach the Trainer; the clip is the Trainer's (user_grad_clip);
    checkpointing on, non-reentrant."""
    from runtime.config.loader import load_config

    args = example.parse_args(["--loss", "chunked"])
    config = load_config(example.trainer_config(args, cuda=True))
    assert config.optimizer.user_grad_clip and config.optimizer.grad_clip is None
    assert config.optimizer.accumulation_steps == 16 and (args.micro_batch, args.seq) == (4, 4096)
    checkpointing = example.checkpointing_args(transformers.TrainingArguments)
    assert True in checkpointing.values() and {"use_reentrant": False} in checkpointing.values()
    assert example.parse_args([]).loss in ("liger", "chunked")
