"""runtime/model/hooks.py against a recording stand-in for the controller: which controller call each hook makes, in
which order, and what a backward that raised leaves (the end-of-backward callback re-armed by the next forward)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from runtime.core.blocks import build_blocks
from runtime.model.hooks import HookSet


class _Recorder:
    """The controller calls HookSet makes, as (name, argument) pairs."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def on_step_begin(self) -> None:
        self.calls.append(("step_begin", None))

    def on_forward_end(self) -> None:
        self.calls.append(("forward_end", None))

    def acquire(self, indices: list[int], phase: str) -> None:
        self.calls.append((f"acquire {phase}", tuple(indices)))

    def release_after_forward(self, indices: list[int], phase: str) -> None:
        self.calls.append((f"release {phase}", tuple(indices)))

    def on_backward_begin(self, indices: list[int]) -> None:
        self.calls.append(("backward_begin", tuple(indices)))

    def on_param_grad(self, param: torch.Tensor) -> None:
        self.calls.append(("param_grad", None))

    def on_backward_end(self) -> None:
        self.calls.append(("backward_end", None))

    def on_grad_only_backward(self, indices: list[int]) -> None:
        self.calls.append(("grad_only_begin", tuple(indices)))

    def on_grad_only_backward_end(self) -> None:
        self.calls.append(("grad_only_end", None))

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]


class _TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.sum()


def _hooked() -> tuple[_TwoLayers, _Recorder, HookSet]:
    torch.manual_seed(0)
    model = _TwoLayers()
    blocks = build_blocks(model, min_block_nbytes=1)
    assert len(blocks) == 2
    recorder = _Recorder()
    return model, recorder, HookSet(model, blocks, recorder)  # type: ignore[arg-type]


def test_a_step_calls_the_controller_in_order_and_ends_the_backward_once():
    model, recorder, _ = _hooked()
    model(torch.randn(3, 8)).backward()
    names = recorder.names()
    assert names[:6] == ["step_begin", "acquire fwd", "release fwd", "acquire fwd", "release fwd", "forward_end"]
    assert [arg for name, arg in recorder.calls if name == "acquire fwd"] == [(0,), (1,)]
    assert [arg for name, arg in recorder.calls if name == "backward_begin"] == [(1,), (0,)]  # reverse order
    assert names.count("param_grad") == 4  # two weights, two biases
    assert names.count("backward_end") == 1 and names[-1] == "backward_end"


def test_a_backward_that_raised_drops_its_end_and_the_next_forward_rearms_it():
    model, recorder, _ = _hooked()

    def fail(grad: torch.Tensor) -> torch.Tensor:
        raise ValueError("planted")

    loss = model(torch.randn(3, 8))
    handle = model.layers[0].weight.register_hook(fail)
    with pytest.raises(ValueError, match="planted"):
        loss.backward()
    handle.remove()
    assert "backward_end" not in recorder.names()  # the engine drops queued callbacks of a failed backward
    recorder.calls.clear()
    model(torch.randn(3, 8)).backward()
    assert recorder.names().count("backward_end") == 1


def test_a_no_grad_forward_acquires_and_releases_and_remove_takes_every_hook_off():
    model, recorder, hooks = _hooked()
    with torch.no_grad():
        model(torch.randn(3, 8))
    assert recorder.names() == ["step_begin", "acquire fwd", "release fwd", "acquire fwd", "release fwd", "forward_end"]
    hooks.remove()
    recorder.calls.clear()
    model(torch.randn(3, 8)).backward()
    assert recorder.calls == []


def test_a_forward_that_raises_still_ends_the_forward():
    """The root's post-hook runs when the forward raises (always_call): the controller learns no forward runs."""
    model, recorder, _ = _hooked()

    def fail(module: nn.Module, args: object) -> None:
        raise ValueError("planted")

    handle = model.layers[1].register_forward_pre_hook(fail)
    with pytest.raises(ValueError, match="planted"):
        model(torch.randn(3, 8))
    handle.remove()
    assert recorder.names()[0] == "step_begin" and recorder.names()[-1] == "forward_end"


def test_a_deepcopy_of_the_model_does_not_drive_the_session():
    model, recorder, _ = _hooked()
    twin = copy.deepcopy(model)
    recorder.calls.clear()
    twin(torch.randn(3, 8)).backward()
    assert recorder.calls == []


@pytest.mark.parametrize("how", ["input", "parameters", "inputs="])
def test_a_backward_that_accumulates_into_no_parameter_is_no_micro_batch(how):
    """torch.autograd.grad of an input's or the parameters' gradient, backward(inputs=[x]): the blocks are acquired
    for the arithmetic (grad_only_begin, in reverse order) and released at the end, and the step sees no backward."""
    model, recorder, _ = _hooked()
    x = torch.randn(3, 8, requires_grad=True)
    loss = model(x)
    recorder.calls.clear()
    if how == "input":
        torch.autograd.grad(loss, x)
    elif how == "parameters":
        torch.autograd.grad(loss, list(model.parameters()))
    else:
        loss.backward(inputs=[x])
    assert recorder.calls == [("grad_only_begin", (1,)), ("grad_only_begin", (0,)), ("grad_only_end", None)]
    recorder.calls.clear()
    model(x).backward(inputs=[model.layers[0].weight])  # accumulates into one offloaded parameter: a micro-batch
    assert [name for name in recorder.names() if "backward" in name or "grad" in name] == [
        "backward_begin", "backward_begin", "param_grad", "backward_end"]


@pytest.mark.parametrize("how", ["grad", "backward"])
def test_a_create_graph_backward_is_refused_before_anything_is_counted(how):
    """A graph of the backward would read the blocks' weights again after their release: refused at its first hook,
    no controller call made, no gradient left on a parameter."""
    model, recorder, _ = _hooked()
    x = torch.randn(3, 8, requires_grad=True)
    loss = model(x)
    recorder.calls.clear()
    with pytest.raises(RuntimeError, match="create_graph=True .* higher-order gradients are not supported"):
        if how == "grad":
            torch.autograd.grad(loss, x, create_graph=True)
        else:
            loss.backward(create_graph=True)
    assert recorder.calls == []
    assert all(p.grad is None for p in model.parameters())
