"""The optimizer object ``offload`` returns: a torch.optim.Optimizer whose step commits the offloaded update.

It is a real ``torch.optim.Optimizer``: parameter groups with their own ``lr``, ``betas``, ``eps`` and
``weight_decay`` (read when a block's update is queued, so schedulers and hand edits take effect at the next
step), ``state_dict()`` / ``load_state_dict()`` carrying the real Adam moments and step counters (streamed
from and to the tiers), ``zero_grad()`` that drops a pending step exactly as plain PyTorch does, and
``clip_grad_norm_`` / ``last_grad_norm`` for clipping in the user's loop. The update itself runs on the CPU
worker (or the GPU) as gradients arrive; ``step()`` commits it and returns at once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from runtime.core.signals import defers_interrupts
from runtime.engine.clipping import real_grad
from runtime.engine.controller import Controller
from runtime.engine.refusals import refuse_unfrozen
from runtime.engine.step_phase import StepPhase
from runtime.engine.torch_calls import GRAD_SET
from runtime.model.state_access import StateAccess
from runtime.update.adam import AdamWHyper

log = logging.getLogger(__name__)

# AdamW options whose other values change the update, which the offloaded one does not implement. Any other key of
# a group is kept and not read, as torch.optim.AdamW keeps one (a layer-decay recipe's lr_scale, a group's name).
UNSUPPORTED = {"amsgrad": False, "maximize": False, "decoupled_weight_decay": True}
# Which kernel torch.optim.AdamW runs: the offloaded update equals fused=True's bit for bit, so state_dict() always
# says so (a plain AdamW that loads a group without `fused` runs its foreach kernel, 1e-8 off). A group's own values
# are kept and ignored, and a loaded state's are not taken.
IMPLEMENTATION_FLAGS = {"foreach": None, "capturable": False, "differentiable": False, "fused": True}
ADD_PARAM_GROUP_REFUSAL = (
    "tierstore lays out the parameters and their optimizer state when it offloads the model, so a parameter the "
    "optimizer is given later would never be updated. Pass every group to offload(model, config, param_groups=[...]) "
    "instead (a group may hold parameters by name, with its own lr, betas, eps and weight_decay)")


class OffloadAdamW(torch.optim.Optimizer):
    """AdamW whose state lives in tierstore. Use like torch.optim.AdamW; see ``scale_loss`` for fp16."""

    def __init__(self, params: Iterable[Any], controller: Controller, access: StateAccess):
        hyper = controller.options.hyper
        defaults = dict(lr=hyper.lr, betas=(hyper.beta1, hyper.beta2), eps=hyper.eps, weight_decay=hyper.weight_decay)
        super().__init__(params, defaults)
        self.controller = controller
        self.access = access
        self._warned_regrouping = False
        self._bind_groups()
        controller.hypers.source = self._hypers

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's, while the constructor lays out the groups; afterwards refused. The offloaded parameters, their
        blocks and their Adam state are laid out by ``offload()``: a group added later would never be updated (its
        parameters are in no block) and would break ``state_dict()``."""
        if "controller" not in self.__dict__:  # torch.optim.Optimizer.__init__ adds the groups it was given
            super().add_param_group(param_group)
            return
        raise ValueError(f"add_param_group after offload(): {ADD_PARAM_GROUP_REFUSAL}")

    def _bind_groups(self) -> None:
        """Tell the controller which group each offloaded parameter is in."""
        group_of = check_param_groups(self.param_groups, self.controller.blocks, after_offload=True)
        self.controller.hypers.slot_groups = [[group_of[id(slot.param)] for slot in block.slots] for block in self.controller.blocks]
        self._membership = _membership(self.param_groups)

    def _follow_regrouping(self) -> None:
        """The groups' lists edited since they were bound (a parameter moved to another group, two groups' lists
        swapped, a group of offloaded parameters appended): bind them again, so the next update reads each
        parameter's new group as torch.optim.AdamW does. A parameter that is not offloaded, or one left out of
        every group, is refused (``check_param_groups``)."""
        if _membership(self.param_groups) == self._membership:
            return
        if self.controller.phase is StepPhase.READY and not self.controller.deferred and not self._warned_regrouping:
            self._warned_regrouping = True  # said once a session, as a change of the groups' values is
            log.warning("optimizer.param_groups' parameters changed between backward() and step(): this step's "
                        "updates started as its gradients landed and used the groups the backward found; the change "
                        "applies from the next step. Change them before the forward, or set "
                        "optimizer.user_grad_clip: true so that updates wait for optimizer.step() and read them there")
        self._bind_groups()

    def _hypers(self) -> list[AdamWHyper]:
        """Each group's AdamW hyper-parameters as they stand now (and their parameters: ``_follow_regrouping``)."""
        self._follow_regrouping()
        out = []
        for number, group in enumerate(self.param_groups):
            refuse_unsupported(number, group)
            beta1, beta2 = group["betas"]
            out.append(AdamWHyper(lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                                  weight_decay=float(group["weight_decay"])))
        return out

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Commit the update started by the last micro-batch's backward."""
        self.controller.check_open()
        self._follow_regrouping()  # refused before anything of the pending step changes
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._commit()
        return loss

    @defers_interrupts  # a Ctrl-C between queueing the step's updates and recording the step half-recorded it
    def _commit(self) -> None:
        self._refuse_unfrozen()
        self.controller.step()

    def _refuse_unfrozen(self) -> None:
        """A gradient assigned to a parameter frozen at offload() (the forward refuses one unfrozen before it runs:
        ``Controller.on_step_begin``)."""
        refuse_unfrozen(self.controller.frozen, lambda p: p.grad is not None, "got a gradient")

    @defers_interrupts
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop gradients. Called before ``step()`` after a backward, it drops that step's pending update (as
        plain PyTorch does: a step with no gradients changes nothing). ``set_to_none=False`` keeps zero gradients as
        plain PyTorch keeps zeroed ``.grad`` tensors: the next step updates every parameter that had a gradient with
        a zero one where its backwards give it none (``runtime.engine.kept_grads``)."""
        self.controller.note_zero_grad(set_to_none)
        if self.controller.step_pending:
            self.controller.discard_pending()
        for group in self.param_groups:
            for p in group["params"]:
                grad = real_grad(p)  # the real one, not a stand-in
                if grad is not None:
                    if set_to_none:
                        GRAD_SET(p, None)
                    else:
                        grad.zero_()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """fp16: multiply the loss by the dynamic loss scale before backward (identity otherwise)."""
        return self.controller.scale_loss(loss)

    def synchronize(self) -> None:
        """Block until every committed update has finished (e.g. before reading weights)."""
        self.controller.synchronize()

    # ---- clipping -----------------------------------------------------------------------------------
    @defers_interrupts
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the pending step's gradients to a global 2-norm of ``max_norm``, exactly as
        ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` would; returns the total norm.
        Needs updates that wait for the commit (``optimizer.user_grad_clip: true``, or ``optimizer.grad_clip``)."""
        self.controller.check_open()
        return self.controller.clipper.clip(max_norm)

    @property
    def last_grad_norm(self) -> float | None:
        """The global gradient norm of the last committed step (None when no norm was taken: streaming updates
        without clipping)."""
        return self.controller.clipper.last_grad_norm

    # ---- state ----------------------------------------------------------------------------------------
    def _slots(self) -> list[tuple[int, Any, int, Any]]:
        """(torch's state index, block, position in the block, slot) of every offloaded parameter, in
        param_groups order."""
        blocks = self.controller.blocks
        params = [p for group in self.param_groups for p in group["params"]]
        return [(index, blocks[b], position, blocks[b].slots[position])
                for index, (b, position) in enumerate(self.controller.param_slot[id(p)] for p in params)]

    @defers_interrupts
    def state_dict(self) -> dict[str, Any]:
        """torch.optim.AdamW's layout: ``state`` (per parameter index: ``step``, ``exp_avg``, ``exp_avg_sq``, CPU
        tensors read from the tiers) and ``param_groups``. A parameter that was never updated has no state,
        as in torch. Refused, with the numbers, when the moments would not fit in host memory."""
        self._follow_regrouping()
        self.access.settle(read_only=True)  # every committed update landed: its step counters and moments are final
        slots = self._slots()
        counters = {block.index: self.access.step_counters(block) for block in self.controller.blocks}
        updated = any(float(counters[block.index][position]) > 0 for _, block, position, _ in slots)
        by_name = {kind: self.access.slot_values(kind) if updated else {} for kind in ("exp_avg", "exp_avg_sq")}
        state: dict[int, dict[str, torch.Tensor]] = {}
        for index, block, position, slot in slots:
            step = counters[block.index][position]
            if float(step) == 0.0:
                continue
            state[index] = {"step": step.detach().to("cpu", copy=True), "exp_avg": by_name["exp_avg"][slot.name],
                            "exp_avg_sq": by_name["exp_avg_sq"][slot.name]}
        groups, start = [], 0
        for group in self.param_groups:
            saved = {**UNSUPPORTED, **{k: v for k, v in group.items() if k != "params"}, **IMPLEMENTATION_FLAGS}
            saved["params"] = list(range(start, start + len(group["params"])))
            start += len(group["params"])
            groups.append(saved)
        return {"state": state, "param_groups": groups}

    @defers_interrupts
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state_dict of this optimizer (or of torch.optim.AdamW over the same parameters): the groups'
        hyper-parameters, and each parameter's moments and step counter, written into the tiers."""
        self._follow_regrouping()
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) \
                or any(len(g["params"]) != len(s["params"]) for g, s in zip(groups, self.param_groups, strict=False)):
            raise ValueError("the optimizer state_dict's param_groups do not match this optimizer's (number of groups "
                             "or parameters per group); load the state of an optimizer built over the same parameters")
        for number, saved in enumerate(groups):
            refuse_unsupported(number, saved)
        saved_state = {int(k): v for k, v in state_dict["state"].items()}
        per_block: dict[int, list[tuple[int, Any, dict[str, torch.Tensor]]]] = {}
        for index, block, position, slot in self._slots():  # every check before anything changes
            entry = saved_state.get(index, {})
            for kind in ("exp_avg", "exp_avg_sq"):
                if kind in entry and tuple(entry[kind].shape) != tuple(slot.shape):
                    raise ValueError(f"optimizer state of {slot.name}: {kind} has shape {tuple(entry[kind].shape)}, "
                                     f"the parameter {tuple(slot.shape)}")
            per_block.setdefault(block.index, []).append((position, slot, entry))
        self.access.settle()
        self.access.before_writes("optimizer.load_state_dict")
        for group, saved in zip(self.param_groups, groups, strict=False):
            group.update({key: value for key, value in saved.items() if key != "params" and key not in IMPLEMENTATION_FLAGS})
        for block_index, entries in per_block.items():
            counters = self.controller.param_steps(block_index)
            for position, _slot, entry in entries:
                counters[position].fill_(float(entry.get("step", 0.0)))
            self.access.count_write(block_index)  # (the step counters: a read of them waits for the owner's too)
        for block in self.controller.blocks:
            entries = per_block.get(block.index, [])
            for kind in ("exp_avg", "exp_avg_sq"):
                def write(flat: torch.Tensor, entries: list[Any] = entries, kind: str = kind) -> None:
                    for _position, slot, entry in entries:
                        view = flat[slot.offset : slot.offset + slot.numel]
                        value = entry.get(kind)
                        view.copy_(value.reshape(-1)) if value is not None else view.zero_()

                self.access.write_state(block, kind, write)


def refuse_unsupported(number: int, group: dict[str, Any]) -> None:
    """Raise when param group ``number`` asks for an AdamW option the offloaded update does not implement."""
    for key, allowed in UNSUPPORTED.items():
        if group.get(key, allowed) != allowed:
            raise ValueError(f"param_groups[{number}]['{key}'] = {group[key]!r} is not supported by the offloaded AdamW")


def _membership(groups: list[dict[str, Any]]) -> tuple[tuple[int, ...], ...]:
    """Which parameters each group holds, by id (the offloaded parameters live as long as the session)."""
    return tuple(tuple(map(id, group["params"])) for group in groups)


def check_param_groups(groups: list[dict[str, Any]], blocks: list[Any], *, after_offload: bool = False) -> dict[int, int]:
    """Refuse groups the offloaded update can't honour (an option it does not implement, a parameter twice or
    missing, one that is not offloaded); returns each parameter's group number by id. ``after_offload``: the
    optimizer's groups, as the user's edits left them."""
    group_of: dict[int, int] = {}
    for number, group in enumerate(groups):
        refuse_unsupported(number, group)
        for p in group["params"]:
            if id(p) in group_of:
                raise ValueError(f"a parameter appears in param_groups {group_of[id(p)]} and {number}; list each once")
            group_of[id(p)] = number
    names = {id(slot.param): slot.name for block in blocks for slot in block.slots}
    if set(group_of) - set(names):
        if after_offload:
            raise ValueError(f"optimizer.param_groups hold a parameter that is not offloaded: {ADD_PARAM_GROUP_REFUSAL}")
        raise ValueError("param_groups hold parameters that are not offloaded (frozen, or not of this model): "
                         "give the optimizer only the model's trainable parameters")
    missing = [name for key, name in names.items() if key not in group_of]
    if missing and after_offload:
        raise ValueError(f"{missing[0]} was taken out of optimizer.param_groups: torch.optim.AdamW would stop updating "
                         "it, tierstore's update of its block would not. Leave it in a group and freeze it instead "
                         "(p.requires_grad_(False)): an offloaded parameter without a gradient is not "
                         "updated, as in torch.optim.AdamW")
    if missing:
        raise ValueError(f"param_groups must hold every offloaded parameter; missing: {missing[:5]}"
                         f"{' ...' if len(missing) > 5 else ''}")
    return group_of


def param_groups_of(model: nn.Module, groups: list[dict[str, Any]] | None, offloaded: list[nn.Parameter]) -> list[dict[str, Any]]:
    """The optimizer's param_groups: the user's (parameters given as tensors or as names of ``model``), or one
    group of every offloaded parameter."""
    if groups is None:
        return [{"params": offloaded}]
    named = dict(model.named_parameters())
    name_of = {id(p): name for name, p in named.items()}
    ours = {id(p) for p in offloaded}
    out = []
    for number, group in enumerate(groups):
        if "params" not in group:
            raise ValueError(f"param_groups[{number}] has no 'params'")
        params = []
        for p in group["params"]:
            if isinstance(p, str):
                if p not in named:
                    raise ValueError(f"param_groups[{number}]: the model has no parameter named {p!r}")
                p = named[p]
            if id(p) not in ours and id(p) in name_of and not p.requires_grad:
                # A weight-decay split built from named_parameters() (the HF Trainer recipe) lists frozen ones too.
                raise ValueError(
                    f"param_groups[{number}] holds {name_of[id(p)]}, which is frozen (requires_grad=False): only "
                    "trainable parameters are offloaded and updated. Leave frozen parameters out of param_groups, "
                    "e.g. names = [n for n, p in model.named_parameters() if p.requires_grad]")
            params.append(p)
        out.append({**group, "params": params})
    return out
