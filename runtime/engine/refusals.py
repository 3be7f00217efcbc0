"""What the controller says when the user's loop asks for something a step can't do now: each message names what
happened, why it can't be honoured and the call or config key that makes it work (as ``tierstore.errors`` does for
the store). The controller decides when to refuse; this module only words it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

CHECKPOINT_LOAD = "Restore the last checkpoint (runtime.checkpoint.state.load_checkpoint)"


def cut_off(names: list[str]) -> RuntimeError:
    """Parameters whose storage was swapped (``param.set_``): no update reaches what they compute with."""
    many = len(names) > 1
    return RuntimeError(
        f"offloaded parameter{'s' if many else ''} {', '.join(names[:3])}{' ...' if len(names) > 3 else ''} "
        f"no longer use{'' if many else 's'} tierstore's memory (`param.set_(...)`, or another swap of "
        "its storage): the forward would compute with values no update reaches. Write new values with "
        "param.copy_(...) or load_state_dict, or set them before offload()")


def forward_after_last_backward(accumulation_steps: int) -> RuntimeError:
    """A forward between the step's last backward and ``optimizer.step()``."""
    return RuntimeError(
        f"the model ran forward after the step's last backward (micro-batch {accumulation_steps} of "
        f"optimizer.accumulation_steps: {accumulation_steps}) but before optimizer.step(): the blocks' updates for that "
        "step are under way. Call optimizer.step() first (an evaluation too runs after it), and set "
        "optimizer.accumulation_steps to the backward passes your loop makes per step() (a step() after fewer is fine)")


def backward_after_last_backward(accumulation_steps: int) -> RuntimeError:
    """A micro-batch's backward after the step's last one, before ``optimizer.step()``."""
    return RuntimeError(
        "a backward ran after the last micro-batch's backward, before optimizer.step(): each block's gradient "
        "was taken off the parameters for its update when that backward reached it, so a second one could not "
        f"be added to the step. Call optimizer.step() (or zero_grad()) after every {accumulation_steps} "
        "backward pass(es), or raise optimizer.accumulation_steps to the number of backward passes per step")


def grad_only_after_last_backward() -> RuntimeError:
    """``torch.autograd.grad`` (no parameter's ``.grad``) after the step's last backward."""
    return RuntimeError(
        "a backward that accumulates into no parameter (torch.autograd.grad, backward(inputs=...)) ran after "
        "the step's last backward, before optimizer.step(): the blocks' weights are being updated for that "
        "step. Take such gradients before that backward, or after optimizer.step()")


def step_after_raised_backward() -> RuntimeError:
    """``optimizer.step()`` after a backward that raised."""
    return RuntimeError(
        "optimizer.step() after a backward that did not finish (it raised): its gradients are partial. Call "
        "optimizer.zero_grad() to drop the step, as after any exception in forward or backward")


def step_count_mismatch(micro: int, accumulation_steps: int) -> RuntimeError:
    """``optimizer.step()`` where the step's phase allows none."""
    return RuntimeError(
        f"optimizer.step() called after {micro} backward pass(es); the config's optimizer.accumulation_steps is "
        f"{accumulation_steps}: call backward that many times per step")


def assigned_grads_under_loss_scaling() -> RuntimeError:
    """Gradients assigned by hand never carried the fp16 loss scale the step divides by."""
    return RuntimeError(
        "optimizer.step() found gradients assigned to .grad by hand under fp16 loss scaling (dtype: fp16): "
        "tierstore divides a step's gradients by its loss scale, and these never carried it. Compute them "
        "with optimizer.scale_loss(loss).backward()")


def session_closed() -> RuntimeError:
    """The optimizer used after its session closed (it would change nothing or read freed state)."""
    return RuntimeError(
        "this optimizer's offload session was closed (optimizer.session.close(), or the end of `with "
        "optimizer.session:`): its tiers were freed and the model is a plain module again. Save the optimizer "
        "state (optimizer.state_dict(), runtime.checkpoint.state.save_checkpoint) before closing; to train on, "
        "offload the model again (offload(model, config)) and load that state")


def abandoned_step(started: int, num_blocks: int) -> str:
    """Why the blocks are at different steps after a streaming step was dropped with ``started`` updates begun."""
    what = (f"a step was abandoned after {started} of {num_blocks} blocks had started their update (updates start as "
            "gradients land), so the blocks are at different steps" if started < num_blocks
            else "a step was abandoned after every block's update had started (updates start as gradients land): the "
                 "weights and moments hold a step optimizer.step() never committed")
    return (what + f". {CHECKPOINT_LOAD}, or set optimizer.user_grad_clip: true so that updates wait for "
            "optimizer.step() and an abandoned step changes nothing")


def refuse_unfrozen(frozen: list[tuple[str, torch.nn.Parameter]], unfrozen: Callable[[torch.nn.Parameter], bool],
                    what: str) -> None:
    """Progressive unfreezing: a parameter frozen when offload() ran has no block and no Adam state, so a gradient
    on it would never be applied (plain AdamW over all the parameters trains it from then on). Raise, naming the
    parameters for which ``unfrozen`` holds, before anything of the step ran."""
    names = [name for name, p in frozen if unfrozen(p)]
    if names:
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        raise ValueError(
            f"{shown} {what} but {'was' if len(names) == 1 else 'were'} frozen (requires_grad=False) when offload() "
            "ran, so tierstore has no optimizer state for it and would never update it. Unfreeze every parameter "
            "that will train before offload() (freeze it again with requires_grad_(False) until its turn: an "
            "offloaded parameter without a gradient is not updated), or keep it frozen")
