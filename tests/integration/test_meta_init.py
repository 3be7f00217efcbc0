"""A model built on the meta device is filled block by block by ``init`` and trains exactly like the same
model built on the host."""

from __future__ import annotations

import pytest
import torch

from runtime import offload
from runtime.bundled.example_model import ExampleLM, ModelShape
from runtime.model.materialize import seeded_normal_init
from tests.integration.reference_loop import ReferenceTrainer
from tests.integration.test_parity import assert_identical, make_batches, step_and_check

SHAPE = ModelShape(vocab_size=256, hidden_size=32, num_layers=3, num_heads=4, ffn_size=64, tie_embeddings=True)



def test_meta_model_matches_host_model(tmpfs_dir):
    host_model = ExampleLM(SHAPE)
    with torch.no_grad():
        for name, p in host_model.named_parameters():
            seeded_normal_init(name, p)
    reference = ReferenceTrainer(host_model)
    with torch.device("meta"):
        meta_model = ExampleLM(SHAPE)
    assert all(p.is_meta for p in meta_model.parameters())
    config = {"dtype": "fp32", "optimizer": {"grad_clip": None}, "placement": {"moments": "nvme"},
              "tiers": {"nvme": {"path": str(tmpfs_dir)}}}
    model, optimizer = offload(meta_model, config, init=seeded_normal_init)
    session = optimizer.session
    try:
        assert model.head.weight is model.embed.weight  # tying survived materialisation
        for x, y in make_batches(3):
            step_and_check(model, optimizer, reference, x, y)
        assert_identical(session.master_state_dict(), reference)
    finally:
        session.close()


def test_meta_model_without_init_is_refused():
    with torch.device("meta"):
        model = ExampleLM(SHAPE)
    with pytest.raises(ValueError, match="init="):
        offload(model, {"dtype": "fp32"})
