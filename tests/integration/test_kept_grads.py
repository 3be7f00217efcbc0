"""``optimizer.zero_grad(set_to_none=False)`` keeps zero gradients, as plain PyTorch keeps zeroed ``.grad`` tensors
(``runtime.engine.kept_grads``): a parameter a step's backwards do not reach is updated with a zero gradient, a ``step()``
with no backward updates every parameter that had a gradient, and ``zero_grad()`` (to None) stops both. Each case
runs beside a plain AdamW loop doing the same calls (fp32 on the CPU: equal means bit-identical), with a model whose
second layer of each pair is skipped on odd steps: a block with some parameters unreached, or, one block a layer, a
block with none."""

from __future__ import annotations

import copy
import time

import pytest
import torch

from runtime import offload

LR = 1e-2
WEIGHT_DECAY = 0.01


class PartlyUsedNet(torch.nn.Module):
    """Two pairs of linear layers; ``skip_b`` leaves each pair's second layer out of the forward (also
    ``test_speculation``'s)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.ModuleDict({"a": torch.nn.Linear(16, 16), "b": torch.nn.Linear(16, 16)})
                                          for _ in range(2))

    def forward(self, x: torch.Tensor, skip_b: bool) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer["a"](x))
            if not skip_b:
                x = torch.tanh(layer["b"](x))
        return x.pow(2).mean()


PLACEMENTS = {  # each with the check that the session placed its updates so
    "cpu-streaming": {},
    "cpu-clipped": {"grad_clip": 0.05},
    "device-updated": {"gpu_update_fraction": 0.5, "gpu_stream_fraction": 0.0},
    "streamed": {"gpu_update_fraction": 0.0, "gpu_stream_fraction": 0.6, "grad_clip": 0.05},
    "host-sums": {"accumulation_steps": 2, "accumulate_on": "host", "grad_clip": 0.05},
    "device-sums": {"accumulation_steps": 2, "accumulate_on": "gpu"},
}


PLACED = {
    "cpu-streaming": lambda c: not c.deferred and not c.gpu_updated and not c.gpu_streamed,
    "cpu-clipped": lambda c: c.deferred and not c.gpu_updated and not c.gpu_streamed,
    "device-updated": lambda c: bool(c.gpu_updated),
    "streamed": lambda c: bool(c.gpu_streamed),
    "host-sums": lambda c: c.sums is not None,
    "device-sums": lambda c: c.sums is None and c.options.accumulation_steps == 2,
}


def _batch(step: int, micro: int) -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * step + micro))


class _Both:
    """The offloaded model and the plain one, driven by the same calls."""

    def __init__(self, optimizer_config: dict, modules: str, device: str = "cpu"):
        torch.manual_seed(0)
        model = PartlyUsedNet()
        self.device = device
        self.reference = copy.deepcopy(model).to(device)
        self.initial = {name: p.detach().clone() for name, p in self.reference.named_parameters()}
        self.ref_opt = torch.optim.AdamW(self.reference.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
        self.clip = optimizer_config.get("grad_clip")
        self.accumulation = optimizer_config.get("accumulation_steps", 1)
        config = {"dtype": "fp32", "device": device, "blocks": {"modules": [modules]},
                  "optimizer": {"lr": LR, "weight_decay": WEIGHT_DECAY, "grad_clip": None, **optimizer_config}}
        self.model, self.optimizer = offload(model, config)
        self.session = self.optimizer.session

    def train_step(self, step: int, skip_b: bool) -> None:
        for micro in range(self.accumulation):
            x = _batch(step, micro).to(self.device)
            self.model(x, skip_b).backward()
            self.reference(x, skip_b).backward()
        self.step()

    def step(self) -> None:
        self.optimizer.step()
        if self.clip is not None:
            torch.nn.utils.clip_grad_norm_(self.reference.parameters(), self.clip)
        self.ref_opt.step()

    def zero_grad(self, set_to_none: bool) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
        self.ref_opt.zero_grad(set_to_none=set_to_none)

    def assert_equal(self, when: str) -> None:
        """Bit-identical on the CPU. On a GPU the blocks tierstore updates on the CPU run the CPU's fused AdamW
        against the reference's CUDA kernel (last-bit differences): there within 1% of what training changed, far
        below what one update missed or applied twice moves."""
        weights = self.session.master_state_dict()
        for name, p in self.reference.named_parameters():
            if self.device == "cpu":
                assert torch.equal(weights[name], p.detach()), f"{name} differs {when}"
            else:
                change = (p.detach() - self.initial[name]).norm()
                assert (weights[name].to(self.device) - p.detach()).norm() <= 0.01 * change, f"{name} differs {when}"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("modules", ["layers.*", "layers.*.*"], ids=["partly-used-block", "unused-block"])
@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.quick_cases({"placement": "cpu-clipped"}, {"placement": "device-updated"}, {"placement": "host-sums"}, {"device": "cuda"})
def test_kept_zero_gradients_update_as_in_plain_pytorch(placement, modules, device):
    both = _Both(PLACEMENTS[placement], modules, device)
    with both.session:
        assert PLACED[placement](both.session.controller)
        for step in range(4):  # odd steps skip the second layers: plain AdamW updates them with zero gradients
            both.train_step(step, skip_b=step % 2 == 1)
            both.zero_grad(set_to_none=False)
            both.assert_equal(f"after step {step}")
        both.step()  # no backward: every parameter that had a gradient takes a zero one
        both.assert_equal("after a step with no backward")
        both.zero_grad(set_to_none=True)  # from here the unreached layers are left alone, as plain PyTorch leaves them
        both.train_step(4, skip_b=True)
        both.zero_grad(set_to_none=True)
        both.step()  # nothing to update in either
        both.assert_equal("after the gradients went to None")
        state = both.optimizer.state_dict()["state"]
        reference_state = both.ref_opt.state_dict()["state"]
        assert [float(state[i]["step"]) for i in sorted(state)] == [float(reference_state[i]["step"])
                                                                   for i in sorted(reference_state)]


def test_zero_grad_keeping_zeros_mid_step_drops_the_step_and_the_next_updates_with_zeros():
    """``zero_grad(set_to_none=False)`` between a backward and ``step()``: the step's gradients become zeros, and the
    ``step()`` that follows updates every parameter that had one with a zero gradient, as in plain PyTorch."""
    both = _Both({"grad_clip": 0.05, "accumulation_steps": 2, "accumulate_on": "host"}, "layers.*.*")
    with both.session:
        both.train_step(0, skip_b=False)
        both.zero_grad(set_to_none=True)
        for micro in range(2):
            x = _batch(1, micro)
            both.model(x, True).backward()
            both.reference(x, True).backward()
        both.zero_grad(set_to_none=False)  # the step in progress is dropped; its gradients and step 0's kept as zeros
        both.step()
        both.assert_equal("after a step of kept zeros")


@pytest.mark.parametrize("placement", ["cpu-clipped", "host-sums"])
def test_a_gradient_set_to_none_is_no_longer_kept(placement):
    """``p.grad = None`` (after a backward, or between steps) drops the parameter's tensor in plain PyTorch: with
    zeros kept, it is not updated with a zero gradient afterwards."""
    both = _Both(PLACEMENTS[placement], "layers.*.*")
    dropped = [dict(m.named_parameters())["layers.0.b.weight"] for m in (both.model, both.reference)]
    with both.session:
        both.train_step(0, skip_b=False)
        both.zero_grad(set_to_none=False)
        for p in dropped:  # between steps
            p.grad = None
        both.train_step(1, skip_b=True)
        both.assert_equal("after a step without the dropped parameter")
        both.zero_grad(set_to_none=False)
        for micro in range(both.accumulation):
            x = _batch(2, micro)
            both.model(x, False).backward()
            both.reference(x, False).backward()
        for p in dropped:  # after the step's backward
            p.grad = None
        both.step()
        both.zero_grad(set_to_none=False)
        both.step()  # kept zeros: every parameter but the dropped one
        both.assert_equal("after a step of kept zeros")


def test_a_loop_that_clears_with_the_module_after_one_zero_grad_keeping_zeros_trains_as_plain_pytorch():
    """One ``optimizer.zero_grad(set_to_none=False)``, then ``model.zero_grad()`` (which tierstore does not see) after
    every step: zeros are kept only until the next step with a backward commits, so the parameters the later steps
    do not reach are left alone, as in plain PyTorch."""
    both = _Both({"grad_clip": 0.05}, "layers.*")
    with both.session:
        both.zero_grad(set_to_none=False)
        for step in range(4):
            both.train_step(step, skip_b=step % 2 == 1)
            both.model.zero_grad()
            both.reference.zero_grad()
            both.assert_equal(f"after step {step}")


@pytest.mark.parametrize("rep", range(6))
@pytest.mark.quick_cases({"rep": 0}, {"rep": 1})
def test_a_step_of_assigned_gradients_right_after_a_step_reads_its_updates(rep):
    """``step()`` with gradients assigned by hand right after a step, with no forward between (nothing fetched the
    weights, which waits for their update): its updates start from the last step's, not from state that an update
    still in flight was writing (clipping that clips: the last step's updates ran again after the commit; before the
    fix about a third of such runs updated some blocks from stale moments or step counts)."""
    both = _Both(PLACEMENTS["host-sums"], "layers.*.*")
    with both.session:
        both.train_step(0, skip_b=False)
        both.zero_grad(set_to_none=True)
        both.train_step(1, skip_b=False)
        both.zero_grad(set_to_none=True)
        for model in (both.model, both.reference):
            for p in model.parameters():
                p.grad = torch.full(p.shape, 0.01 * (rep + 1))
        both.step()
        both.assert_equal("after the step of assigned gradients")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("placement", ["cpu-streaming", "cpu-clipped", "device-sums"])
def test_a_block_no_forward_used_waits_for_its_last_update_before_its_gradient_lands(placement, device, monkeypatch):
    """A block the step's forward skips gets its kept zero gradient (or, with device sums, a step ended after one
    of two micro-batches) while the last step's update of it may still be queued: nothing fetched its weights, which
    waits for that update. Its gradient waits for it before filling the host gradient buffer that update reads (a
    slow CPU update of the last block stands in for a busy host: without the wait that update read zeros)."""
    from runtime.update import worker as overlap

    run_job = overlap.UpdateWorker._run_job

    def slow_last_block(worker, job):
        if job.block.index == 3 and job.step == 1 and not job.skip:
            time.sleep(0.3)  # the busy host under test: the gradient must wait for this update, whatever its length
        run_job(worker, job)

    monkeypatch.setattr(overlap.UpdateWorker, "_run_job", slow_last_block)
    both = _Both(PLACEMENTS[placement], "layers.*.*", device)
    with both.session:
        both.train_step(0, skip_b=False)
        both.zero_grad(set_to_none=False)
        if placement == "device-sums":  # one micro-batch of two, then step(): the step ends early
            x = _batch(1, 0).to(device)
            both.model(x, True).backward()
            both.reference(x, True).backward()
            both.step()
        else:
            both.train_step(1, skip_b=True)
        both.assert_equal("after the step that skipped the block")
