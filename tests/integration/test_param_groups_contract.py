"""The optimizer's param_groups after offload(): edited by hand, carrying extra keys, saved and loaded.

Each test runs torch.optim.AdamW(fused=True) over a plain model beside the offloaded one (fp32 on the CPU, so equal
means bit-identical), or checks that what tierstore can't do exactly is refused with what to change, never ignored.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from runtime import offload
from tests.integration.test_parity import make_batches
from tests.integration.test_user_contract import LR, assert_same, config, fresh_model, offloaded_step, plain_step


def two_groups(model: nn.Module) -> list[dict]:
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if not n.startswith("head")]},
            {"params": [p for n, p in named if n.startswith("head")], "lr": 10 * LR}]


def move_embedding(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.param_groups[0]["params"] = [p for p in opt.param_groups[0]["params"] if p is not model.embed.weight]
    opt.param_groups[1]["params"].append(model.embed.weight)


def swap_lists(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    first, second = opt.param_groups
    first["params"], second["params"] = second["params"], first["params"]


def split_out_a_layer(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    layer = list(model.layers[1].parameters())
    opt.param_groups[0]["params"] = [p for p in opt.param_groups[0]["params"] if not any(p is q for q in layer)]
    opt.param_groups.append({**{k: v for k, v in opt.param_groups[0].items() if k != "params"},
                             "params": layer, "lr": 3 * LR, "weight_decay": 0.0})


@pytest.mark.parametrize("regroup", [move_embedding, swap_lists, split_out_a_layer])
@pytest.mark.parametrize("user_clip", [False, True], ids=["streaming", "updates_wait"])
@pytest.mark.quick_cases({"regroup": split_out_a_layer})
def test_offloaded_parameters_moved_between_groups_train_like_torch_adamw(
        tmp_path, regroup: Callable[[nn.Module, torch.optim.Optimizer], None], user_clip: bool):
    """The groups' lists edited between steps (a parameter moved, two lists swapped, a layer split into a group of
    its own): the next step updates each parameter with its new group's values, as torch's AdamW does, and the
    state_dict lists them in the new order. It had kept each parameter in the group it was in at offload(),
    silently."""
    plain = fresh_model()
    plain_opt = torch.optim.AdamW(two_groups(plain), lr=LR, weight_decay=0.01, fused=True)
    model = fresh_model()
    model, optimizer = offload(model, config(tmp_path, user_grad_clip=user_clip), param_groups=two_groups(model))
    with optimizer.session:
        for step, batch in enumerate(make_batches(3)):
            if step == 1:
                regroup(plain, plain_opt)
                regroup(model, optimizer)
            plain_step(plain, plain_opt, batch)
            offloaded_step(model, optimizer, batch)
        assert_same(model.state_dict(), plain.state_dict())
        ours, theirs = optimizer.state_dict(), plain_opt.state_dict()
        assert [g["params"] for g in ours["param_groups"]] == [g["params"] for g in theirs["param_groups"]]
        for index, state in theirs["state"].items():
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(ours["state"][index][key], state[key])


@pytest.mark.parametrize("user_clip", [False, True], ids=["streaming", "updates_wait"])
def test_a_regrouping_between_backward_and_step_is_exact_or_said(tmp_path, caplog, user_clip: bool):
    """A parameter moved to another group after backward, before step(): where updates wait for step() it applies
    to that step, as in torch; streaming updates already ran with the old groups, so it applies a step late and a
    warning says so, once."""
    import logging

    plain = fresh_model()
    plain_opt = torch.optim.AdamW(two_groups(plain), lr=LR, weight_decay=0.01, fused=True)
    model = fresh_model()
    model, optimizer = offload(model, config(tmp_path, user_grad_clip=user_clip), param_groups=two_groups(model))
    with optimizer.session, caplog.at_level(logging.WARNING, logger="runtime.model.optimizer"):
        for step, batch in enumerate(make_batches(3)):
            for net, opt in ((plain, plain_opt), (model, optimizer)):
                net(*batch).backward()
                if step > 0:
                    opt.param_groups.reverse()
                opt.step()
                opt.zero_grad()
        warnings = [r for r in caplog.records if "parameters changed between backward() and step()" in r.getMessage()]
        assert len(warnings) == (0 if user_clip else 1)
        if user_clip:
            assert_same(model.state_dict(), plain.state_dict())


def append_a_new_parameter(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.param_groups[0]["params"].append(nn.Parameter(torch.zeros(4)))


def append_a_new_group(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.param_groups.append({**{k: v for k, v in opt.param_groups[0].items() if k != "params"},
                             "params": [nn.Parameter(torch.zeros(4))]})


def take_one_out(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.param_groups[0]["params"] = [p for p in opt.param_groups[0]["params"] if p is not model.layers[0].qkv.weight]


@pytest.mark.parametrize("edit, refusal", [
    (append_a_new_parameter, r"not offloaded: .*param_groups=\[\.\.\.\]"),
    (append_a_new_group, r"not offloaded: .*param_groups=\[\.\.\.\]"),
    (take_one_out, r"layers\.0\.qkv\.weight was taken out of optimizer\.param_groups.*requires_grad_\(False\)"),
])
def test_a_parameter_not_offloaded_or_left_out_of_every_group_is_refused_not_ignored(tmp_path, edit, refusal):
    """A parameter given to the optimizer after offload() (appended to a group's list, or in a group appended to
    param_groups) is refused as add_param_group is; one taken out of every group too (torch's AdamW would stop
    updating it), saying to freeze it instead. Refused where the groups are next read: step() (the pending step
    is left as it was), state_dict(), the next backward (before any update starts). They had ignored the edit
    silently, and state_dict() raised a bare KeyError. With the edit undone, training goes on exactly."""
    plain = fresh_model()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=LR, weight_decay=0.01, fused=True)
    model, optimizer = offload(fresh_model(), config(tmp_path, user_grad_clip=True))
    batches = make_batches(4)
    with optimizer.session:
        for batch in batches[:1]:
            plain_step(plain, plain_opt, batch)
            offloaded_step(model, optimizer, batch)
        before = [{**group, "params": list(group["params"])} for group in optimizer.param_groups]

        def undo() -> None:
            optimizer.param_groups[:] = [{**group, "params": list(group["params"])} for group in before]

        model(*batches[1]).backward()
        edit(model, optimizer)
        with pytest.raises(ValueError, match=refusal):
            optimizer.step()
        with pytest.raises(ValueError, match=refusal):
            optimizer.state_dict()
        undo()
        optimizer.step()  # the pending step was left as it was
        optimizer.zero_grad()
        plain_step(plain, plain_opt, batches[1])
        edit(model, optimizer)
        with pytest.raises(ValueError, match=refusal):
            model(*batches[2]).backward()
        undo()
        for batch in batches[3:]:  # the next forward drops the failed backward's step
            plain_step(plain, plain_opt, batch)
            offloaded_step(model, optimizer, batch)
        assert_same(model.state_dict(), plain.state_dict())


def test_extra_group_keys_at_offload_are_kept_and_implementation_flags_ignored(tmp_path):
    """A layer-decay recipe's keys in each group (lr_scale, layer_id) and torch's implementation flags (foreach,
    fused, capturable, differentiable) are taken by offload() as torch.optim.AdamW takes them (they had been
    refused); a loop reading lr_scale trains bit for bit like torch's fused AdamW. An option that changes the
    update is still refused."""
    def groups(model: nn.Module) -> list[dict]:
        layered = [{"params": list(layer.parameters()), "lr_scale": 0.8 ** (3 - i), "layer_id": i}
                   for i, layer in enumerate(model.layers)]
        rest = [p for n, p in model.named_parameters() if not n.startswith("layers.")]
        return [*layered, {"params": rest, "lr_scale": 1.0, "layer_id": -1, "foreach": False, "capturable": False,
                           "differentiable": False}]

    plain = fresh_model()
    plain_opt = torch.optim.AdamW(groups(plain), lr=LR, weight_decay=0.01, fused=True)
    model = fresh_model()
    offloaded_groups = groups(model)
    offloaded_groups[0]["fused"] = False
    model, optimizer = offload(model, config(tmp_path / "a"), param_groups=offloaded_groups)
    with optimizer.session:
        assert optimizer.param_groups[1]["layer_id"] == 1
        for step, batch in enumerate(make_batches(3)):
            for opt in (plain_opt, optimizer):
                for group in opt.param_groups:
                    group["lr"] = LR * (step + 1) * group["lr_scale"]
            plain_step(plain, plain_opt, batch)
            offloaded_step(model, optimizer, batch)
        assert_same(model.state_dict(), plain.state_dict())
        saved = optimizer.state_dict()["param_groups"]
        assert [g["lr_scale"] for g in saved] == [g["lr_scale"] for g in plain_opt.param_groups]
        assert all(g["fused"] is True and g["foreach"] is None for g in saved)
    model = fresh_model()
    with pytest.raises(ValueError, match="amsgrad"):
        offload(model, config(tmp_path / "b"), param_groups=[{"params": list(model.parameters()), "amsgrad": True}])
    with pytest.raises(ValueError, match="decoupled_weight_decay"):
        offload(model, config(tmp_path / "c"),
                param_groups=[{"params": list(model.parameters()), "decoupled_weight_decay": False}])


def test_state_dict_says_fused_after_loading_a_foreach_adamw_state(tmp_path):
    """After loading the state of a default (foreach) torch AdamW, optimizer.state_dict() still says fused: True,
    so torch's AdamW(fused=True) that loads it goes on bit for bit like the fused loop (it had reported the loaded
    fused: None, and the plain AdamW loading it ran its foreach kernel, 4e-9 off)."""
    batches = make_batches(5)
    source = fresh_model()
    source_opt = torch.optim.AdamW(source.parameters(), lr=LR, weight_decay=0.01)  # foreach: fused None
    plain_step(source, source_opt, batches[0])
    reference = fresh_model()  # the fused loop from there on
    reference.load_state_dict(source.state_dict())
    reference_opt = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.01, fused=True)
    state = source_opt.state_dict()
    reference_opt.load_state_dict({**state, "param_groups": [{**g, "fused": True} for g in state["param_groups"]]})
    model, optimizer = offload(fresh_model(), config(tmp_path))
    with optimizer.session:
        model.load_state_dict(source.state_dict())
        optimizer.load_state_dict(source_opt.state_dict())
        for batch in batches[1:3]:
            plain_step(reference, reference_opt, batch)
            offloaded_step(model, optimizer, batch)
        assert_same(model.state_dict(), reference.state_dict())
        saved, weights = optimizer.state_dict(), model.state_dict()
    assert all(g["fused"] is True and g["foreach"] is None for g in saved["param_groups"])
    moved = fresh_model()
    moved.load_state_dict(weights)
    moved_opt = torch.optim.AdamW(moved.parameters(), lr=LR, weight_decay=0.01, fused=True)
    moved_opt.load_state_dict(saved)
    for batch in batches[3:]:
        plain_step(reference, reference_opt, batch)
        plain_step(moved, moved_opt, batch)
    assert_same(moved.state_dict(), reference.state_dict())


def test_a_frozen_parameter_in_the_groups_given_to_offload_is_refused_by_name():
    """The HF Trainer recipe builds its weight-decay split from named_parameters(); a frozen parameter there was
    refused without a name ('parameters that are not offloaded'). The refusal names it and says what to list."""
    model = fresh_model()
    model.embed.weight.requires_grad_(False)
    names = [name for name, _ in model.named_parameters()]
    with pytest.raises(ValueError, match=r"param_groups\[0\] holds embed.weight, which is frozen .*p.requires_grad\]"):
        offload(model, {"device": "cpu", "dtype": "fp32", "optimizer": {"grad_clip": None}},
                param_groups=[{"params": names}])
