"""Gradient norms and clipping of the pending step, for tierstore's own clipping and for the user's loop.

A block's gradient is taken off its parameters as soon as its backward completes (copied to host then, or,
when updates wait for the commit, possibly held on the device until it: ``runtime.engine.held_grads``), so after
``backward()`` a plain ``p.grad`` would be gone. When updates wait for the step to commit
(``optimizer.grad_clip`` set, fp16 loss scaling, or ``optimizer.user_grad_clip: true``), each parameter's
gradient norm is taken on the device at that moment, and ``p.grad`` returns an ``OffloadedGrad``: a tensor with the gradient's
shape, dtype and device and no storage. The calls ``torch.nn.utils.clip_grad_norm_`` makes on it act on
the offloaded gradient exactly: its norm is the stored one, and ``mul_`` by the clip coefficient scales the
gradient before the update (applied at ``optimizer.step()``). Any other use raises an error that says what
to call instead. With streaming updates (they start as gradients land) a norm or a scale asked for after
backward raises, naming the config keys that make it exact.

What it leaves out: when updates are submitted (``runtime.engine.controller``), the per-block Adam
(``runtime.update.worker``, ``runtime.update.adam``).
"""

from __future__ import annotations

import logging
from typing import Any, cast

import torch

from runtime.core.blocks import Block
from runtime.engine.kept_grads import KeptGrads
from runtime.engine.step_phase import StepPhase
from runtime.engine.step_view import HostSumAccess, StepView
from runtime.engine.torch_calls import DATA_GET, DATA_SET, GRAD_FN_GET, GRAD_GET, moves_nowhere, tensor_getter

log = logging.getLogger(__name__)

_NORM_CALLS = frozenset({torch.linalg.vector_norm, torch.norm, torch.Tensor.norm, torch.linalg.norm})
_SCALE_CALLS = frozenset({torch.Tensor.mul_, torch.Tensor.__imul__})
# What stands for the same gradient (``p.grad.data.norm(2)``, a logging idiom): the stand-in itself, served as p.grad is.
_SAME_GRAD = frozenset({DATA_GET, torch.Tensor.detach})
# What a gradient summed in host memory serves between micro-batches (GradClipper._host_sum_call): norms and scaling.
_HOST_SUM_SERVED = _NORM_CALLS | _SCALE_CALLS | {torch._foreach_norm, torch._foreach_mul_}
_GRAD_METADATA = frozenset({*(tensor_getter(name) for name in ("shape", "dtype", "device", "ndim", "is_cuda", "requires_grad",
                                                                 "layout", "is_sparse")),
                            torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel,
                            torch.Tensor.requires_grad_, torch.Tensor.is_floating_point,
                            torch.Tensor.element_size, torch.Tensor.__len__})


def _whole_two_norm_shape(func: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, ...]:
    """Refuse a norm of an offloaded gradient other than its whole 2-norm (the one that is known); returns the
    norm's shape (``keepdim``). ``torch.norm`` and ``Tensor.norm`` take a number as a vector norm over ``dim``, as
    ``vector_norm`` does; ``torch.linalg.norm`` takes one over two dimensions as a matrix norm (``ord=2``: the
    spectral norm), and ``'fro'`` as the Frobenius norm, which is the whole 2-norm."""
    if func is torch._foreach_norm:
        order = kwargs.get("ord", args[1] if len(args) > 1 else 2.0)
        if order not in (2, 2.0):
            raise RuntimeError(f"{name}: only the 2-norm of an offloaded gradient is known (asked: {order})")
        return ()
    order = kwargs.get("ord", kwargs.get("p", args[1] if len(args) > 1 else None))
    dim = kwargs.get("dim", args[2] if len(args) > 2 else None)
    keepdim = kwargs.get("keepdim", args[3] if len(args) > 3 else False)
    if order not in (2, 2.0, "fro", None):
        raise RuntimeError(f"{name}: only the 2-norm of an offloaded gradient is known (asked: {order})")
    with torch._C.DisableTorchFunctionSubclass():
        ndim = args[0].dim()
    dims = range(ndim) if dim is None else [dim] if isinstance(dim, int) else list(dim)
    if dim is not None and (ndim == 0 or sorted(d % ndim for d in dims) != list(range(ndim))):
        raise RuntimeError(f"{name} over dim={dim!r} of an offloaded gradient of {ndim} dimensions: only the 2-norm of "
                           "the whole gradient is known (dim=None, or every dimension)")
    if func is torch.linalg.norm and order is not None and dim is None and ndim > 2:
        raise RuntimeError(f"torch.linalg.norm(g, {order!r}) of an offloaded gradient of {ndim} dimensions with no dim: "
                           "torch refuses it (an ord needs a 1-D or 2-D input); its whole 2-norm is "
                           "torch.linalg.vector_norm(g) or g.norm()")
    if func is torch.linalg.norm and order is not None and (len(dims) == 2) != (order == "fro"):
        what = "the spectral norm (a matrix norm)" if len(dims) == 2 else f"a matrix norm of {len(dims)} dimensions"
        raise RuntimeError(f"torch.linalg.norm(g, {order!r}) of an offloaded gradient of {len(dims)} dimensions asks "
                           f"for {what}, which is not known: only its whole 2-norm is (torch.linalg.vector_norm(g), "
                           "g.norm(), torch.linalg.norm(g))")
    return (1,) * ndim if keepdim else ()


def _module_apply_call(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], grad: OffloadedGrad) -> tuple[bool, Any]:
    """What ``Module._apply`` (``model.to(device)``, ``.cpu()``, ``.cuda()``, ``share_memory()``) does to a parameter's
    ``.grad`` where it moves nothing: served as the no-op it is, as the parameter's own call is (it crashed
    ``model.to()`` between steps once ``p.grad`` stood for a gradient there). Returns (served, result)."""
    with torch._C.DisableTorchFunctionSubclass():
        if moves_nowhere(func, args, kwargs) or func == torch.Tensor.share_memory_:
            return True, args[0]
        if func is torch._has_compatible_shallow_copy_type:
            return True, func(*args, **kwargs)
    if func == DATA_SET and isinstance(args[1], OffloadedGrad) and args[1].slot == grad.slot:
        return True, None  # grad.data = the stand-in it already is
    return False, None


def real_grad(param: torch.Tensor) -> torch.Tensor | None:
    """``param.grad`` as torch holds it, not what the parameter guard shows the user (a stand-in of a gradient that
    left the device, or of one plain PyTorch would still hold between steps)."""
    with torch._C.DisableTorchFunctionSubclass():
        return GRAD_GET(param)


class OffloadedGrad(torch.Tensor):
    """Stands for a parameter's gradient that already left the device for the pending step (no storage)."""

    clipper: GradClipper
    slot: tuple[int, int]  # (block index, position in the block)
    step: int  # the optimizer step it stands for a gradient of (the controller's count of committed steps then)
    spent: bool

    @staticmethod
    def __new__(cls, like: torch.Tensor, clipper: GradClipper, slot: tuple[int, int]) -> OffloadedGrad:
        grad = torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype, device=like.device)
        grad.clipper = clipper
        grad.slot = slot
        grad.step = clipper.view.optimizer_step
        grad.spent = False  # True: made between steps, for a gradient its step's update used (GradClipper.grad_of)
        return grad

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        grads = [a for a in _flat(args) if isinstance(a, OffloadedGrad)]
        return grads[0].clipper.grad_call(func, args, kwargs, grads)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple[Any, ...] = (),  # type: ignore[override]
                           kwargs: dict[str, Any] | None = None) -> Any:
        raise RuntimeError(f"{func} reached an offloaded gradient's storage, which lives off the device")


def _flat(args: tuple[Any, ...]) -> list[Any]:
    out: list[Any] = []
    for arg in args:
        out.extend(arg) if isinstance(arg, (list, tuple)) else out.append(arg)
    return out


class GradClipper:
    """Per-parameter gradient norms and user scale factors of the step in progress."""

    def __init__(self, view: StepView, blocks: list[Block], param_slot: dict[int, tuple[int, int]], kept_grads: KeptGrads,
                 sums: HostSumAccess):
        self.view = view
        self.blocks = blocks
        self.param_slot = param_slot  # id(parameter) -> (block index, position)
        self.kept_grads = kept_grads  # which parameters plain PyTorch would hold a .grad for (runtime.engine.kept_grads)
        self.sums = sums  # gradients summed in host memory between micro-batches
        self._norms: dict[tuple[int, int], torch.Tensor] = {}  # slot -> its gradient's 2-norm (device, fp32)
        self._scales: dict[tuple[int, int], torch.Tensor] = {}  # slot -> product of the user's scale factors
        self._proxies: dict[tuple[int, int], OffloadedGrad | None] = {}  # slots whose gradient left the device
        self._dropped: set[tuple[int, int]] = set()  # slots the user set p.grad = None for after backward
        self._last_norm: torch.Tensor | None = None  # the last committed step's global norm (read lazily: no sync)
        self._shared = False  # several processes: _norms holds every rank's norms of the step (share_across_ranks)

    # ---- filled by the controller during backward -----------------------------------------------------
    def record(self, block: Block, has_grad: list[bool], norms: list[torch.Tensor] | None) -> None:
        """Block's gradients left the device; ``norms`` (one per parameter that had a gradient) when updates
        wait for the commit."""
        present = [position for position, has in enumerate(has_grad) if has]
        for n, position in enumerate(present):
            slot = (block.index, position)
            if norms is not None:
                self._norms[slot] = norms[n]
            self._proxies[slot] = None  # made when the user reads p.grad (most steps nobody does)

    def reset(self) -> None:
        """Forget the pending step (committed or discarded)."""
        self._norms, self._scales, self._proxies, self._dropped = {}, {}, {}, set()
        self._shared = False

    def share_across_ranks(self) -> None:
        """Several processes whose loop clips (``optimizer.user_grad_clip``), at the step's last backward end: every
        rank learns each parameter's gradient norm (its owner's, of the gradient reduced there) and whether any rank
        gave it a gradient, so ``p.grad`` of a block another rank owns is a stand-in there too and the loop's
        ``clip_grad_norm_`` computes the same norm and factor on every rank, as under DDP (where every rank holds the
        averaged ``.grad``). One call per step, every rank at the same point ([Note: collectives in program order]).
        The norms travel as they are (each is the sum of one owner's value and zeros: exact), the factors the loop
        applies to another rank's blocks are kept and not used (their owner applies its own, the same)."""
        ranks = self.view.options.ranks
        if ranks is None or not self.view.options.hold_updates:
            return
        slots = [(block.index, position) for block in self.blocks for position in range(len(block.slots))]
        own = [self._norms.get(slot) for slot in slots]
        shared = torch.zeros(2 * len(slots), dtype=torch.float32, device=ranks.device)
        present = [n for n, norm in enumerate(own) if norm is not None]
        if present:
            where = torch.tensor(present, device=ranks.device)
            shared[where] = torch.stack([cast(torch.Tensor, own[n]) for n in present]).to(ranks.device, torch.float32)
            shared[where + len(slots)] = 1.0
        ranks.sum(shared)
        norms, anywhere = shared[: len(slots)], (shared[len(slots):] > 0).tolist()
        for n, slot in enumerate(slots):
            if anywhere[n] and slot not in self._norms:
                self._norms[slot] = norms[n]
                self._proxies[slot] = None
        self._shared = True

    # ---- the user's side ------------------------------------------------------------------------------
    def grad_of(self, param: torch.Tensor) -> torch.Tensor | None:
        """``param.grad`` as the user sees it: the real one, or the stand-in of one that left the device."""
        slot = self.param_slot.get(id(param))
        if slot is None or slot not in self._proxies:
            grad = GRAD_GET(param)
            if grad is None and slot is not None and self.sums.host_sum_holds(slot):
                return OffloadedGrad(param, self, slot)  # between micro-batches, summed in host memory
            if grad is None and slot is not None and self._spent_held(slot):
                spent = OffloadedGrad(param, self, slot)  # between steps, what plain PyTorch's .grad still holds
                spent.spent = True
                return spent
            return grad
        proxy = self._proxies[slot]
        if proxy is None:
            proxy = self._proxies[slot] = OffloadedGrad(param, self, slot)
        return proxy

    def on_grad_set(self, param: torch.Tensor, value: torch.Tensor | None) -> None:
        """``param.grad = value`` after backward (``model.zero_grad()``): None drops the parameter from the pending
        update, as plain PyTorch skips a parameter without gradient; with streaming updates, which already ran,
        it raises. Assigning a gradient there raises, and so does assigning one after the step's last backward to a
        parameter that backward gave none (it would never be applied). Between steps an assigned gradient is what
        the next ``step()`` applies (``Controller._step_from_assigned_grads``). A stand-in is refused: it holds no
        values (``model.to()`` assigns one under torch's ``overwrite_module_params_on_conversion``)."""
        if isinstance(value, OffloadedGrad):
            raise RuntimeError(f"p.grad = the gradient stand-in of {self._name(value)}: it holds no values to assign "
                               "(model.to() does this under torch.__future__.set_overwrite_module_params_on_conversion"
                               "(True): call zero_grad() first)")
        slot = self.param_slot.get(id(param))
        if slot is not None and value is None:  # plain PyTorch holds no .grad tensor for it now (runtime.engine.kept_grads)
            self.kept_grads.drop(*slot)
        if slot is not None and slot not in self._proxies:
            # Between micro-batches: what the step summed on the host so far goes, as the plain .grad would.
            self.sums.drop_host_sum(slot)
        ready = self.view.phase is StepPhase.READY
        if slot is None or (slot not in self._proxies and not (ready and value is not None)):
            return
        name = self.blocks[slot[0]].slots[slot[1]].name
        if value is not None and slot not in self._proxies:
            # No gradient in the step's last backward: its block's update was decided without one, so a gradient
            # assigned now would silently never be applied.
            raise RuntimeError(f"{name}: a gradient can't be assigned after the step's last backward, before "
                               "optimizer.step(): its block's update was decided without one. Assign gradients "
                               "by hand between steps (after optimizer.step() or zero_grad()), with no backward before "
                               "the step() that applies them")
        if value is not None:
            raise RuntimeError(f"{name}: its gradient of this step already left the device; a gradient can't be "
                               "assigned before optimizer.step()")
        if slot not in self._norms:  # streaming: the update ran as the gradient landed
            raise RuntimeError(f"{name}: dropping a gradient after backward (p.grad = None, model.zero_grad()) can't undo "
                               "its update, which started as the gradient landed. Call optimizer.zero_grad() to drop "
                               "the whole step, or set optimizer.user_grad_clip: true so that updates wait for "
                               "optimizer.step()")
        del self._proxies[slot]
        del self._norms[slot]
        self._scales.pop(slot, None)
        self._dropped.add(slot)

    def kept(self, block: Block, has_grad: list[bool]) -> list[bool]:
        """has_grad without the parameters whose gradient the user dropped after backward."""
        return [has and (block.index, position) not in self._dropped for position, has in enumerate(has_grad)]

    def grad_call(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], grads: list[OffloadedGrad]) -> Any:
        """A torch call on offloaded gradients: norms and scaling are served, everything else refused."""
        with torch._C.DisableTorchFunctionSubclass():
            if func in _GRAD_METADATA:
                return func(*args, **kwargs)
        if func in _SAME_GRAD:
            return args[0]
        name = getattr(func, "__name__", str(func))
        if name in ("__repr__", "__str__", "__format__"):  # print(p.grad) while debugging: say what it is
            return (f"OffloadedGrad(the gradient of {self._name(grads[0])}, shape {tuple(grads[0].shape)}, "
                    f"{grads[0].dtype}: it left the device for its step's update)")
        carried, value = _module_apply_call(func, args, kwargs, grads[0])
        if carried:
            return value
        spent = [g for g in grads if g.spent or (g.slot not in self._proxies and not self.sums.host_sum_holds(g.slot))]
        if spent:  # between steps: a gradient its step's update used (or a stand-in of one, kept since)
            return self._spent_call(func, name, args, spent[0])
        if grads[0].slot not in self._proxies:  # between micro-batches: the gradient is a sum in host memory
            return self._host_sum_call(func, name, args, kwargs, grads[0])
        if func is torch._foreach_norm or func in _NORM_CALLS:
            shape = _whole_two_norm_shape(func, name, args, kwargs)
            # In the gradient's dtype as torch gives it for bf16 .grad, but fp16's (loss scaling) holds no norm above
            # 65,504: an inf there clipped the whole step to zero. Its reference is the fp32 master gradient's norm.
            asked = kwargs.get("dtype", next((a for a in args[4:] if isinstance(a, torch.dtype)), None))
            norms = [self._norm(g).to(asked or (torch.float32 if g.dtype == torch.float16 else g.dtype)) for g in grads]
            return norms if func is torch._foreach_norm else norms[0].reshape(shape)
        if func is torch._foreach_mul_ or func in _SCALE_CALLS:
            factor = args[1]
            for g in grads:
                self._scale(g, factor, name)
            return args[0]
        if "unscale" in name:  # torch.amp.GradScaler.unscale_ / step in the loop
            raise RuntimeError(
                f"torch.amp.GradScaler in your loop ({name} on the gradient of {self._name(grads[0])}): tierstore "
                "scales the loss itself. With dtype: fp16 call optimizer.scale_loss(loss).backward() and "
                "optimizer.step() (overflowing steps are skipped, the scale backs off, as GradScaler does); bf16 "
                "needs no scaler: under the HF Trainer, whose fp16=True runs GradScaler, train with bf16=True")
        raise RuntimeError(
            f"{name} on the gradient of {self._name(grads[0])}: that gradient already left the device for the "
            "pending step. Its 2-norm and a multiply by one number (clip_grad_norm_) work, not other reads or "
            "changes (clip_grad_value_, a norm other than 2); for the last step's global norm read "
            "optimizer.last_grad_norm")

    def _spent_held(self, slot: tuple[int, int]) -> bool:
        """Between steps, plain PyTorch's ``.grad`` of this parameter would still hold a tensor: the last step's
        gradient (used by its update, no copy kept) or zeros (``zero_grad(set_to_none=False)``)."""
        return self.view.phase is StepPhase.IDLE and self.kept_grads.holds(*slot)

    def _spent_call(self, func: Any, name: str, args: tuple[Any, ...], grad: OffloadedGrad) -> Any:
        """A call on ``p.grad`` between steps, where plain PyTorch still holds a tensor: what ``model.zero_grad()``
        does to it (``p.grad = None`` reaches ``on_grad_set``; with ``set_to_none=False``: ``grad_fn``,
        ``detach_``, ``zero_``, which keeps it as a zero gradient) is served; reading its values is refused, saying
        where they went. A stand-in kept from a step that has ended since is refused too."""
        if func == GRAD_FN_GET:
            return None
        if func == torch.Tensor.detach_:
            return args[0]
        current = self._spent_held(grad.slot) and grad.step == self.view.optimizer_step
        if func == torch.Tensor.zero_ and current:
            self.kept_grads.zero_slot(*grad.slot)
            return args[0]
        if not current:
            raise RuntimeError(f"{name} on a p.grad of {self._name(grad)} kept from a step that has ended: read p.grad "
                               "again")
        raise RuntimeError(
            f"{name} on p.grad of {self._name(grad)} between steps: plain PyTorch's .grad still holds the last step's "
            "gradient (or the zeros of zero_grad(set_to_none=False)); tierstore used it for that step's update and "
            "keeps no copy. Read gradients between backward and optimizer.step() (optimizer.last_grad_norm holds the "
            "last step's global norm); zero_grad() or p.grad = None clears it")

    def _host_sum_call(self, func: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                       grad: OffloadedGrad) -> Any:
        """A call on a gradient summed in host memory between micro-batches: what ``model.zero_grad()`` does to it
        (with ``set_to_none=False``: ``grad_fn``, ``detach_``, ``zero_``) drops the sum so far, as plain PyTorch
        zeroes its ``.grad``; its 2-norm is the host sum's and a multiply by one number scales the host sum
        (``clip_grad_norm_`` before ``optimizer.step()`` ends a step early: the HF Trainer's last step of an
        epoch the accumulation does not divide); in a list, the gradients still on the device (blocks updated
        there) are served as they are. Anything else raises."""
        if func == GRAD_FN_GET:
            return None
        if func == torch.Tensor.detach_:
            return args[0]
        if func == torch.Tensor.zero_ or func in _HOST_SUM_SERVED:
            stale = [g for g in _flat(args) if isinstance(g, OffloadedGrad)
                     and (g.step != self.view.optimizer_step or not self.sums.host_sum_holds(g.slot))]
            if stale:  # kept from a step that has ended: the host buffer is another step's now
                raise RuntimeError(f"{name} on a p.grad of {self._name(stale[0])} kept from a step that has ended: "
                                   "read p.grad again")
        if func == torch.Tensor.zero_:
            self.sums.drop_host_sum(grad.slot)
            return args[0]
        if func in _HOST_SUM_SERVED and self.view.options.loss_scale is not None:
            raise RuntimeError(f"{name} on the gradient of {self._name(grad)} between micro-batches: under fp16 loss "
                               "scaling its sum in host memory is still multiplied by the loss scale. Clip after the "
                               "step's last micro-batch, or let tierstore clip (optimizer.grad_clip)")
        if func is torch._foreach_norm or func in _NORM_CALLS:
            shape = _whole_two_norm_shape(func, name, args, kwargs)
            if func is not torch._foreach_norm:
                return self._host_sum_norm(grad).reshape(shape)
            with torch._C.DisableTorchFunctionSubclass():
                return [self._host_sum_norm(g) if isinstance(g, OffloadedGrad) else torch._foreach_norm([g])[0]
                        for g in args[0]]
        if func is torch._foreach_mul_ or func in _SCALE_CALLS:
            factor = args[1]
            if isinstance(factor, torch.Tensor) and factor.numel() != 1 or isinstance(factor, (list, tuple)):
                raise RuntimeError(f"{name}: a gradient summed in host memory between micro-batches can be multiplied "
                                   "only by one number (what clip_grad_norm_ does)")
            self._refuse_second_clip(grad, name)
            with torch._C.DisableTorchFunctionSubclass():
                for g in (args[0] if func is torch._foreach_mul_ else [args[0]]):
                    if isinstance(g, OffloadedGrad):
                        summed = self.sums.host_sum_of(g.slot)
                        summed.mul_(factor.to(summed.device) if isinstance(factor, torch.Tensor) else factor)
                    else:
                        g.mul_(factor)
            return args[0]
        raise RuntimeError(
            f"{name} on the gradient of {self._name(grad)}: between micro-batches it is summed in host memory "
            "(optimizer.accumulate_on: host), not on the device. Its norm and clip_grad_norm_ work; "
            "model.zero_grad() drops it; to read .grad on the device between micro-batches set "
            "optimizer.accumulate_on: gpu")

    def _host_sum_norm(self, grad: OffloadedGrad) -> torch.Tensor:
        """The 2-norm of a gradient summed in host memory so far, computed there (as ``torch._foreach_norm``
        computes a ``.grad``'s), in the gradient's dtype on its device."""
        with torch._C.DisableTorchFunctionSubclass():
            norm = torch._foreach_norm([self.sums.host_sum_of(grad.slot)])[0]
            return norm.to(device=grad.device, dtype=grad.dtype)

    def _norm(self, grad: OffloadedGrad) -> torch.Tensor:
        if grad.slot not in self._norms:
            raise RuntimeError(self._streaming_message(grad))
        return self._norm_of(grad.slot)

    def _refuse_second_clip(self, grad: OffloadedGrad, call: str) -> None:
        """The loop multiplies a gradient (its clip, or by hand) while tierstore clips too (``optimizer.grad_clip``):
        a loop's clip would clip each step twice, which plain PyTorch does not do (tierstore's 1.0 where the loop
        clipped at 5.0), so any multiply is refused there."""
        threshold = self.view.options.grad_clip
        if threshold is not None:
            raise RuntimeError(
                f"{call} on the gradient of {self._name(grad)}: your loop multiplies gradients after backward (as "
                f"clip_grad_norm_ does) and tierstore clips the step itself (optimizer.grad_clip: {threshold}); with a "
                "clip in your loop the step would be clipped twice, unlike plain PyTorch, so a multiply is refused "
                "there. "
                + ("Set optimizer.grad_clip: null (or leave it out) to multiply or clip in your loop only"
                   if self.view.options.hold_updates else
                   "Set optimizer.user_grad_clip: true (tierstore's own clip is then off) to multiply or clip in your "
                   "loop")
                + ", or drop the loop's multiply and keep optimizer.grad_clip")

    def _scale(self, grad: OffloadedGrad, factor: Any, call: str) -> None:
        if grad.slot not in self._norms:
            raise RuntimeError(self._streaming_message(grad))
        self._refuse_second_clip(grad, call)
        factor = factor if isinstance(factor, torch.Tensor) else torch.tensor(float(factor))
        if factor.numel() != 1:  # the stored norm scales by one number; an elementwise factor would change it unknowably
            raise RuntimeError(
                f"{self._name(grad)}: its gradient already left the device for the pending step and can be multiplied "
                f"only by one number (what clip_grad_norm_ does), not by a tensor of {factor.numel()} elements; a "
                "factor on the loss reaches every gradient before it leaves")
        factor = factor.reshape(())  # one number, whatever its shape: the stored factors are stacked with others
        previous = self._scales.get(grad.slot)
        self._scales[grad.slot] = factor.detach() if previous is None else previous * factor.to(previous.device)

    def _proxy(self, block_index: int, position: int) -> OffloadedGrad:
        """The stand-in of a parameter whose gradient left the device (``grad_of`` makes it at the first read)."""
        return cast(OffloadedGrad, self.grad_of(self.blocks[block_index].slots[position].param))

    def _name(self, grad: OffloadedGrad) -> str:
        return self.blocks[grad.slot[0]].slots[grad.slot[1]].name

    def _streaming_message(self, grad: OffloadedGrad) -> str:
        return (f"the gradient of {self._name(grad)} left the device and its update has already started (updates "
                "start as gradients land). To clip in your own loop (torch.nn.utils.clip_grad_norm_, HF Trainer's "
                "max_grad_norm) set optimizer.user_grad_clip: true in the config: updates then wait for "
                "optimizer.step() and the clip is exact. Or let tierstore clip, overlapped: optimizer.grad_clip: "
                "<max_norm>")

    # ---- read by the controller at the commit ---------------------------------------------------------
    def total_norm(self, scaled: bool = True) -> torch.Tensor | None:
        """The global 2-norm of the pending step's gradients, after the user's scaling or as backward left them
        (None: no norms were taken)."""
        ranks = None if self._shared else self.view.options.ranks  # shared: _norms holds every rank's already
        if not self._norms and ranks is None:
            return None
        norms = [self._norm_of(slot, scaled) for slot in sorted(self._norms)]
        if ranks is None:
            return torch.linalg.vector_norm(torch.stack(norms), 2.0)
        # Several processes: each owner has its blocks' norms; the squares' sum goes round every rank, so the clip
        # factor is the same everywhere ([Note: collectives in program order]: every rank commits, in step).
        squares = torch.stack(norms).square().sum() if norms else torch.zeros(())
        total = squares.to(ranks.device, torch.float32).reshape(1)
        ranks.sum(total)
        return total.sqrt()[0]

    def commit(self) -> torch.Tensor | None:
        """At the commit: keep the step's global norm as backward left it (``last_grad_norm``) and return the
        norm after the user's scaling, which tierstore's own clip acts on (None: no norms were taken)."""
        total = self.total_norm()
        if total is not None:
            self._last_norm = self.total_norm(scaled=False) if self._scales else total
        return total

    @property
    def last_grad_norm(self) -> float | None:
        """The global gradient norm of the last committed step, before any clip (None: none was taken)."""
        return None if self._last_norm is None else float(self._last_norm)

    def _norm_of(self, slot: tuple[int, int], scaled: bool = True) -> torch.Tensor:
        scale = self._scales.get(slot) if scaled else None
        norm = self._norms[slot]
        return norm if scale is None else norm * scale.to(norm.device)

    def user_scales(self, block: Block) -> list[torch.Tensor | None] | None:
        """The user's scale factor of each of block's parameters (None: none scaled)."""
        scales = [self._scales.get((block.index, position)) for position in range(len(block.slots))]
        return scales if any(s is not None for s in scales) else None

    def clip(self, max_norm: float) -> torch.Tensor:
        """``optimizer.clip_grad_norm_``: scale every pending gradient as torch.nn.utils.clip_grad_norm_ would;
        returns the total norm before clipping. Between micro-batches (a step about to end early: the gradients
        summed so far) it is torch's clip over the offloaded parameters, served from the sums."""
        if self.view.phase is StepPhase.ACCUMULATING:
            params = [slot.param for block in self.blocks for slot in block.slots]
            return torch.nn.utils.clip_grad_norm_(params, max_norm)
        if not self._norms:
            if self._proxies:
                block_index, position = next(iter(self._proxies))
                raise RuntimeError(self._streaming_message(self._proxy(block_index, position)))
            raise RuntimeError("optimizer.clip_grad_norm_ needs a backward first: no gradient of this step left the device yet")
        total = self.total_norm()
        assert total is not None  # _norms is not empty
        coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
        for block_index, position in list(self._norms):
            self._scale(self._proxy(block_index, position), coef, "optimizer.clip_grad_norm_")
        return total


