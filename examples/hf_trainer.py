"""Fine-tune with an unchanged HF Trainer, its optimizer state offloaded by tierstore.

    pip install -e '.[hf]' && python examples/hf_trainer.py [--steps N] [--out DIR]
    torchrun --nproc-per-node 2 examples/hf_trainer.py     # the same, unchanged, on two GPUs (or two CPU processes)

Builds a small LlamaForCausalLM from a config (nothing downloaded), its loss tierstore's chunked one
(``use_chunked_loss``), trains it on the Python standard library's source with the stock ``Trainer`` (default
``max_grad_norm=1.0``: the Trainer clips in its own loop, so the config sets ``optimizer.user_grad_clip: true``),
saves it with ``trainer.save_model`` and loads it back with ``from_pretrained``. On a GPU the weights are fetched
block by block and AdamW runs on the CPU.
"""

from __future__ import annotations

import argparse
import logging
import tempfile

import torch
import transformers

from runtime import offload
from runtime.bundled.data import ByteBatches, stdlib_text_bytes
from runtime.integrations.hf_loss import use_chunked_loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default=None, help="where the trained model is saved (default: a temporary directory)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    out = args.out or tempfile.mkdtemp(prefix="tierstore-hf-")
    cuda = torch.cuda.is_available()

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    # HF's loss, its logits a piece of 1024 tokens at a time: with a real vocabulary (128k) the logits of a whole
    # micro-batch are what limit its size under a GPU budget. The Trainer sees the same .loss.
    model = use_chunked_loss(transformers.LlamaForCausalLM(config), piece_tokens=1024)
    training = transformers.TrainingArguments(output_dir=out, per_device_train_batch_size=8, max_steps=args.steps,
                                              learning_rate=3e-4, logging_steps=5, save_strategy="no", report_to=[],
                                              bf16=cuda, use_cpu=not cuda)
    # The Trainer's own AdamW leaves biases and norm weights out of weight decay: the same split as parameter groups
    # (get_decay_parameter_names does not use the Trainer instance). One group with weight_decay would decay all.
    decay = set(transformers.Trainer.get_decay_parameter_names(None, model))
    names = [name for name, p in model.named_parameters() if p.requires_grad]  # frozen ones are not offloaded
    groups = [{"params": [n for n in names if n in decay], "weight_decay": training.weight_decay},
              {"params": [n for n in names if n not in decay], "weight_decay": 0.0}]
    model, optimizer = offload(model, {
        "dtype": "bf16" if cuda else "fp32",
        "optimizer": {"lr": training.learning_rate, "betas": [training.adam_beta1, training.adam_beta2],
                      "eps": training.adam_epsilon, "grad_clip": None, "user_grad_clip": True}},
        param_groups=groups)
    data = ByteBatches(stdlib_text_bytes(4 << 20), batch_size=1, seq_len=128, seed=0)
    rows = [data.next()[0][0] for _ in range(8 * args.steps)]
    dataset = [{"input_ids": row, "labels": row.clone()} for row in rows]
    with optimizer.session:
        trainer = transformers.Trainer(model=model, args=training, train_dataset=dataset, optimizers=(optimizer, None))
        trainer.train()
        trainer.save_model(out)
    loaded = transformers.LlamaForCausalLM.from_pretrained(out)
    print(f"saved to {out}; reloaded {sum(p.numel() for p in loaded.parameters()):,} parameters")


if __name__ == "__main__":
    main()
