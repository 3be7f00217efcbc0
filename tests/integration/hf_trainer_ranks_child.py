"""One rank of an unchanged HF Trainer run of several processes (tests/integration/test_hf_trainer_ranks.py), or the one
process it is compared with: a tiny LlamaForCausalLM (built from a config: nothing downloaded) offloaded and given to
the stock ``Trainer`` as its optimizer, exactly as in one process (docs/user-guide.md, "HF Trainer"). Launched as
torchrun would; the Trainer's accelerate joins the process group (gloo on the CPU) and gives each rank its share of
each batch, and its ``max_grad_norm`` clip runs in the loop on every rank. Writes the Trainer's logged losses and
norms and the final weights (read on every rank: ``master_state_dict()``) to ``<out>/rank<R>.pt``. The Trainer
saves a checkpoint at step 2 (``save_strategy="steps"``: the model and ``optimizer.state_dict()``, on rank 0 alone)
and the model at the end (``trainer.save_model``); with ``save`` in argv, every rank also saves the model with
``session.save_pretrained``; with ``resume=DIR``, the Trainer resumes from its checkpoint DIR."""

from __future__ import annotations

import json
import os
import sys

import torch
import transformers

from runtime import offload
from tests.integration.test_hf_trainer import dataset, llama_config


def main(out: str, config: dict, steps: int, global_batch: int) -> None:
    """``steps`` optimizer steps of the stock Trainer at ``global_batch`` sequences a step over every rank."""
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    accumulation = config.get("optimizer", {}).get("accumulation_steps", 1)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(llama_config())
    args = transformers.TrainingArguments(
        output_dir=os.path.join(out, "trainer"), per_device_train_batch_size=global_batch // world // accumulation,
        gradient_accumulation_steps=accumulation, max_steps=steps, learning_rate=1e-3, logging_steps=1,
        save_strategy="steps", save_steps=2, report_to=[], use_cpu=config.get("device") == "cpu", seed=0,
        lr_scheduler_type="linear",
        warmup_steps=1, dataloader_drop_last=True)
    swap = os.path.join(out, "swap")
    os.makedirs(swap, exist_ok=True)
    model, optimizer = offload(model, {**config, "tiers": {"nvme": {"path": swap}}})
    session = optimizer.session
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset(), optimizers=(optimizer, None))
    try:
        resume = next((arg[len("resume="):] for arg in sys.argv[5:] if arg.startswith("resume=")), None)
        trainer.train(resume_from_checkpoint=resume)  # (resume: the Trainer's checkpoint, loaded on every rank)
        logs = [(entry["loss"], entry["grad_norm"]) for entry in trainer.state.log_history if "loss" in entry]
        commits = session.controller.optimizer_step  # the steps this session committed
        weights = session.master_state_dict()
        trainer.save_model(os.path.join(out, "trainer-saved"))  # the Trainer's own save: rank 0 alone writes
        if "save" in sys.argv[5:]:
            session.save_pretrained(os.path.join(out, "saved"))
        wrapped = type(trainer.model_wrapped).__name__  # what accelerate made of the model
    finally:
        session.close()
    torch.save({"logs": logs, "weights": weights, "wrapped": wrapped, "commits": commits},
               os.path.join(out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
