"""``offload(model, config)``: the one call that turns an ordinary nn.Module into an offloaded one."""

from __future__ import annotations

import functools
import gc
import logging
import os
import sys
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn

from runtime.config.loader import ConfigError, TierstoreConfig, load_config
from runtime.config.schema import clip_threshold, consistency_problems
from runtime.config.units import approx_size
from runtime.core.blocks import Block, build_blocks
from runtime.core.ranks import Ranks, bind_cores, join_ranks, rank_folder
from runtime.core.signals import Terminated, defers_interrupts, handle_signals
from runtime.engine.controller import Controller, RuntimeOptions
from runtime.integrations.safetensors_export import save_sharded  # needs safetensors only when called
from runtime.model.hooks import HookSet, StateDictHooks
from runtime.model.materialize import ParamInit, block_filler, initialize, materialize_meta_parameters
from runtime.model.optimizer import OffloadAdamW, check_param_groups, param_groups_of
from runtime.model.param_guard import ParamGuard, is_offloaded
from runtime.model.recompute import BufferWatch, ForwardTimer, Recompute, already_checkpointed, recompute_refusal
from runtime.model.remote_reads import ReadService, RemoteReader
from runtime.model.state_access import StateAccess
from runtime.planning.auto_placement import Placement, Rates
from runtime.planning.block_plan import spilled_after
from runtime.planning.measured_placement import FirstStepPlacement, RecomputeTrial, first_step_listener
from runtime.planning.memory_plan import STATE_KINDS, Budgets, MemoryPlan, WeightSource
from runtime.planning.oom_hint import install_oom_hint, reserve_hint
from runtime.planning.ownership import assign_owners, owned_blocks, rank_config
from runtime.planning.peak_hint import PeakHint, cuda_peak, cuda_peak_reset, cuda_reserved_by_stream, cuda_step_peak
from runtime.planning.placement import InForce, ResolvedPlan, adopted_plan, placement_at_reserve, plan_blocks, rates_needed
from runtime.planning.settings import DTYPES, cpu_threads, host_grad_dtype, resolve_device
from runtime.update.adam import AdamWHyper
from runtime.update.moment_kernel import Int8Kernel, int8_kernel_for
from runtime.update.rates import measure_rates
from tierstore import StoreConfig, TierName, TierStore, remove_abandoned

log = logging.getLogger(__name__)


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
    # Several processes: this rank's answers to the others' reads of its blocks ([Note: reads served by the owner]).
    read_service: ReadService | None = field(default=None, repr=False)

    @property
    def ranks(self) -> Ranks | None:
        """This process's place among the run's processes (torchrun's), or None in a run of one process."""
        return self.controller.options.ranks

    def _unpinned_on_every_rank(self) -> None:
        """Several processes: wait in the store until every rank has given its pinned arena back, so that none enters
        the program's next collective while another still unpins ([Note: no GPU collective beside a pinning]).
        Skipped where a collective failed (the others may be gone); a rank that does not come is logged, not raised:
        the session is closed either way."""
        ranks = self.ranks
        if ranks is None or ranks.broken is not None:
            return
        try:
            ranks.host_barrier("the ranks' host memory unpinned at close()")
        except RuntimeError as error:
            log.warning("close(): %s", error)

    @property
    def activations_recomputed(self) -> bool:
        """The layers' forwards are recomputed in the backward now (placement.activations: recompute, or auto's
        choice)."""
        return self.recompute is not None and self.recompute.on

    def __enter__(self) -> OffloadSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def planned_blocks(self) -> list[Block]:
        """The blocks whose state this process keeps and plans: all of them, or the ones it owns where several
        processes run ([Note: block ownership] in runtime.planning.ownership)."""
        table = self.controller.table
        return [block for block in self.blocks if not table[block.index].remote]

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the offloaded parameters compute in (the config's ``dtype``)."""
        return self.controller.options.compute_dtype

    @defers_interrupts
    def master_state_dict(self) -> dict[str, torch.Tensor]:
        """The fp32 master weights by parameter name (CPU tensors), after every committed update."""
        return self.access.slot_values("master")

    @defers_interrupts
    def weights_of(self, block: Block, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Block's current weights by parameter name: CPU tensors cast from the fp32 master to ``dtype`` (default:
        the parameters' compute dtype)."""
        self.access.settle(read_only=True)
        dtype = dtype or self.compute_dtype
        return self.access.block_values(block, "master", {slot.name: dtype for slot in block.slots})

    def save_pretrained(self, directory: str | os.PathLike[str], *, max_shard_nbytes: int = 5 << 30) -> None:
        """Save the current weights as HF-style sharded safetensors (``from_pretrained`` reads them), one shard
        of blocks in host memory at a time: the way to save a model too large for ``model.state_dict()``.

        With several processes it is collective: every rank calls it with the same directory; rank 0 reads each
        block from its owner ([Note: reads served by the owner]) and writes the files, and every rank returns once
        they are written (or raises rank 0's failure)."""
        ranks = self.ranks
        if ranks is None:
            save_sharded(self, directory, max_shard_nbytes=max_shard_nbytes)
            return
        error: BaseException | None = None
        if ranks.rank == 0:  # (two ranks writing the same names would race)
            try:
                save_sharded(self, directory, max_shard_nbytes=max_shard_nbytes)
            except Exception as exc:  # every rank learns it below
                error = exc
        others = ranks.others_refusing(None if error is None else f"{type(error).__name__}: {error}",
                                       "the saved model's status")
        if error is not None:
            raise error
        if others:
            raise RuntimeError(f"rank {ranks.rank} of {ranks.world_size}: session.save_pretrained failed on "
                               + "; ".join(f"rank {rank} ({why})" for rank, why in others))

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
        ranks = self.ranks
        leaving = sys.exc_info()[1]  # close() on the way out of an exception (a `finally`, a `with`)
        if ranks is not None and leaving is not None and ranks.broken is None:
            # This rank is failing: no collective more (the others are inside another one); they learn why.
            ranks.fail(repr(leaving))
        try:
            values = self._trained_values(dtypes)
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
        if self.read_service is not None:  # every rank is in close() now (its reads were collective), or failed
            self.read_service.close()
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
            self._unpinned_on_every_rank()
            self._sweep_dead_ranks()
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

    def _trained_values(self, dtypes: dict[str, torch.dtype]) -> dict[str, torch.Tensor]:
        """close(): the step in progress dropped, the masters to give back (where several processes failed, only
        this rank's own blocks': no collective can gather the others' now)."""
        controller, ranks = self.controller, self.ranks
        if controller.step_pending:
            controller.discard_pending()
            if controller.interrupted is None:
                log.warning("close(): a backward ran since the last optimizer.step(); that step is dropped")
        if controller.interrupted is not None:  # the user must not take them for the last step's weights
            log.error("close(): the weights handed back are not the last committed step's (training would "
                      "have refused to go on): %s", controller.interrupted)
        self.access.mixed_steps_allowed = True
        self.access.broadcast_reads = True  # every rank closes: the GPUs' broadcast, not the read services
        if ranks is not None and ranks.broken is not None:
            log.warning("close(): the run of %d processes failed (%s): rank %d gives back the parameters of the blocks it "
                        "owns; the others are left on the meta device", ranks.world_size, ranks.broken, ranks.rank)
            return self.access.own_values("master", self.planned_blocks, dtypes)
        return self.access.slot_values("master", dtypes)

    def _sweep_dead_ranks(self) -> None:
        """Several processes whose collectives failed: a rank that was killed could not remove its swap files; the
        ones that lived remove those of every rank directory whose lock its holder no longer keeps
        (``tierstore.remove_abandoned``; a rank still closing keeps its lock, and removes its own)."""
        ranks, path = self.ranks, self.config.tiers.nvme.path
        if ranks is None or ranks.broken is None or path is None or not os.path.isdir(path):
            return
        for name in sorted(os.listdir(path)):
            directory = os.path.join(path, name)
            if name.startswith("rank") and os.path.isdir(directory):
                try:
                    removed = remove_abandoned(directory)
                    if removed:
                        log.warning("removed %d swap files that a rank which died left in %s", len(removed) - 1, directory)
                except OSError as error:
                    log.warning("could not remove the swap files a dead rank left in %s: %r", directory, error)

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
            if p is not None and slot is not None:
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
    for stored in store.keys():  # the room the masters' staging needs
        if str(stored) not in masters:
            _log_failure(functools.partial(store.unregister, stored))
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
    setup) is logged and the undo goes on; another one after it stops the undo. A SIGTERM during the undo (after a
    Ctrl-C or an error: a SIGTERM that ended the setup made the next one kill) lets the undo finish, which is the
    cleanup it asks for, and is raised then in place of the setup's error: the process is ending."""
    if store is not None:
        steps = [*steps, functools.partial(_give_back_parameters, blocks, store), store.close]
    interrupted = False
    terminated: Terminated | None = None
    for step in steps:
        try:
            _log_failure(step)
        except KeyboardInterrupt:
            if interrupted:
                raise
            interrupted = True
            log.warning("offload() is undoing a failed setup: Ctrl-C again to stop that (the model may then hold "
                        "parameters with no values, and the swap directory stay locked until exit)")
        except Terminated as exc:
            terminated = terminated or exc
    if terminated is not None:
        raise terminated


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
        extent = sum((size - 1) * stride for size, stride in zip(param.shape, param.stride(), strict=True)) + 1
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
    for size, stride in zip(tensor.shape, tensor.stride(), strict=True):
        offsets = offsets.unsqueeze(-1) + torch.arange(size, dtype=torch.int64) * stride
    first = tensor.data_ptr() + offsets.reshape(-1, 1) * tensor.element_size()
    return (first + torch.arange(tensor.element_size(), dtype=torch.int64)).reshape(-1)


def _move_rest(model: nn.Module, device: torch.device, offloaded: set[int] | None = None) -> None:
    """Move buffers and the parameters tierstore does not offload to device."""
    for module in model.modules():
        for name, buf in list(module._buffers.items()):
            if buf is not None:
                module._buffers[name] = buf.to(device)
        for p in list(module._parameters.values()):
            if p is not None and (offloaded is None or id(p) not in offloaded) and not p.is_meta:
                if offloaded is not None or p.device != device:
                    p.data = p.data.to(device)


def _planned(model: nn.Module, cfg: TierstoreConfig, device: torch.device,
             ranks: Ranks | None) -> tuple[list[Block], ResolvedPlan, Budgets]:
    """``plan_model`` and the checks before anything is allocated. With several processes each rank plans its own
    blocks, and every rank learns whether every other's plan was accepted: one rank's refusal stops them all here,
    each naming it, rather than leaving the others to wait for it at their first exchange."""
    refusal: Exception | None = None
    if ranks is not None:  # before planning: the plan's rate probe pins host memory, the ranks then meet in the store
        ranks.agree_on_serial()
    try:
        blocks, resolved, budgets = plan_model(model, cfg, device,
                                               rank=None if ranks is None else (ranks.rank, ranks.world_size))
        _check_recompute(cfg, blocks, model)
        if ranks is not None:
            _check_ranks(cfg, resolved, ranks)
    except Exception as error:
        if ranks is None:
            raise
        refusal = error
    if ranks is not None:
        # no rank's comparison may spin while another still probes ([Note: no GPU collective beside a pinning])
        ranks.host_barrier("the ranks' plans made (their rate probes' host memory given back)")
        others = ranks.others_refusing(None if refusal is None else f"{type(refusal).__name__}: {refusal}")
        if refusal is not None:
            raise refusal
        if others:
            raise ValueError("; ".join(f"rank {rank} of {ranks.world_size} refused its plan ({why})" for rank, why in others)
                             + f"; rank {ranks.rank} stops too, before allocating anything")
    return blocks, resolved, budgets


def _check_ranks(cfg: TierstoreConfig, resolved: ResolvedPlan, ranks: Ranks) -> None:
    """Refuse, before anything is allocated, what a run of several processes does not do yet, naming the setting to
    change (every rank refuses alike: the config and the plan are the same on each)."""
    refusals = []
    if resolved.source is WeightSource.RESIDENT:
        refusals.append("placement.weights: gpu: write host")
    if refusals:
        raise ConfigError(f"with several processes ({ranks.world_size} ranks) tierstore does not yet support: "
                          + "; ".join(refusals))


def _check_model(model: nn.Module) -> None:
    """Refuse a model ``offload()`` cannot take as it is: one already offloaded, or two parameters over one memory."""
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


def _checked_config(config: TierstoreConfig | Mapping[str, Any] | str | os.PathLike[str] | None) -> TierstoreConfig:
    """The config ``offload()`` was given, loaded, and checked for consistency (a config built in code, not loaded,
    is checked here)."""
    cfg = config if isinstance(config, TierstoreConfig) else load_config(config)
    for problem in consistency_problems(cfg)[:1]:
        raise ConfigError(problem.message, problem.path, kind=problem.kind)
    return cfg


def _prepare_parameters(model: nn.Module, cfg: TierstoreConfig, device: torch.device, init: ParamInit | None) -> set[int]:
    """Say what the session computes differently from the parameters' own dtypes, and give parameters on the meta
    device storage; returns the ids of those not filled yet (the offloaded ones, filled by ``init`` block by block)."""
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
    return uninitialized


def _check_recompute(cfg: TierstoreConfig, blocks: list[Block], model: nn.Module) -> None:
    """Refuse ``placement.activations: recompute`` where the layers cannot be recomputed, saying why."""
    if cfg.placement.activations == "recompute":
        refusal = recompute_refusal(blocks, model)
        if refusal:
            raise ValueError(f"placement.activations: recompute cannot apply: {refusal}; set placement.activations: "
                             "keep")


def _host_io(cfg: TierstoreConfig, device: torch.device, budgets: Budgets) -> tuple[bool | None, str]:
    """``tiers.host.pin`` (None: auto) and ``tiers.nvme.direct_io`` as the store takes them; a host tier large enough
    to take a while is announced (pinning runs at about 2 GB/s: said before a long silence)."""
    pin = None if cfg.tiers.host.pin == "auto" else bool(cfg.tiers.host.pin)
    direct = cfg.tiers.nvme.direct_io
    if budgets.host_nbytes >= LONG_SETUP_NBYTES:
        log.info("%s %s of host memory for tierstore's tiers", "pinning" if device.type == "cuda" and pin is not False
                 else "reserving", approx_size(budgets.host_nbytes))
    return pin, ("on" if direct else "off") if isinstance(direct, bool) else str(direct)


def plan_model(model: nn.Module, cfg: TierstoreConfig, device: torch.device, *,
               rates: Rates | None = None, rank: tuple[int, int] | None = None) -> tuple[list[Block], ResolvedPlan, Budgets]:
    """Blocks, placement and memory plan of ``model`` under ``cfg`` (``runtime.planning.placement.plan_blocks``), put
    through every check that can refuse them before anything is allocated. ``offload()`` and ``tierstore plan`` both
    call this (the latter on a meta-device model), so the two refuse the same configs with the same message. What
    planning is given it gathers here: the blocks, the machine's rates where the plan needs them (``rates``: these
    instead; default: ``runtime.update.rates.measure_rates``, once per process) and whether the layers can be
    recomputed. ``rank``: (rank, world size) of a run of several processes, whose plan is of the blocks that rank
    owns under its share of the node's host and NVMe budgets (``runtime.planning.ownership``)."""
    blocks = build_blocks(model, cfg.blocks.min_block_size, list(cfg.blocks.modules) if cfg.blocks.modules else None)
    if not blocks:
        raise ValueError("the model has no trainable parameters to offload")
    planned = blocks
    if rank is not None:
        planned = owned_blocks(blocks, *rank)
        cfg = rank_config(cfg, blocks, planned, device)
    rates = rates or machine_rates(cfg, device)  # before the GPU budget is read: the probe gives its memory back
    resolved, budgets = plan_blocks(planned, cfg, device, rates=rates, recomputable=recompute_refusal(blocks) is None)
    return blocks, resolved, budgets


def machine_rates(cfg: TierstoreConfig, device: torch.device) -> Rates | None:
    """The machine's rates where ``cfg``'s plan on ``device`` chooses from them (``rates_needed``; None elsewhere):
    ``runtime.update.rates.measure_rates`` with the optimizer's threads and the update the run's CPU runs (its
    ``moment_dtype``, int8 through the compiled kernel where ``moment_kernel`` takes it), once per process."""
    if not rates_needed(cfg, device):
        return None
    return measure_rates(device, cpu_threads=cpu_threads(cfg), pin=cfg.tiers.host.pin is not False,
                         moment_dtype=cfg.optimizer.moment_dtype, int8_kernel=cpu_int8_kernel(cfg, device))


def cpu_int8_kernel(cfg: TierstoreConfig, device: torch.device,
                    gpu_update_fraction: float | None = None) -> Int8Kernel | None:
    """The compiled int8 kernel the CPU's updates run (``optimizer.moment_kernel``; built once per process, at
    ``offload()``: never in a step), or None: torch ops. ``gpu_update_fraction``: the resolved share (1 on a GPU: no
    update on the CPU, nothing to build); default: the config's. Refuses (``compiled`` that cannot build) with a
    ``ConfigError`` naming the key."""
    fraction = cfg.optimizer.gpu_update_fraction if gpu_update_fraction is None else gpu_update_fraction
    return int8_kernel_for(cfg.optimizer.moment_kernel, cfg.optimizer.moment_dtype,
                           cpu_updates=device.type == "cpu" or fraction != 1.0)


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

    SIGTERM ends the setup as Ctrl-C does (the model given back, the swap files removed, then :class:`Terminated`:
    exit status 143), and the open session's steps and ``close()`` likewise (``runtime.core.signals``); a program's own
    SIGTERM handler is left alone.
    """
    # Filling the tiers takes minutes at 8B, exactly when schedulers send SIGTERM: its default action would leave the
    # swap files (on /dev/shm, RAM until the next start). So SIGTERM raises Terminated from the start of the setup,
    # which undoes what it did as for Ctrl-C; the open session keeps the handler until close().
    leave_signals = handle_signals()
    try:
        return _offload(model, config, record_intervals, init, param_groups, leave_signals)
    except BaseException:
        leave_signals()  # (idempotent: a setup that got as far as the session's on_close ran it already)
        raise


def _offload(model: nn.Module, config: TierstoreConfig | Mapping[str, Any] | str | os.PathLike[str] | None,
             record_intervals: bool, init: ParamInit | None, param_groups: list[dict[str, Any]] | None,
             leave_signals: Callable[[], None]) -> tuple[nn.Module, OffloadAdamW]:
    """``offload()``'s setup, with SIGTERM already an exception (``leave_signals`` gives the handler back: the
    session's last ``on_close`` step)."""
    _check_model(model)
    cfg = _checked_config(config)
    device = resolve_device(cfg)
    ranks = join_ranks(device)  # None: one process
    if ranks is not None:
        device = ranks.device  # this rank's own GPU
        bind_cores(ranks)  # before the threads are counted and started
    dtype = DTYPES[cfg.dtype]
    uninitialized = _prepare_parameters(model, cfg, device, init)
    blocks, resolved, budgets = _planned(model, cfg, device, ranks)
    # Before anything is pinned: a `compiled` kernel that cannot build refuses the run with nothing to undo.
    int8_kernel = cpu_int8_kernel(cfg, device, resolved.placement.gpu_update_fraction)
    plan = resolved.plan
    log.info("%s", plan.table())
    # What is not offloaded (buffers, frozen parameters) simply lives on the compute device.
    _move_rest(model, device, {id(slot.param) for b in blocks for slot in b.slots})
    pin, direct = _host_io(cfg, device, budgets)
    offloaded = [slot.param for b in blocks for slot in b.slots]
    # Groups are checked before the parameters are bound to blocks: a refusal leaves the model as it was.
    groups = param_groups_of(model, param_groups, offloaded)
    check_param_groups(groups, blocks)
    opened: list[TierStore] = []  # the store once built: the undo closes it even when a signal came as it was built
    session: OffloadSession | None = None
    undo: list[Callable[[], None]] = []  # what a failure from here on takes back, in the order it was done
    try:
        _open_store(opened, StoreConfig(device=str(device), gpu_budget_nbytes=budgets.gpu_nbytes,
                                        host_budget_nbytes=budgets.host_nbytes, pin=pin if device.type == "cuda" else False,
                                        nvme_path=_rank_directory(cfg.tiers.nvme.path, ranks),
                                        nvme_budget_nbytes=budgets.nvme_nbytes,  # (a rank's: its share)
                                        io_threads=cfg.tiers.nvme.io_threads, io_block_nbytes=cfg.tiers.nvme.block_size,
                                        direct_io=str(direct)))
        store = opened[0]
        if ranks is not None:  # no rank's first broadcast may spin while another still pins its arena
            ranks.host_barrier("the ranks' host memory pinned")  # ([Note: no GPU collective beside a pinning])
        options = _options(cfg, dtype, resolved, record_intervals, int8_kernel, ranks, blocks)
        controller = Controller(model, blocks, store, options, fill_block=block_filler(init, uninitialized))
        undo.append(controller.close)
        access = StateAccess(controller, blocks, store, controller.weights, controller.worker, controller.writebacks,
                             controller.fetch.release)
        hooks = HookSet(model, blocks, controller)
        undo.append(hooks.remove)
        guard = ParamGuard(blocks, access, controller.clipper, controller, controller.param_block)
        undo.append(guard.remove)
        guard.install()
        state_dict_hooks = StateDictHooks(model, blocks, lambda block: cast(OffloadSession, session).weights_of(block),
                                          access.begin_batch, access.end_batch)
        undo.append(state_dict_hooks.remove)
        session = OffloadSession(cfg, blocks, store, controller, hooks, plan, model, access, guard, state_dict_hooks)
        offloaded_ids = {id(p) for p in offloaded}
        controller.frozen = [(n, p) for n, p in model.named_parameters() if id(p) not in offloaded_ids]
        optimizer = OffloadAdamW(groups, controller, access)
        optimizer.session = session  # type: ignore[attr-defined]
        session.optimizer = optimizer
        session.placement = resolved.placement
        _listen(session, resolved, device)
        # SIGTERM ends training like Ctrl-C while the session is open. Without close(), the worker, the store and its
        # IO threads close themselves at exit (tierstore.close_at_exit): not the session, whose close() would copy
        # every weight back into the model first.
        if ranks is not None:
            session.on_close.append(_reduced_here(model))
            access.remote = RemoteReader(ranks)
            session.on_close.append(access.remote.close)
            session.read_service = ReadService(ranks, access.own_copy)
            session.on_close.append(session.read_service.close)  # (a setup undone; close() stops it earlier)
            session.read_service.start()
        session.on_close.append(leave_signals)
    except BaseException as error:  # the model as it was, the directory unlocked, no thread left; the error unchanged
        if ranks is not None:  # the others, waiting in a collective or in the store, end at once naming this rank
            ranks.fail(f"offload() failed: {error!r}")
        if session is not None:
            session.closed = True  # its listeners and close() then do nothing
        _undo_offload(blocks, opened[0] if opened else None, [*reversed(undo), *(session.on_close if session is not None else [])])
        raise
    return model, optimizer


# What DistributedDataParallel and accelerate read of a module: the parameters DDP leaves alone, and "prepared
# already" (accelerate >= 1.14 then returns the module as it is).
_DDP_IGNORED = "_ddp_params_and_buffers_to_ignore"
_ACCELERATE_PREPARED = "_is_accelerate_prepared"


def _reduced_here(model: nn.Module) -> Callable[[], None]:
    """Several processes: the ranks' gradients are reduced by tierstore (onto each block's owner), so the model is
    not for DDP. The HF Trainer hands it to accelerate, which wraps a module in DDP when it runs in several processes:
    that would reduce every gradient a second time and keep a bucket of the whole model's gradients on each GPU.
    Marked as prepared, accelerate (>= 1.14) leaves the model as it is; older versions still call DDP, which finds
    every parameter ignored and refuses ("DistributedDataParallel is not needed when a module doesn't have any
    parameter that requires a gradient") instead of training wrongly. Returns what takes the marks off (at close)."""
    setattr(model, _DDP_IGNORED, [name for name, _ in model.named_parameters()])
    setattr(model, _ACCELERATE_PREPARED, True)
    old = _old_accelerate()
    if old is not None:  # said now, before the HF Trainer's DDP refuses the model with torch's words
        log.warning("accelerate %s is installed: before 1.14 it wraps every model in DDP when several processes run, "
                    "which refuses an offloaded one (\"DistributedDataParallel is not needed ...\"); with the HF Trainer, "
                    "pip install 'accelerate>=1.14'", old)

    def unmark() -> None:
        for name in (_DDP_IGNORED, _ACCELERATE_PREPARED):
            if name in model.__dict__:
                delattr(model, name)

    return unmark


def _old_accelerate() -> str | None:
    """The version of accelerate where the program has imported one older than 1.14 (the HF Trainer imports it),
    else None."""
    if "accelerate" not in sys.modules:
        return None
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("accelerate")
    except PackageNotFoundError:
        return None
    numbers = [int(part) for part in found.split(".")[:2] if part.isdigit()]
    return found if len(numbers) == 2 and tuple(numbers) < (1, 14) else None


@defers_interrupts
def _open_store(opened: list[TierStore], config: StoreConfig) -> None:
    """Build the session's store into ``opened``. SIGTERM and Ctrl-C are held while it is built ([Note: deferred
    interrupts]) and raised once it is in ``opened``, for the undo to close: one that landed inside the constructor,
    past its own undo, left a store nobody could close (its swap directory's lock file, its tmp directory on /dev/shm).
    Its long parts (zeroing and page-locking the pinned arena) are single C calls that no signal interrupts anyway."""
    opened.append(TierStore(config))


def _listen(session: OffloadSession, resolved: ResolvedPlan, device: torch.device) -> None:
    """The layers' recomputation (``placement.activations``) and the placement's listeners: the out-of-memory hint,
    and after the first step(s) either the measured placement (``runtime.planning.measured_placement``) or the hint
    that a lower activation reserve would put more on the GPU (``runtime.planning.peak_hint``)."""
    cfg, controller = session.config, session.controller
    if device.type == "cuda" and (resolved.measured_first_step or resolved.placement.activation_reserve_nbytes):
        install_oom_hint(session, _oom_hint)  # silent until auto placement has reserved something
    recompute = session.recompute = Recompute(session.blocks, session.model)
    session.on_close.append(recompute.undo)
    if cfg.placement.activations == "recompute":
        recompute.turn_on()
    if resolved.measured_first_step:
        peak, peak_what = cuda_step_peak(device)
        listener = FirstStepPlacement(
            plan_gpu_nbytes=session.plan.gpu_nbytes, budget_nbytes=session.store.tiers[TierName.GPU].capacity_nbytes,
            ask=placement_asker(session, may_stream=resolved.source is not WeightSource.WEIGHTS),
            adopt=functools.partial(_adopt_placement, weakref.ref(session)), peak=peak, peak_what=peak_what,
            reset_peak=cuda_peak_reset(device), report=functools.partial(_note_in_plan, weakref.ref(session)),
            pools=cuda_reserved_by_stream(device), trial=_recompute_trial(session, recompute, device))
        controller.step_listeners.append(listener)
        session.on_close.append(listener.close)  # a session closed before the trial ended takes the timer's hooks off
    elif (resolved.placement.activation_reserve_nbytes and device.type == "cuda"
          and cfg.optimizer.gpu_update_fraction == "auto" and cfg.tiers.gpu.activation_reserve == "auto"):
        # after the first steps: would a lower reserve put more on the GPU?
        controller.step_listeners.append(PeakHint(placement_figures(session), session.planned_blocks, placement_asker(session),
                                                  cuda_peak(device)))


def in_force(session: OffloadSession, *, may_stream: bool = False) -> InForce:
    """What the session's placement has fixed now (``runtime.planning.placement.InForce``); ``may_stream``: the first
    step's plan of ``runtime.planning.measured_placement`` kept every moment in pinned memory."""
    options = session.controller.options
    return InForce(gpu_budget_nbytes=session.store.tiers[TierName.GPU].capacity_nbytes, source=options.weight_source,
                   spills=bool(options.spilled_blocks), streams=bool(session.controller.gpu_streamed) or may_stream,
                   rates=session.placement.rates if session.placement else None)


def placement_asker(session: OffloadSession, *, may_stream: bool = False) -> Callable[[int], Placement | None]:
    """``runtime.planning.placement.placement_at_reserve`` for this session, through a weak reference (the controller
    must not keep its session alive through a listener); None once the session is gone or closed (a profile saved
    after ``close()`` asks nothing of a closed store)."""
    alive = weakref.ref(session)

    def ask(reserve_nbytes: int) -> Placement | None:
        live = alive()
        if live is None or live.closed:
            return None
        return placement_at_reserve(live.planned_blocks, live.config, live.store.device, in_force(live, may_stream=may_stream),
                                    reserve_nbytes)

    return ask


def _adopt_placement(session_ref: Callable[[], OffloadSession | None], placement: Placement) -> None:
    """Make ``placement`` (auto placement asked again after the first step) the session's: the controller moves the
    state, and the session's placement and plan say what now runs."""
    session = session_ref()
    if session is None or session.closed:
        return
    cfg, controller, options = session.config, session.controller, session.controller.options
    spilled = spilled_after(session.planned_blocks, cfg, options.homes, options.weight_source, options.spilled_blocks, placement,
                            session.store.tiers[TierName.HOST].capacity_nbytes)
    controller.adopt_placement(placement.gpu_update_fraction, placement.gpu_stream_fraction,
                               placement.keep_for_backward_nbytes, spilled)
    session.plan = adopted_plan(session.planned_blocks, cfg, options.homes, options.weight_source, placement,
                                spilled=len(controller.options.spilled_blocks), spares=session.plan.pre_commit_buffers)
    session.placement = placement


def _recompute_trial(session: OffloadSession, recompute: Recompute, device: torch.device) -> RecomputeTrial | None:
    """What ``placement.activations: auto`` lets the measured first step try (None: no trial; under ``auto`` the
    activations are then kept and the log says why, under ``recompute`` the layers already are)."""
    if session.config.placement.activations != "auto":
        return None
    if session.ranks is not None:
        # Several processes: each rank would decide from its own timings, and ranks recomputing and not recomputing
        # fetch their blocks in different orders ([Note: collectives in program order] in runtime.core.ranks).
        log.info("placement.activations auto: activations are kept with several processes (the model's own "
                 "checkpointing still recomputes; placement.activations: recompute turns tierstore's on)")
        return None
    blocks, controller = session.blocks, session.controller
    refusal = recompute_refusal(blocks, recompute.model)
    if refusal:
        log.info("placement.activations auto: activations are kept (%s)", refusal)
        return None
    return RecomputeTrial(recompute, ForwardTimer(recompute.modules, device),
                          lambda: controller.recomputed_acquires > 0 or already_checkpointed(blocks, recompute.model),
                          BufferWatch(recompute.modules))


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
    state = sum(session.store.record(session.blocks[i].key(kind)).meta.nbytes for i in controller.gpu_updated
                for kind in STATE_KINDS)
    return reserve_hint(requested_nbytes=requested, allocated_nbytes=allocated,
                        store_gpu_nbytes=session.store.tiers[TierName.GPU].used_nbytes,
                        reserve_nbytes=placement.activation_reserve_nbytes,
                        placed_nbytes=state + placement.keep_for_backward_nbytes,
                        recomputed=session.activations_recomputed)


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


LONG_SETUP_NBYTES = 8 << 30  # pinned memory from which setup takes long enough to report its progress


def _rank_directory(path: str | None, ranks: Ranks | None) -> str | None:
    """The swap directory of this process: ``tiers.nvme.path`` itself, or its ``rank<N>`` subdirectory where several
    processes run (each locks its own and keeps its own blocks' files there)."""
    if path is None or ranks is None:
        return path
    if not os.path.isdir(path):
        return path  # the store refuses it, naming tiers.nvme.path
    directory = rank_folder(path, ranks.rank)
    os.makedirs(directory, mode=0o700, exist_ok=True)
    return directory


def _options(cfg: TierstoreConfig, dtype: torch.dtype, resolved: ResolvedPlan, record_intervals: bool,
             int8_kernel: Int8Kernel | None = None, ranks: Ranks | None = None,
             blocks: list[Block] | None = None) -> RuntimeOptions:
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
        speculate=resolved.plan.pre_commit_buffers, moment_dtype=opt.moment_dtype, int8_kernel=int8_kernel,
        ranks=ranks, owners=() if ranks is None or blocks is None else
        tuple(assign_owners([block.numel for block in blocks], ranks.world_size)))
