"""``offload(model, config)``: the one call that turns an ordinary nn.Module into an offloaded one."""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import os
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from runtime.config.loader import ConfigError, TierstoreConfig, load_config
from runtime.config.schema import clip_threshold, consistency_problems
from runtime.config.units import approx_size
from runtime.core.blocks import Block, build_blocks
from runtime.core.signals import defers_interrupts, handle_signals
from runtime.engine.controller import Controller, RuntimeOptions
from runtime.model.hooks import HookSet, StateDictHooks
from runtime.model.materialize import ParamInit, block_filler, initialize, materialize_meta_parameters
from runtime.model.optimizer import OffloadAdamW, check_param_groups, param_groups_of
from runtime.model.param_guard import ParamGuard, is_offloaded
from runtime.model.recompute import BufferWatch, ForwardTimer, Recompute, already_checkpointed, recompute_refusal
from runtime.model.state_access import StateAccess
from runtime.planning.auto_placement import (
    STATE_ITEMSIZE,
    Placement,
    PlacementInputs,
    Rates,
    choose_placement,
    gpu_streamed_blocks,
    gpu_updated_blocks,
    measure_rates,
)
from runtime.planning.hostmem import host_memory
from runtime.planning.measured_placement import FIRST_STEP_NOTE, TRIAL_NOTE, FirstStepPlacement, RecomputeTrial, first_step_listener
from runtime.planning.memory_plan import (
    Budgets,
    MemoryPlan,
    WeightSource,
    check_fits,
    gpu_budget_nbytes,
    make_plan,
    planned_ram_nbytes,
    spill_moments,
    spill_order,
)
from runtime.planning.oom_hint import install_oom_hint, reserve_hint
from runtime.planning.peak_hint import PeakHint, cuda_peak, cuda_reserved_by_stream, cuda_step_peak
from runtime.update.adam import AdamWHyper
from tierstore import StoreConfig, TierName, TierStore

log = logging.getLogger(__name__)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class OffloadSession:
    """Everything ``offload`` built, for the caller that wants to inspect, save or shut it down.

    Usable as a context manager: ``with optimizer.session: ...`` closes it on the way out."""

    config: TierstoreConfig
    blocks: list[Block]
    store: TierStore
    controller: Controller
    hooks: HookSet
    plan: MemoryPlan
    model: nn.Module
    access: StateAccess
    guard: ParamGuard
    state_dict_hooks: StateDictHooks
    optimizer: Any = None  # the OffloadAdamW this session serves (set by offload)
    placement: Placement | None = None  # the resolved placement knobs and the activation reserve (set by offload)
    recompute: Recompute | None = None  # the layers' recomputation (placement.activations; set by offload)
    closed: bool = False
    on_close: list[Callable[[], None]] = field(default_factory=list, repr=False)  # run by close(), last

    @property
    def activations_recomputed(self) -> bool:
        """The layers' forwards are recomputed in the backward now (placement.activations: recompute, or auto's
        choice)."""
        return self.recompute is not None and self.recompute.on

    def __enter__(self) -> OffloadSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @defers_interrupts
    def master_state_dict(self) -> dict[str, torch.Tensor]:
        """The fp32 master weights by parameter name (CPU tensors), after every committed update."""
        return self.access.slot_values("master")

    @defers_interrupts
    def weights_of(self, block: Block, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Block's current weights by parameter name: CPU tensors cast from the fp32 master to ``dtype`` (default:
        the parameters' compute dtype)."""
        self.access.settle(read_only=True)
        dtype = dtype or self.controller.options.compute_dtype
        return self.access.block_values(block, "master", {slot.name: dtype for slot in block.slots})

    def save_pretrained(self, directory: str | os.PathLike[str], *, max_shard_nbytes: int = 5 << 30) -> None:
        """Save the current weights as HF-style sharded safetensors (``from_pretrained`` reads them), one shard
        of blocks in host memory at a time: the way to save a model too large for ``model.state_dict()``."""
        from runtime.integrations.safetensors_export import save_sharded  # optional dependency: safetensors

        save_sharded(self, directory, max_shard_nbytes=max_shard_nbytes)

    @defers_interrupts
    def close(self) -> None:
        """Finish updates, free every tier and delete swap files. The model becomes a plain module again: its
        parameters hold the trained weights on the CPU in their original dtype (from the fp32 masters). Where
        they do not fit in host memory (or can't be read) they are left on the meta device, with a warning: save
        them first (``session.save_pretrained(DIR)`` writes them a shard at a time). After the optimizer worker failed,
        each block's master is handed back as its last finished update left it, and a warning names the parameters
        not at the last committed step (or not given back) and why; then close() raises the worker's failure."""
        if self.closed:
            return
        values: dict[str, torch.Tensor] | None = None
        failure: BaseException | None = None
        dtypes = {s.name: s.dtype for b in self.blocks for s in b.slots}
        try:
            if self.controller.step_pending:
                self.controller.discard_pending()
                if self.controller.interrupted is None:
                    log.warning("close(): a backward ran since the last optimizer.step(); that step is dropped")
            if self.controller.interrupted is not None:  # the user must not take them for the last step's weights
                log.error("close(): the weights handed back are not the last committed step's (training would "
                          "have refused to go on): %s", self.controller.interrupted)
            self.access.mixed_steps_allowed = True
            values = self.access.slot_values("master", dtypes)
        except MemoryError as exc:
            log.warning("close(): the trained weights do not fit in host memory, the parameters are left on the meta "
                        "device (%s)", exc)
        except BaseException as exc:  # re-raised once everything is given back
            failure = exc
            if self.controller.worker_error is not None:  # the masters it did not touch are intact: hand them back
                try:
                    values = self._salvage(dtypes)
                    # Raised still, once given back: the failure may be the last step's, which nothing else reports.
                    failure = RuntimeError(
                        "close(): the optimizer worker had failed; the parameters were given back as the warning "
                        f"above lists ({self.controller.worker_error!r})")
                    failure.__cause__ = self.controller.worker_error
                except Exception as error:  # then the worker's failure is raised, once the rest is given back
                    log.error("close(): handing back the masters after the optimizer worker failed failed too: %r", error)
        self.closed = True
        try:
            self.controller.close()
            self.hooks.remove()
            self.state_dict_hooks.remove()
            self.guard.remove()
            _replace_with_meta(self.model, self.blocks, keep=set(values or ()))
            for block in self.blocks:
                for slot in block.slots:
                    if values is not None and slot.name in values:
                        slot.param.data = values[slot.name]
            _move_rest(self.model, torch.device("cpu"))
            self.store.close()
        finally:  # also when giving something back failed: closed is set, a second close() returns at once
            for undo in self.on_close:  # e.g. the layers' own classes back, SIGTERM's handler back
                try:
                    undo()
                except Exception as error:  # one that fails must not keep the others from running
                    log.warning("close(): %r failed: %r", undo, error)
        # Hooks, guard classes and the worker refer to each other: collect the cycles now, so the pinned
        # arena and device memory are given back before the caller's next allocation, not at a later GC.
        gc.collect()
        if failure is not None:
            raise failure

    def _salvage(self, dtypes: dict[str, torch.dtype]) -> dict[str, torch.Tensor]:
        """close() after the optimizer worker failed: the masters that can be read (``StateAccess.salvage_masters``),
        with a warning that names each parameter not at the committed step or not given back, and why."""
        values, notes = self.access.salvage_masters(dtypes)
        lines = [f"  {name}: {why}" for name, why in notes.items()]
        log.warning("close(): the optimizer worker had failed (%r); %d of %d parameters are given back at step %d%s",
                    self.controller.worker_error, len(dtypes) - len(notes), len(dtypes), self.controller.optimizer_step,
                    "; the others:\n" + "\n".join(lines) if lines else "")
        return values


def _replace_with_meta(model: nn.Module, blocks: list[Block], keep: set[str] = frozenset()) -> None:  # type: ignore[assignment]
    """Give the model meta-device parameters in place of the offloaded ones (whose values could not be kept) but
    those named in ``keep``: a read then raises instead of touching freed memory. Tied parameters stay tied."""
    slots = {id(slot.param): slot for block in blocks for slot in block.slots if slot.name not in keep}
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            slot = slots.get(id(p)) if p is not None else None
            if slot is not None:
                if id(p) not in made:
                    made[id(p)] = nn.Parameter(torch.empty(slot.shape, dtype=slot.dtype, device="meta"),
                                               requires_grad=p.requires_grad)
                module._parameters[name] = made[id(p)]


def _give_back_parameters(blocks: list[Block], store: TierStore) -> None:
    """A refused offload: put back the values of the parameters already moved into the store (on the device and in
    the dtype each had), so the model is as it was; parameters not yet moved were never touched. One block
    at a time, each block's state unregistered once given back: a master staged from NVMe needs host room, and a
    setup that failed may have filled the host tier. A block that cannot be given back is logged, by name, and the
    others still are."""
    masters = {block.key("master") for block in blocks}
    for key in store.keys():  # the room the masters' staging needs
        if str(key) not in masters:
            _log_failure(functools.partial(store.unregister, key))
    for block in blocks:
        key = block.key("master")
        if not store.has(key):  # its parameters are released only once its state is registered
            continue
        if all(_holds_own_values(slot) for slot in block.slots):
            # Registered, but the failure came before its parameters were released: their own values (an fp64
            # one's are finer than the fp32 master).
            _log_failure(functools.partial(store.unregister, key))
            continue
        try:
            home = store.record(key).home
            tier = TierName.GPU if home is TierName.GPU else TierName.HOST
            store.fetch(key, tier).wait()
            flat = store.tensor(key, tier)
            for slot in block.slots:
                view = flat[slot.offset : slot.offset + slot.numel].view(slot.shape)
                slot.param.data = view.to(slot.device, slot.dtype, copy=True)
        except Exception as error:
            log.error("offload() failed, and giving back %s failed too: their values are lost (%r)",
                      ", ".join(slot.name for slot in block.slots), error)
        _log_failure(functools.partial(store.unregister, key))


def _holds_own_values(slot: Any) -> bool:
    """The parameter still holds the values it came with: not emptied at its block's registration, nor made a view
    of the compute weights' buffer (whose storage is empty until a fetch fills it)."""
    with torch._C.DisableTorchFunctionSubclass():
        param = slot.param
        needed = (param.storage_offset() + param.numel()) * param.element_size()
        return (param.numel() == slot.numel and param.dtype == slot.dtype and param.device == slot.device
                and param.untyped_storage().nbytes() >= needed)


def _undo_offload(blocks: list[Block], store: TierStore | None, steps: list[Callable[[], None]]) -> None:
    """A failed or interrupted ``offload()``: run each undo step (hooks and guard off, threads stopped, the layers'
    classes and signal handlers back), then give the parameters back and close the store (swap files deleted, the
    directory unlocked). Each step in its own try: one that fails is logged and the others still run, so the
    caller raises the setup's own error. A Ctrl-C during the undo (a second one, when the first interrupted the
    setup) is logged and the undo goes on; another one after it stops the undo."""
    if store is not None:
        steps = [*steps, functools.partial(_give_back_parameters, blocks, store), store.close]
    interrupted = False
    for step in steps:
        try:
            _log_failure(step)
        except KeyboardInterrupt:
            if interrupted:
                raise
            interrupted = True
            log.warning("offload() is undoing a failed setup: Ctrl-C again to stop that (the model may then hold "
                        "parameters with no values, and the swap directory stay locked until exit)")


def _log_failure(step: Callable[[], None]) -> None:
    """Run one step of a failed offload()'s undo; an error of its own is logged, not raised (the setup's is)."""
    try:
        step()
    except Exception as error:
        log.error("offload() failed, and undoing it failed too at %r: %r", step, error)


def _warn_of_other_dtypes(model: nn.Module, name: str, dtype: torch.dtype) -> None:
    """Say when trainable parameters are in a dtype the session does not train them in (silently, before): fp64
    ones get fp32 masters, and 16-bit ones other than the config's ``dtype`` compute in it (plain PyTorch trains
    each in its own dtype). fp32 parameters under a 16-bit ``dtype`` are the usual mixed precision: nothing to say."""
    other: dict[torch.dtype, list[str]] = {}
    for param_name, param in model.named_parameters():
        if param.requires_grad and param.dtype != dtype and (param.dtype == torch.float64 or param.element_size() == 2):
            other.setdefault(param.dtype, []).append(param_name)
    for found, names in other.items():
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        what = (f"they train with fp32 masters, computing in {name} (fewer bits than their own)" if found == torch.float64
                else f"they train in {name} (compute) with fp32 masters")
        log.warning("%d trainable parameter%s in %s (%s), the config's dtype is %s: %s, and close() gives them back in "
                    "%s. Set dtype to match the model, or convert the model before offload()", len(names),
                    "s are" if len(names) > 1 else " is", str(found).removeprefix("torch."), shown, name, what,
                    str(found).removeprefix("torch."))


def _tied_through_memory(model: nn.Module) -> tuple[str, str] | None:
    """The names (in the model's order) of two distinct parameters, one of them trainable, that share bytes
    (``b.weight.data = a.weight.data``), or None. One Parameter used twice is a tie tierstore keeps
    (``named_parameters`` yields it once); parameters over disjoint bytes of one buffer are each copied on their own,
    as offload copies every parameter. Compared by address, so two storages over the same memory count too."""
    spans = []  # (first byte, end byte, position, name, parameter)
    for position, (name, param) in enumerate(model.named_parameters()):
        if param.is_meta or param.numel() == 0:
            continue
        extent = sum((size - 1) * stride for size, stride in zip(param.shape, param.stride())) + 1
        spans.append((param.data_ptr(), param.data_ptr() + extent * param.element_size(), position, name, param))
    spans.sort(key=lambda span: span[0])
    for i, (_, end, position, name, param) in enumerate(spans):
        for start, _, other_position, other_name, other in spans[i + 1:]:
            if start >= end:  # sorted by first byte: no later one reaches back into this one
                break
            if (param.requires_grad or other.requires_grad) and _share_bytes(param, other):
                pair = sorted([(position, name), (other_position, other_name)])
                return pair[0][1], pair[1][1]
    return None


TIE_CHECK_NUMEL = 1 << 24  # elements past which two strided parameters with overlapping extents count as sharing


def _share_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors whose byte extents overlap have a byte in common: a contiguous tensor covers its whole
    extent; strided ones (interleaved views, ``buf[:, 0::2]`` beside ``buf[:, 1::2]``) are compared byte by byte, up to
    ``TIE_CHECK_NUMEL`` elements (larger ones are taken as sharing: refused, named, rather than split silently)."""
    if a.is_contiguous() and b.is_contiguous():
        return True
    if a.numel() > TIE_CHECK_NUMEL or b.numel() > TIE_CHECK_NUMEL:
        return True
    return bool(torch.isin(_byte_addresses(a), _byte_addresses(b)).any())


def _byte_addresses(tensor: torch.Tensor) -> torch.Tensor:
    """The address of every byte of ``tensor``'s elements (int64)."""
    offsets = torch.zeros((), dtype=torch.int64)
    for size, stride in zip(tensor.shape, tensor.stride()):
        offsets = offsets.unsqueeze(-1) + torch.arange(size, dtype=torch.int64) * stride
    first = tensor.data_ptr() + offsets.reshape(-1, 1) * tensor.element_size()
    return (first + torch.arange(tensor.element_size(), dtype=torch.int64)).reshape(-1)


def _move_rest(model: nn.Module, device: torch.device, offloaded: set[int] | None = None) -> None:
    """Move buffers and the parameters tierstore does not offload to device."""
    for module in model.modules():
        for name, buf in list(module._buffers.items()):
            if buf is not None:
                module._buffers[name] = buf.to(device)
        for name, p in list(module._parameters.items()):
            if p is not None and (offloaded is None or id(p) not in offloaded) and not p.is_meta:
                if offloaded is not None or p.device != device:
                    p.data = p.data.to(device)


def resolve_device(config: TierstoreConfig) -> torch.device:
    """The compute device the config asks for (auto: CUDA when available)."""
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: cuda, but CUDA is not available here; use device: auto or cpu")
    if config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def resolve_homes(config: TierstoreConfig, device: torch.device) -> tuple[dict[str, TierName], WeightSource]:
    """Home tier of each kind of state, and where compute weights are fetched from."""
    placement = config.placement
    nvme = config.tiers.nvme.path is not None

    def pick(value: str, kind: str) -> TierName:
        if value == "auto":
            return TierName.HOST
        if value == "gpu":
            raise ValueError(f"placement.{kind}: gpu is not supported for optimizer state yet; use host or nvme")
        if value == "nvme" and not nvme:
            raise ValueError(f"placement.{kind}: nvme needs tiers.nvme.path")
        return TierName(value)

    homes = {"master": pick(placement.master, "master"), "exp_avg": pick(placement.moments, "moments"),
             "exp_avg_sq": pick(placement.moments, "moments"), "grad": TierName.HOST}
    weights = placement.weights
    if weights == "gpu":
        source = WeightSource.RESIDENT
    elif weights == "nvme":
        raise ValueError("placement.weights: nvme is not supported yet; use host (bf16 weights in pinned memory) or gpu")
    elif homes["master"] is TierName.HOST:
        source = WeightSource.MASTER  # fetch the fp32 master itself and cast on the GPU: no extra host copy
    else:
        source = WeightSource.WEIGHTS
    homes["weights"] = TierName.HOST
    return homes, source


def offload(model: nn.Module, config: TierstoreConfig | Mapping[str, Any] | str | os.PathLike[str] | None = None,
            record_intervals: bool = False, init: ParamInit | None = None, *,
            param_groups: list[dict[str, Any]] | None = None) -> tuple[nn.Module, OffloadAdamW]:
    """Offload model's training state to the tiers the config describes.

    Returns the same model (hooked; its parameters now views into per-block buffers on the compute device)
    and an AdamW optimizer whose state lives in the store. The session (store, controller, plan) is
    ``optimizer.session``; call ``optimizer.session.close()`` when done.

    A model built under ``torch.device("meta")`` (one too large to exist on the host) needs ``init``: a
    function ``init(name, tensor)`` that fills one parameter in place; it is called block by block, just
    before the block is copied into the store.

    ``param_groups``: torch-style parameter groups (``[{"params": [...], "weight_decay": 0.0}, ...]``, parameters
    given as tensors or names) with their own lr / betas / eps / weight_decay; default: one group.
    The parameters stay ordinary to read and write between steps (``runtime.model.param_guard``), and
    ``state_dict()`` / ``load_state_dict()`` read and write the tiers.
    """
    if any(is_offloaded(p) for p in model.parameters()):  # a notebook cell run twice
        raise ValueError("this model is already offloaded: offload() ran on it and its session is open. Use the "
                         "optimizer that call returned, or close its session first (optimizer.session.close()) and "
                         "offload again")
    tied = _tied_through_memory(model)
    if tied is not None:
        first, second = tied
        raise ValueError(
            f"parameters {first} and {second} are two Parameter objects over the same memory (tied through .data): "
            "tierstore keeps and updates each parameter's own copy, so they would drift apart where plain PyTorch "
            f"updates the one memory with both. Tie them as one Parameter before offload() (model.{second} = "
            f"model.{first}), or give each its own memory (model.{second}.data = model.{second}.data.clone())")
    cfg = config if isinstance(config, TierstoreConfig) else load_config(config)
    for problem in consistency_problems(cfg)[:1]:  # a config built in code, not loaded, is checked here
        raise ConfigError(problem.message, problem.path, kind=problem.kind)
    device = resolve_device(cfg)
    dtype = DTYPES[cfg.dtype]
    if dtype is torch.float16 and device.type == "cpu":
        log.warning("fp16 compute on the CPU is slow; it is meant for tests")
    _warn_of_other_dtypes(model, cfg.dtype, dtype)
    has_meta = any(p.is_meta for p in model.parameters())
    if has_meta and init is None:
        raise ValueError("the model's parameters are on the meta device: pass init=fn, where fn(name, tensor) fills "
                         "one parameter in place (it runs block by block while the store is filled)")
    uninitialized = materialize_meta_parameters(model) if has_meta else set()
    if uninitialized and init is not None:  # frozen parameters are not offloaded: fill them here
        initialize([(n, p) for n, p in model.named_parameters() if id(p) in uninitialized and not p.requires_grad], init)
    blocks, resolved, budgets = plan_model(model, cfg, device)
    if cfg.placement.activations == "recompute":
        refusal = recompute_refusal(blocks, model)
        if refusal:
            raise ValueError(f"placement.activations: recompute cannot apply: {refusal}; set placement.activations: "
                             "keep")
    plan = resolved.plan
    log.info("%s", plan.table())
    # What is not offloaded (buffers, frozen parameters) simply lives on the compute device.
    _move_rest(model, device, {id(slot.param) for b in blocks for slot in b.slots})
    pin = None if cfg.tiers.host.pin == "auto" else bool(cfg.tiers.host.pin)
    direct = cfg.tiers.nvme.direct_io
    direct = {True: "on", False: "off"}.get(direct, direct)  # type: ignore[arg-type]
    if budgets.host_nbytes >= LONG_SETUP_NBYTES:  # pinning runs at about 2 GB/s: say so before a long silence
        log.info("%s %s of host memory for tierstore's tiers", "pinning" if device.type == "cuda" and pin is not False
                 else "reserving", approx_size(budgets.host_nbytes))
    offloaded = [slot.param for b in blocks for slot in b.slots]
    # Groups are checked before the parameters are bound to blocks: a refusal leaves the model as it was.
    groups = param_groups_of(model, param_groups, offloaded)
    check_param_groups(groups, blocks)
    store: TierStore | None = None
    session: OffloadSession | None = None
    undo: list[Callable[[], None]] = []  # what a failure from here on takes back, in the order it was done
    try:
        store = TierStore(StoreConfig(device=str(device), gpu_budget_nbytes=budgets.gpu_nbytes, host_budget_nbytes=budgets.host_nbytes,
                                      pin=pin if device.type == "cuda" else False, nvme_path=cfg.tiers.nvme.path,
                                      nvme_budget_nbytes=cfg.tiers.nvme.budget, io_threads=cfg.tiers.nvme.io_threads,
                                      io_block_nbytes=cfg.tiers.nvme.block_size, direct_io=str(direct)))
        options = _options(cfg, dtype, resolved, record_intervals)
        controller = Controller(model, blocks, store, options, fill_block=block_filler(init, uninitialized))
        undo.append(controller.close)
        access = StateAccess(controller, blocks, store, controller.weights, controller.worker, controller.writebacks,
                             controller.fetch.release)
        hooks = HookSet(model, blocks, controller)
        undo.append(hooks.remove)
        guard = ParamGuard(blocks, access, controller.clipper, controller, controller.param_block)
        undo.append(guard.remove)
        guard.install()
        state_dict_hooks = StateDictHooks(model, blocks, lambda block: session.weights_of(block),
                                          access.begin_batch, access.end_batch)
        undo.append(state_dict_hooks.remove)
        session = OffloadSession(cfg, blocks, store, controller, hooks, plan, model, access, guard, state_dict_hooks)
        offloaded_ids = {id(p) for p in offloaded}
        controller.frozen = [(n, p) for n, p in model.named_parameters() if id(p) not in offloaded_ids]
        optimizer = OffloadAdamW(groups, controller, access)
        optimizer.session = session  # type: ignore[attr-defined]
        session.optimizer = optimizer
        session.placement = resolved.placement
        if device.type == "cuda" and (resolved.measured_first_step or resolved.placement.activation_reserve_nbytes):
            install_oom_hint(session, _oom_hint)  # silent until auto placement has reserved something
        recompute = session.recompute = Recompute(blocks, model)
        session.on_close.append(recompute.undo)
        if cfg.placement.activations == "recompute":
            recompute.turn_on()
        if resolved.measured_first_step:
            peak, peak_what = cuda_step_peak(device)
            controller.step_listeners.append(FirstStepPlacement(
                plan_gpu_nbytes=plan.gpu_nbytes, budget_nbytes=store.tiers[TierName.GPU].capacity_nbytes,
                ask=placement_asker(session, may_stream=resolved.source is not WeightSource.WEIGHTS),
                adopt=functools.partial(_adopt_placement, weakref.ref(session)), peak=peak, peak_what=peak_what,
                reset_peak=functools.partial(_reset_peak, device),
                report=functools.partial(_note_in_plan, weakref.ref(session)), pools=cuda_reserved_by_stream(device),
                trial=_recompute_trial(cfg, blocks, recompute, controller, device)))
            # A session closed before the trial ended takes the timer's hooks off the layers too
            session.on_close.append(controller.step_listeners[-1].close)
        elif (resolved.placement.activation_reserve_nbytes and device.type == "cuda"
              and cfg.optimizer.gpu_update_fraction == "auto" and cfg.tiers.gpu.activation_reserve == "auto"):
            # after the first steps: would a lower reserve put more on the GPU?
            controller.step_listeners.append(PeakHint(placement_figures(session), blocks, placement_asker(session),
                                                      cuda_peak(device)))
        # SIGTERM ends training like Ctrl-C while the session is open. Without close(), the worker, the store and its
        # IO threads close themselves at exit (tierstore.close_at_exit): not the session, whose close() would copy
        # every weight back into the model first.
        session.on_close.append(handle_signals())
    except BaseException:  # the model as it was, the directory unlocked, no thread left; the error unchanged
        if session is not None:
            session.closed = True  # its listeners and close() then do nothing
        _undo_offload(blocks, store, [*reversed(undo), *(session.on_close if session is not None else [])])
        raise
    return model, optimizer


def placement_asker(session: OffloadSession, *, may_stream: bool = False) -> Callable[[int], Placement | None]:
    """``placement_at_reserve`` for this session, through a weak reference (the controller must not keep its
    session alive through a listener); None once the session is gone or closed (a profile saved after
    ``close()`` asks nothing of a closed store)."""
    alive = weakref.ref(session)

    def ask(reserve_nbytes: int) -> Placement | None:
        live = alive()
        return None if live is None or live.closed else placement_at_reserve(live, reserve_nbytes, may_stream=may_stream)

    return ask


def _adopt_placement(session_ref: Callable[[], OffloadSession | None], placement: Placement) -> None:
    """Make ``placement`` (auto placement asked again after the first step) the session's: the controller moves the
    state, and the session's placement and plan say what now runs."""
    session = session_ref()
    if session is None or session.closed:
        return
    session.controller.adopt_placement(placement.gpu_update_fraction, placement.gpu_stream_fraction,
                                       placement.keep_for_backward_nbytes, _spilled_after(session, placement))
    cfg, controller = session.config, session.controller
    plan = plan_for(session.blocks, cfg, controller.options.homes, controller.options.weight_source,
                    DTYPES[cfg.dtype], len(controller.options.spilled_blocks), spares=session.plan.pre_commit_buffers,
                    placement=placement)
    plan.notes = (FIRST_STEP_NOTE, *placement.notes)
    session.plan, session.placement = plan, placement


def _spilled_after(session: OffloadSession, placement: Placement) -> frozenset[int]:
    """The blocks whose moments stay on NVMe once ``placement`` is adopted: of those spilled now, the fewest (in
    ``spill_order``) for its plan to fit the pinned arena the session has; the host room of the blocks it moves to
    the GPU brings the others back. A session whose master lives on NVMe keeps its spill (the masters' staging
    room is taken from the same arena)."""
    options = session.controller.options
    if not options.spilled_blocks or options.homes["master"] is not TierName.HOST:
        return options.spilled_blocks
    cfg = session.config
    limit = session.store.tiers[TierName.HOST].capacity_nbytes
    target, _, _ = _spill(session.blocks, cfg, options.homes, options.weight_source, DTYPES[cfg.dtype], placement, limit)
    return options.spilled_blocks & target


def _recompute_trial(cfg: TierstoreConfig, blocks: list[Block], recompute: Recompute, controller: Controller,
                     device: torch.device) -> RecomputeTrial | None:
    """What ``placement.activations: auto`` lets the measured first step try (None: no trial; under ``auto`` the
    activations are then kept and the log says why, under ``recompute`` the layers already are)."""
    if cfg.placement.activations != "auto":
        return None
    refusal = recompute_refusal(blocks, recompute.model)
    if refusal:
        log.info("placement.activations auto: activations are kept (%s)", refusal)
        return None
    return RecomputeTrial(recompute, ForwardTimer(recompute.modules, device),
                          lambda: controller.recomputed_acquires > 0 or already_checkpointed(blocks, recompute.model),
                          BufferWatch(recompute.modules))


def may_try_recompute(cfg: TierstoreConfig, blocks: list[Block], model: nn.Module | None = None) -> bool:
    """``placement.activations: auto`` may try the layers recomputed: they can be, and the model (where given) does
    not checkpoint them itself."""
    return cfg.placement.activations == "auto" and recompute_refusal(blocks, model) is None


def _reset_peak(device: torch.device) -> None:
    """Empty the allocator's cache and reset the peak statistics: the reserved peak then counts what the steps
    hold, not blocks cached before them (a model built on the GPU, setup's staging)."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)


def _note_in_plan(session_ref: Callable[[], OffloadSession | None], line: str) -> None:
    """Add a line to the session's plan notes (what a benchmark or a profile prints of the plan)."""
    session = session_ref()
    if session is not None:
        session.plan.notes = (*(session.plan.notes or ()), line)


def _oom_hint(session: OffloadSession, requested: int, allocated: int) -> str | None:
    """``runtime.planning.oom_hint``'s line for this session's auto placement (None once the session is closed, or when
    nothing was placed by auto with a reserve)."""
    placement = session.placement
    if session.closed or session.store.closed or placement is None or not placement.activation_reserve_nbytes:
        return None
    controller = session.controller
    state = STATE_ITEMSIZE * sum(session.blocks[i].numel for i in controller.gpu_updated)
    return reserve_hint(requested_nbytes=requested, allocated_nbytes=allocated,
                        store_gpu_nbytes=session.store.tiers[TierName.GPU].used_nbytes,
                        reserve_nbytes=placement.activation_reserve_nbytes,
                        placed_nbytes=state + placement.keep_for_backward_nbytes,
                        recomputed=session.activations_recomputed)


def plan_for(blocks: list[Block], cfg: TierstoreConfig, homes: dict[str, TierName], source: WeightSource,
             dtype: torch.dtype, spilled: int = 0, spares: bool = False, *, placement: Placement) -> MemoryPlan:
    """The memory plan of these blocks under this config and resolved ``placement`` (nothing allocated);
    ``spilled``: how many of the last host-updated blocks keep their moments on NVMe, ``spares``: second state
    buffers for updates that run before the commit (see ``resolve_plan``)."""
    gpu_updated = gpu_updated_blocks(blocks, placement.gpu_update_fraction)
    streamed = len(gpu_streamed_blocks(blocks, placement.gpu_update_fraction, placement.gpu_stream_fraction))
    return _plan_of(blocks, cfg, homes, source, dtype, updated=gpu_updated, streamed=streamed, spilled=spilled,
                    spares=spares, host_sums=placement.host_sums)


def _plan_of(blocks: list[Block], cfg: TierstoreConfig, homes: dict[str, TierName], source: WeightSource,
             dtype: torch.dtype, *, updated: frozenset[int], streamed: int, spilled: int = 0,
             spares: bool = False, host_sums: bool = False) -> MemoryPlan:
    return make_plan([b.numel for b in blocks if b.index not in updated], {k: v.value for k, v in homes.items()},
                     source.value, torch.empty((), dtype=dtype).element_size(), cfg.prefetch.depth,
                     cfg.optimizer.accumulation_steps, gpu_updated_numels=[blocks[i].numel for i in sorted(updated)],
                     spilled=spilled, streamed=streamed, spares=spares, host_sums=host_sums,
                     grad_itemsize=host_grad_dtype(cfg, host_sums).itemsize)


LONG_SETUP_NBYTES = 8 << 30  # pinned memory from which setup takes long enough to report its progress


def sums_on_host(blocks: list[Block], cfg: TierstoreConfig, device: torch.device) -> bool:
    """``optimizer.accumulate_on`` resolved: True when the micro-batches' gradients are summed in host memory
    (``auto``: when the model's gradients in the compute dtype would take more than a quarter of the GPU budget)."""
    opt = cfg.optimizer
    if opt.accumulation_steps == 1 or opt.accumulate_on == "gpu":
        return False
    if opt.accumulate_on == "host":
        return True
    itemsize = torch.empty((), dtype=DTYPES[cfg.dtype]).element_size()
    return sum(b.numel for b in blocks) * itemsize * 4 > gpu_budget_nbytes(cfg, device)


@dataclass(frozen=True)
class ResolvedPlan:
    """The placement a config resolves to for given blocks, and its memory plan."""

    homes: dict[str, TierName]  # kind -> home tier
    source: WeightSource  # where compute weights are fetched from
    spilled_blocks: frozenset[int]  # blocks whose moments live on NVMe although homes says host
    plan: MemoryPlan
    placement: Placement  # gpu_update_fraction, gpu_stream_fraction, keep_for_backward with `auto` resolved
    # The placement is the first step's: auto placement is asked again at its commit (runtime.planning.measured_placement).
    measured_first_step: bool = False


def resolve_placement(blocks: list[Block], cfg: TierstoreConfig, device: torch.device, homes: dict[str, TierName],
                      source: WeightSource, *, rates: Rates | None = None,
                      no_stream_reason: str | None = None) -> Placement:
    """``optimizer.gpu_update_fraction``, ``optimizer.gpu_stream_fraction`` and ``prefetch.keep_for_backward`` as
    numbers: explicit values as written, ``auto`` chosen by ``runtime.planning.auto_placement`` (0 on the CPU). ``rates``: the
    speeds to plan with on CUDA (default: measured once per process)."""
    opt, keep = cfg.optimizer, cfg.prefetch.keep_for_backward
    host_sums = sums_on_host(blocks, cfg, device)
    if "auto" not in (opt.gpu_update_fraction, opt.gpu_stream_fraction, keep):
        return Placement(float(opt.gpu_update_fraction), float(opt.gpu_stream_fraction), int(keep), host_sums=host_sums)
    if device.type != "cuda":
        rates = None
    elif rates is None:  # before the budget is read: the probe gives its device memory back
        rates = measure_rates(device, cpu_threads=cpu_threads(cfg), pin=cfg.tiers.host.pin is not False)
    if no_stream_reason is None and TierName.NVME in (homes["master"], homes["exp_avg"]):
        no_stream_reason = "master or moments on nvme: streaming needs them in pinned host memory"
    dtype = DTYPES[cfg.dtype]
    itemsize = torch.empty((), dtype=dtype).element_size()
    ordered = sorted(blocks, key=lambda b: b.index)  # forward order, as gpu_updated_blocks counts

    def gpu_plan_nbytes(updated: int, streamed: int) -> int:
        first = frozenset(b.index for b in ordered[:updated])
        return _plan_of(blocks, cfg, homes, source, dtype, updated=first, streamed=streamed,
                        host_sums=host_sums).gpu_nbytes

    inputs = PlacementInputs(block_numels=tuple(b.numel for b in ordered), gpu_budget_nbytes=gpu_budget_nbytes(cfg, device),
                             gpu_plan_nbytes=gpu_plan_nbytes, compute_itemsize=itemsize,
                             fetch_itemsize=4 if source is WeightSource.MASTER else itemsize,
                             grad_itemsize=host_grad_dtype(cfg, host_sums).itemsize,
                             weights_resident=source is WeightSource.RESIDENT, no_stream_reason=no_stream_reason,
                             updates_wait_for_commit=waits_for_commit(cfg),
                             activation_reserve_nbytes=None if cfg.tiers.gpu.activation_reserve == "auto"
                             else int(cfg.tiers.gpu.activation_reserve))
    chosen = choose_placement(inputs, rates, update=opt.gpu_update_fraction, stream=opt.gpu_stream_fraction, keep=keep)
    return dataclasses.replace(chosen, host_sums=host_sums, rates=rates)


def placement_at_reserve(session: OffloadSession, reserve_nbytes: int, *, may_stream: bool = False) -> Placement:
    """What auto placement would choose for this session's blocks and config with ``tiers.gpu.activation_reserve``
    at ``reserve_nbytes`` and the GPU budget the store has (the profiler's advice asks; the rates measured at
    offload are cached). A session that streams nothing keeps streaming nothing (its plan may have given
    streaming up for host memory, which this does not re-check), unless ``may_stream``: the first step's plan of
    ``runtime.planning.measured_placement`` kept every moment in pinned memory."""
    cfg, device = session.config, session.store.device
    gpu = dataclasses.replace(cfg.tiers.gpu, activation_reserve=int(reserve_nbytes),
                              budget=session.store.tiers[TierName.GPU].capacity_nbytes)
    cfg = dataclasses.replace(cfg, tiers=dataclasses.replace(cfg.tiers, gpu=gpu))
    homes, _ = resolve_homes(cfg, device)
    source = session.controller.options.weight_source  # a copy the plan chose stays chosen
    no_stream = None
    if session.controller.options.spilled_blocks:  # a streamed block's update copies its moments from pinned memory
        no_stream = "moments spill to NVMe: the host room freed by blocks moved to the GPU brings them back first"
    elif not (session.controller.gpu_streamed or may_stream):
        no_stream = ("the plan keeps a compute-dtype copy of the weights, which a streamed update would not refresh"
                     if source is WeightSource.WEIGHTS else "this session streams nothing")
    rates = session.placement.rates if session.placement else None  # never timed again mid-training
    return resolve_placement(session.blocks, cfg, device, homes, source, rates=rates, no_stream_reason=no_stream)


def placement_figures(session: OffloadSession) -> dict[str, Any]:
    """What ``runtime.planning.peak_hint`` (and the profiler's advice) read of a session's placement: whether the update
    fraction and keep were auto, the activation reserve (0: nothing auto on a GPU), the GPU budget the store
    has, the plan's GPU bytes and the weights kept for backward."""
    cfg, placement = session.config, session.placement
    return {"gpu_update_fraction_auto": cfg.optimizer.gpu_update_fraction == "auto",
            "keep_auto": cfg.prefetch.keep_for_backward == "auto",
            "activation_reserve_auto": cfg.tiers.gpu.activation_reserve == "auto",
            # placed after a measured first step (runtime.planning.measured_placement): its reserve is the measured one
            "measured_first_step": first_step_listener(session.controller.step_listeners) is not None,
            "activation_reserve_nbytes": placement.activation_reserve_nbytes if placement else 0,
            "gpu_budget_nbytes": session.store.tiers[TierName.GPU].capacity_nbytes,
            "gpu_plan_nbytes": session.plan.gpu_nbytes,
            "keep_for_backward_nbytes": session.controller.options.keep_for_backward_nbytes}


def resolve_plan(blocks: list[Block], cfg: TierstoreConfig, device: torch.device, *,
                 rates: Rates | None = None) -> ResolvedPlan:
    """Homes, weight source, the ``auto`` placement knobs (``resolve_placement``) and the plan.
    ``placement.moments: auto`` with an NVMe path keeps the moments in pinned host memory as far as
    ``tiers.host.budget`` allows (``auto``: the RAM available now, less headroom) and spills blocks' moments to
    NVMe in ``spill_order``, only as many as needed."""
    homes, source = resolve_homes(cfg, device)
    dtype = DTYPES[cfg.dtype]
    if cfg.optimizer.overlap != "exact":
        raise ValueError("optimizer.overlap: delayed is not implemented yet; use exact")
    # Not where a compute-dtype copy of the weights may pay (unless the first step's plan spills moments): chosen for
    # the first step, it would rule out streaming. (Adopting a placement with the copy works,
    # tests/integration/test_weights_copy.py; not measured on a GPU yet.)
    limit = host_limit_nbytes(cfg)
    if measures_first_step(cfg, device):
        rates = rates or measure_rates(device, cpu_threads=cpu_threads(cfg), pin=cfg.tiers.host.pin is not False)
        first_cfg = first_step_config(cfg)
        first = resolve_plan(blocks, first_cfg, device, rates=rates)
        # A plan that spills moments never takes the copy (_weights_copy); the host room of the blocks the measured
        # placement moves to the GPU brings spilled moments back (_spilled_after, Controller.adopt_placement).
        if (first.spilled_blocks and first.source is WeightSource.MASTER and _within_limit(first.plan, cfg, limit)) or (
                not copy_fetch_may_pay(cfg, device, source) and _plan_fits(
                    blocks, first_cfg, homes, first.source, dtype, first.placement, limit,
                    spares=first.plan.pre_commit_buffers)):
            trial_note = (TRIAL_NOTE,) if may_try_recompute(cfg, blocks) else ()
            first.plan.notes = (FIRST_STEP_NOTE, *trial_note, *first.plan.notes)
            placement = dataclasses.replace(first.placement, rates=rates, notes=(FIRST_STEP_NOTE,))
            return dataclasses.replace(first, placement=placement, measured_first_step=True)
    placement, spilled_blocks, host_updated = _place_and_spill(blocks, cfg, device, homes, source, rates, limit)
    copy_note = None
    if copy_fetch_may_pay(cfg, device, source) and placement.gpu_update_fraction < 1:  # some weights are fetched
        copy, copy_note = _weights_copy(blocks, cfg, device, homes, rates, limit,
                                        master=(placement, spilled_blocks, host_updated))
        if copy is not None:
            source, (placement, spilled_blocks, host_updated) = WeightSource.WEIGHTS, copy
    if source is WeightSource.WEIGHTS and placement.gpu_stream_fraction:
        raise RuntimeError("a compute-dtype weights copy with streamed updates: a streamed update refreshes no host copy")
    spilled = len(spilled_blocks)
    if spilled:
        log.info("placement.moments: auto: the moments of %d of %d host-updated blocks go to NVMe", spilled, host_updated)
    # Updates that wait for the commit run ahead into second buffers when the host has room for them; they are
    # the first thing given up (before spilling moments to disk): without them a step is only slower.
    spares = not spilled and waits_for_commit(cfg) and _plan_fits(blocks, cfg, homes, source, dtype, placement, limit,
                                                                  spares=True)
    plan = plan_for(blocks, cfg, homes, source, dtype, spilled, spares, placement=placement)
    plan.notes = placement.notes if copy_note is None else (*placement.notes, copy_note)
    if cfg.optimizer.accumulate_on == "auto" and cfg.optimizer.accumulation_steps > 1:
        plan.notes = (*plan.notes, "optimizer.accumulate_on: auto -> " + (
            "host (the model's gradients take more than a quarter of the GPU budget)" if placement.host_sums
            else "gpu (the model's gradients fit a quarter of the GPU budget)"))
    return ResolvedPlan(homes, source, spilled_blocks, plan, placement)


def _weights_copy(blocks: list[Block], cfg: TierstoreConfig, device: torch.device, homes: dict[str, TierName],
                  rates: Rates | None, limit: int, *, master: tuple[Placement, frozenset[int], int]
                  ) -> tuple[tuple[Placement, frozenset[int], int] | None, str]:
    """Whether the plan keeps a compute-dtype copy of the weights instead of fetching the master
    ([Note: compute-dtype copy under accumulation]): the copy's (placement, spilled blocks, host-updated count)
    when it costs nothing else, else None; and the plan's note saying which and why. ``master``: the same for
    fetching the master."""
    placement, spilled_blocks, _ = master
    # The copy must cost nothing else: no moments spilled, no streaming given up (a streamed block's update
    # refreshes no host copy), no pre-commit buffers lost (clipped steps would wait for the norm again).
    if spilled_blocks:
        why = "the moments already spill to NVMe, and the copy would spill more"
    elif placement.gpu_stream_fraction:
        why = "updates are streamed to the GPU, and a streamed update refreshes no host copy"
    else:
        dtype = DTYPES[cfg.dtype]
        copy = _place_and_spill(blocks, cfg, device, homes, WeightSource.WEIGHTS, rates, limit)
        copy_placement, copy_spilled, _ = copy

        def fits(which: WeightSource, chosen: Placement, spares: bool = False) -> bool:
            return _plan_fits(blocks, cfg, homes, which, dtype, chosen, limit, spares=spares)

        if copy_spilled or copy_placement.gpu_stream_fraction or not fits(WeightSource.WEIGHTS, copy_placement):
            why = "it would not fit beside the rest without spilling moments to NVMe"
        elif (waits_for_commit(cfg) and fits(WeightSource.MASTER, placement, spares=True)
              and not fits(WeightSource.WEIGHTS, copy_placement, spares=True)):
            why = "it would take the room of the pre-commit buffers that let clipped steps update early"
        else:
            return copy, (f"placement.weights: a {cfg.dtype} copy in pinned memory: {cfg.optimizer.accumulation_steps} "
                          "micro-batches a step fetch half the bytes of the fp32 master, and it fits beside the rest")
    return None, f"placement.weights: fetched from the fp32 master, not a {cfg.dtype} copy in pinned memory: {why}"


# [Note: compute-dtype copy under accumulation]
# With the master in pinned memory the GPU fetches the fp32 master and casts it (no host pass, no host bytes). Under
# gradient accumulation each micro-batch fetches every block again (forward, and backward for what is not kept), so
# a step moves 4 bytes a parameter that many times; a compute-dtype copy halves that for one CPU cast a step (the
# optimizer worker refreshes the copy after each update; ``runtime.update.worker``). The weights are the same bits:
# fp32 -> bf16 rounds to nearest even on either side. The copy costs 2 bytes a parameter of pinned memory, so the
# plan takes it only when it costs nothing else (``resolve_plan``). On an H100 at 14 layers of the 8B scenario
# (4.10B parameters, 16 micro-batches a step) the fp32 fetches were 389 GB a step at 46 GB/s.
def copy_fetch_may_pay(cfg: TierstoreConfig, device: torch.device, source: WeightSource) -> bool:
    """True when a compute-dtype copy of the weights in pinned memory may be worth its host bytes: a GPU fetching
    the fp32 master (``placement.weights`` host or auto) of 2-byte compute weights once per micro-batch of an
    accumulated step (see [Note: compute-dtype copy under accumulation])."""
    return (device.type == "cuda" and source is WeightSource.MASTER and cfg.dtype in ("bf16", "fp16")
            and cfg.optimizer.accumulation_steps > 1)


def _place_and_spill(blocks: list[Block], cfg: TierstoreConfig, device: torch.device, homes: dict[str, TierName],
                     source: WeightSource, rates: Rates | None,
                     limit: int) -> tuple[Placement, frozenset[int], int]:
    """Auto placement for ``source`` and the blocks whose moments then spill to NVMe (``_spill``); streaming given
    up first when the plan would not fit otherwise. Returns (placement, spilled blocks, host-updated count)."""
    dtype = DTYPES[cfg.dtype]
    placement = resolve_placement(blocks, cfg, device, homes, source, rates=rates)
    spilled_blocks, host_updated, fits = _spill(blocks, cfg, homes, source, dtype, placement, limit)
    if not fits and cfg.optimizer.gpu_stream_fraction == "auto" and placement.gpu_stream_fraction > 0:
        # Streamed blocks keep their moments in pinned memory: give them up before refusing the plan.
        placement = resolve_placement(blocks, cfg, device, homes, source, rates=rates, no_stream_reason=(
            "host RAM holds the moments of no streamed block beside the rest"))
        spilled_blocks, host_updated, fits = _spill(blocks, cfg, homes, source, dtype, placement, limit)
    return placement, spilled_blocks, host_updated


def _plan_fits(blocks: list[Block], cfg: TierstoreConfig, homes: dict[str, TierName], source: WeightSource,
               dtype: torch.dtype, placement: Placement, limit: int, *, spares: bool = False) -> bool:
    """True when the plan with nothing spilled (and ``spares``: with pre-commit buffers) stays within ``limit``:
    its pinned bytes under an explicit ``tiers.host.budget`` (the pool's size, what ``spill_moments`` fills), its
    RAM (pinned bytes and swap files on tmpfs) under ``auto`` (the RAM available)."""
    return _within_limit(plan_for(blocks, cfg, homes, source, dtype, spares=spares, placement=placement), cfg, limit)


def _within_limit(plan: MemoryPlan, cfg: TierstoreConfig, limit: int) -> bool:
    """True when the plan stays within ``limit``: its pinned bytes under an explicit ``tiers.host.budget``, its RAM
    (pinned bytes and swap files on tmpfs) under ``auto``."""
    used = planned_ram_nbytes(plan, cfg.tiers.nvme.path) if cfg.tiers.host.budget == "auto" else plan.host_nbytes
    return used <= limit


def _spill(blocks: list[Block], cfg: TierstoreConfig, homes: dict[str, TierName], source: WeightSource,
           dtype: torch.dtype, placement: Placement, limit: int) -> tuple[frozenset[int], int, bool]:
    """The host-updated blocks that spill their moments to NVMe (``placement.moments: auto``, in ``spill_order``) for
    the plan's pinned memory to fit ``limit``, how many blocks are host-updated, and whether the plan then fits."""
    gpu_updated = gpu_updated_blocks(blocks, placement.gpu_update_fraction)
    host_updated = [b.index for b in blocks if b.index not in gpu_updated]
    if not (cfg.placement.moments == "auto" and cfg.tiers.nvme.path is not None and homes["exp_avg"] is TierName.HOST):
        return frozenset(), len(host_updated), True
    # Streamed blocks (the first host-updated ones) copy their moments from pinned memory: never spilled.
    streamed = gpu_streamed_blocks(blocks, placement.gpu_update_fraction, placement.gpu_stream_fraction)
    spillable = len(host_updated) - len(streamed)

    def make(count: int) -> MemoryPlan:
        return plan_for(blocks, cfg, homes, source, dtype, count, placement=placement)

    spilled = spill_moments(make, spillable, limit)
    order = spill_order([blocks[i].numel for i in host_updated], len(streamed))
    spilled_blocks = frozenset(host_updated[p] for p in order[:spilled])
    return spilled_blocks, len(host_updated), spilled < spillable or make(spilled).host_nbytes <= limit


def host_limit_nbytes(cfg: TierstoreConfig) -> int:
    """What the plan's host memory must fit: ``tiers.host.budget``, or under ``auto`` the RAM available now."""
    return host_memory().usable_nbytes if cfg.tiers.host.budget == "auto" else int(cfg.tiers.host.budget)


def measures_first_step(cfg: TierstoreConfig, device: torch.device) -> bool:
    """True when auto placement waits for the first step's measured peak (``runtime.planning.measured_placement``): the update
    fraction and the activation reserve are both ``auto``, on a GPU."""
    return (device.type == "cuda" and cfg.optimizer.gpu_update_fraction == "auto"
            and cfg.tiers.gpu.activation_reserve == "auto")


def first_step_config(cfg: TierstoreConfig) -> TierstoreConfig:
    """``cfg`` as the first step of ``measures_first_step`` runs it: every update on the CPU, nothing streamed, and
    no weights kept for backward unless the config sets an amount (the plan's smallest GPU footprint)."""
    opt, prefetch = cfg.optimizer, cfg.prefetch
    opt = dataclasses.replace(opt, gpu_update_fraction=0.0,
                              gpu_stream_fraction=0.0 if opt.gpu_stream_fraction == "auto" else opt.gpu_stream_fraction)
    keep = 0 if prefetch.keep_for_backward == "auto" else prefetch.keep_for_backward
    return dataclasses.replace(cfg, optimizer=opt, prefetch=dataclasses.replace(prefetch, keep_for_backward=keep))


def host_grad_dtype(cfg: TierstoreConfig, host_sums: bool) -> torch.dtype:
    """``optimizer.host_grad_dtype`` resolved: the dtype of the host gradient buffers the CPU updates from (``auto``:
    the compute dtype under bf16 where micro-batches sum in host memory, ``host_sums``; else fp32)."""
    choice = cfg.optimizer.host_grad_dtype
    if choice == "fp32" or cfg.dtype != "bf16" or (choice == "auto" and not host_sums):
        return torch.float32
    return DTYPES[cfg.dtype]


def waits_for_commit(cfg: TierstoreConfig) -> bool:
    """True when updates need the whole gradient before they can commit: clipping (tierstore's or the loop's)
    or fp16 overflow checks."""
    return clip_threshold(cfg.optimizer) is not None or cfg.dtype == "fp16" or cfg.optimizer.user_grad_clip


def cpu_threads(cfg: TierstoreConfig) -> int:
    """``optimizer.cpu_threads`` as a number (``auto``: ``default_cpu_threads()``)."""
    threads = cfg.optimizer.cpu_threads
    return default_cpu_threads() if threads == "auto" else int(threads)


def default_cpu_threads() -> int:
    """Threads for the CPU optimizer: every core but two when a GPU is fed (the Python thread launching
    forward kernels and the autograd thread launching backward ones). One more OpenMP thread than there
    are free cores stalls every parallel region on the descheduled one."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    return max(1, cores - (2 if torch.cuda.is_available() else 0))


def plan_model(model: nn.Module, cfg: TierstoreConfig, device: torch.device, *,
               rates: Rates | None = None) -> tuple[list[Block], ResolvedPlan, Budgets]:
    """Blocks, placement and memory plan of ``model`` under ``cfg``, put through every check that can refuse
    them before anything is allocated. ``offload()`` and ``tierstore plan`` both call this (the latter on a
    meta-device model), so the two refuse the same configs with the same message. ``rates``: see
    ``resolve_placement``."""
    blocks = build_blocks(model, cfg.blocks.min_block_size, list(cfg.blocks.modules) if cfg.blocks.modules else None)
    if not blocks:
        raise ValueError("the model has no trainable parameters to offload")
    resolved = resolve_plan(blocks, cfg, device, rates=rates)
    return blocks, resolved, check_fits(resolved.plan, cfg, device)


def _options(cfg: TierstoreConfig, dtype: torch.dtype, resolved: ResolvedPlan, record_intervals: bool) -> RuntimeOptions:
    opt, placement = cfg.optimizer, resolved.placement
    loss_scale = None
    if cfg.dtype == "fp16":
        ls = opt.loss_scale
        loss_scale = {"initial": ls.initial, "growth_factor": ls.growth_factor, "backoff_factor": ls.backoff_factor,
                      "growth_interval": ls.growth_interval}
    return RuntimeOptions(
        compute_dtype=dtype, weight_source=resolved.source, homes=resolved.homes,
        hyper=AdamWHyper(lr=opt.lr, beta1=opt.betas[0], beta2=opt.betas[1], eps=opt.eps, weight_decay=opt.weight_decay),
        grad_clip=clip_threshold(opt), accumulation_steps=opt.accumulation_steps, prefetch_depth=cfg.prefetch.depth,
        prefetch_budget_nbytes=cfg.prefetch.budget, loss_scale=loss_scale, cpu_threads=cpu_threads(cfg),
        record_intervals=record_intervals, gpu_update_fraction=placement.gpu_update_fraction,
        spilled_blocks=resolved.spilled_blocks, gpu_stream_fraction=placement.gpu_stream_fraction,
        gpu_stream_ahead=opt.gpu_stream_ahead, keep_for_backward_nbytes=placement.keep_for_backward_nbytes,
        hold_updates=opt.user_grad_clip, host_sums=placement.host_sums, host_grad_dtype=host_grad_dtype(cfg, placement.host_sums),
        speculate=resolved.plan.pre_commit_buffers)
