"""TrainingArguments(use_liger_kernel=True) on an offloaded model: Liger's fused linear cross-entropy reads
``lm_head.weight`` outside the head's forward; the parameter guard's read path fetches the block and its gradient
reaches tierstore (the mechanism's CPU tests: tests/unit/runtime/integrations/test_direct_weight_read.py). Liger
needs triton and CUDA: this runs on the GPU machine only.

    python3 -m pytest -q -p no:cacheprovider tests/integration/test_hf_trainer_liger.py
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the HF integration is an optional extra: pip install -e '.[hf]'")

from runtime import offload  # noqa: E402

STEPS = 4


def llama_config() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                    initializer_range=0.2)


def dataset() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    rows = torch.randint(0, 1024, (32, 96), generator=generator)
    return [{"input_ids": row, "labels": row.clone()} for row in rows]


def run(tmp_path, offloaded: bool) -> list[tuple[float, float]]:
    """STEPS steps of the stock Trainer with Liger (bf16, accumulation 2, clip 1.0): plain, or offloaded with the
    head a block of its own (fetched only by the read path) and its gradients summed on the host."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(llama_config())
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / f"liger-{offloaded}"), per_device_train_batch_size=4, gradient_accumulation_steps=2,
        max_steps=STEPS, learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[], seed=0, bf16=True,
        optim="adamw_torch_fused", lr_scheduler_type="constant", weight_decay=0.0, use_liger_kernel=True)
    optimizers = (None, None)
    if offloaded:
        model, optimizer = offload(model, {
            "dtype": "bf16", "blocks": {"min_block_size": 1}, "placement": {"weights": "host"},
            "optimizer": {"lr": args.learning_rate, "weight_decay": 0.0, "grad_clip": None, "user_grad_clip": True,
                          "accumulation_steps": 2, "accumulate_on": "host"}})
        optimizers = (optimizer, None)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset(), optimizers=optimizers)
    trainer.train()
    # The Trainer gave the model Liger's forward; under bf16 accelerate wraps it to return fp32 outputs, keeping the
    # forward it wrapped as _original_forward.
    forward = getattr(model, "_original_forward", model.forward)
    assert "lce" in getattr(forward, "__func__", forward).__name__
    if offloaded:
        optimizers[0].session.close()
    return [(entry["loss"], entry["grad_norm"]) for entry in trainer.state.log_history if "loss" in entry]


@pytest.mark.gpu
def test_the_trainer_with_liger_on_an_offloaded_model_trains_like_the_plain_one(tmp_path):
    pytest.importorskip("liger_kernel", reason="Liger is not installed: pip install liger-kernel")
    plain, ours = run(tmp_path, False), run(tmp_path, True)
    assert len(ours) == len(plain) == STEPS
    for (loss, norm), (ref_loss, ref_norm) in zip(ours, plain, strict=True):  # bf16 weights against bf16 autocast
        assert loss == pytest.approx(ref_loss, rel=2e-2)
        assert norm == pytest.approx(ref_norm, rel=5e-2)
    assert ours[-1][0] < ours[0][0]
