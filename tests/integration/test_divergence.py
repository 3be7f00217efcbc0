"""The prefetch schedule survives divergence: alternating train / eval steps and a data-dependent branch."""

from __future__ import annotations

import torch

from runtime import offload
from runtime.bundled.example_model import ExampleLM, ModelShape, rotary_tables
from tests.integration.reference_loop import ReferenceTrainer
from tests.integration.test_parity import assert_identical, make_batches, step_and_check


class BranchyLM(ExampleLM):
    """ExampleLM that skips an odd layer when the batch's first token is even: a data-dependent path."""

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        head_dim = self.shape.hidden_size // self.shape.num_heads
        cos, sin = rotary_tables(tokens.shape[1], head_dim, tokens.device)
        x = self.embed(tokens)
        skip_odd = int(tokens[0, 0]) % 2 == 0
        for i, layer in enumerate(self.layers):
            if skip_odd and i % 2 == 1:
                continue
            x = layer(x, cos, sin)
        logits = self.head(self.norm(x)).float()
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


def test_train_eval_alternation_and_branches_match_reference():
    torch.manual_seed(0)
    shape = ModelShape(vocab_size=256, hidden_size=32, num_layers=4, num_heads=4, ffn_size=64)
    model = BranchyLM(shape)
    reference = ReferenceTrainer(model)
    model, optimizer = offload(model, {"dtype": "fp32", "optimizer": {"grad_clip": None}, "prefetch": {"depth": 3}})
    session = optimizer.session
    batches = make_batches(16, seed=3)
    # Make sure both paths are taken.
    parities = {int(x[0, 0]) % 2 for x, _ in batches}
    assert parities == {0, 1}
    try:
        for i, (x, y) in enumerate(batches):
            if i % 3 == 2:  # an eval step under no_grad between training steps
                model.eval()
                with torch.no_grad():
                    ours = model(x, y).item()
                    theirs = reference.model.eval()(x, y).item()
                model.train()
                reference.model.train()
                assert ours == theirs
                continue
            step_and_check(model, optimizer, reference, x, y)
        assert_identical(session.master_state_dict(), reference)
        stats = session.controller.schedule.stats
        traces = session.controller.schedule.traces()
    finally:
        session.close()
    assert {"train", "eval"} <= set(traces)
    assert stats.divergences > 0 and stats.repairs > 0  # the branch really diverged and the trace was repaired
    assert stats.hits > 0  # prefetch kept working after divergence
    print(f"prefetch hit rate {stats.hit_rate:.2f} ({stats.hits} hits, {stats.misses} misses, {stats.repairs} repairs)")
