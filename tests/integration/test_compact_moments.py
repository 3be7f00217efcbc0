"""Compact Adam moments (``optimizer.moment_dtype``) through the user's path, on the CPU: bf16 moments equal a plain
PyTorch loop whose AdamW (tests/bf16_reference.py's plain ops) keeps bf16 moments, bit for bit; int8 stays close to
fp32 and the loss falls; the moments live in each tier in their compact size (swap files included); ``state_dict()``
gives fp32 moments; checkpoints resume exactly within a format and load across formats."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from runtime import offload
from runtime.bundled.data import stdlib_text_bytes
from runtime.bundled.example_model import ExampleLM, ModelShape
from runtime.checkpoint.state import load_checkpoint, save_checkpoint
from runtime.update.moment_formats import round_bf16_stochastic, rounding_bits, rounding_offsets
from runtime.update.moments import BF16_STOCHASTIC_KINDS, decode_moment, encode_moment, moment_nbytes, moment_storage
from tests.bf16_reference import PlainAdamW
from tests.integration.checkpoint_training import tiny_config, train
from tests.integration.reference_loop import ReferenceTrainer
from tests.integration.test_parity import SHAPE, assert_identical, make_batches, nbytes_moved, steps_and_check
from tests.integration.test_speculation import early_jobs_run_before_their_verdict
from tierstore import HEADER_NBYTES, TierName, align_up

MOMENT_KINDS = ("exp_avg", "exp_avg_sq")
# int8 against fp32 moments, the same batches and init, lr 1e-3, INT8_STEPS steps: each step's loss within
# INT8_LOSS_SHARE of fp32's, and the masters' distance from fp32's (L2 over the model) at most INT8_UPDATE_SHARE of
# the distance fp32's training moved them from the init. Measured (2026-11-29, CPU): losses within 5e-5, distance
# 0.028 (bf16 moments: 0.0017); the bounds leave about 4x room.
INT8_LOSS_SHARE = 2e-4
INT8_UPDATE_SHARE = 0.1
INT8_STEPS = 12


def bf16_moment_reference(model: torch.nn.Module, grad_clip: float | None) -> ReferenceTrainer:
    """The plain loop (on fp32 parameters, its AdamW the plain-ops :class:`~tests.bf16_reference.PlainAdamW` with
    the trainer's hyper-parameters, bf16's arithmetic) keeping bf16 moments: after each step the moments are
    narrowed to bf16 and widened back, which is what storing them in bf16 is. The narrowing is the
    update's: stochastic rounding with the bits of each element's index in its block's flat buffer and its step
    (``follow_blocks`` gives the blocks' layout: each parameter's offset in its block, and its block's index, the
    seed the runtime rounds that block's moments with)."""
    reference = ReferenceTrainer(model, grad_clip=grad_clip)
    reference.optimizer = PlainAdamW(reference.masters, lr=reference.lr, weight_decay=reference.weight_decay)
    offsets: list[tuple[int, int]] = []  # (offset in the block's flat buffer, the block's index) per parameter
    reference.block_offsets = offsets  # type: ignore[attr-defined]

    def narrow(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        assert offsets, "call follow_blocks(reference, session) before the first step"
        for param, (offset, seed) in zip(reference.masters, offsets, strict=True):
            state = optimizer.state[param]
            for kind in MOMENT_KINDS if state else ():
                values = state[kind].reshape(-1)
                if kind not in BF16_STOCHASTIC_KINDS:
                    state[kind].copy_(state[kind].to(torch.bfloat16))
                    continue
                bits = torch.empty(values.numel(), dtype=torch.int32)
                rounding_bits(offset, rounding_offsets(state["step"].reshape(1), seed, kind)[0], bits)
                narrowed = torch.empty(values.numel(), dtype=torch.bfloat16)
                round_bf16_stochastic(values, bits, narrowed)
                values.copy_(narrowed)

    reference.optimizer.register_step_post_hook(narrow)
    return reference


def follow_blocks(reference: ReferenceTrainer, session) -> None:
    """Tell a bf16 reference where each parameter starts in its block's flat buffer (parameters in block order)."""
    offsets = getattr(reference, "block_offsets", None)
    if offsets is None:
        return
    offsets.clear()
    for block in session.blocks:
        start = 0
        for slot in block.slots:
            offsets.append((start, block.index))
            start += slot.numel


def train_offloaded(config: dict, steps: int, reference: ReferenceTrainer | None = None, events: list | None = None,
                    inspect=None, prepare=None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """``steps`` steps of the tiny model offloaded under ``config`` (the seed-0 init); each loss equals the
    reference's when one is given. Returns the losses and the final masters."""
    torch.manual_seed(0)
    model = ExampleLM(SHAPE)
    model, optimizer = offload(model, config)
    session = optimizer.session
    if reference is not None:
        follow_blocks(reference, session)
    if prepare is not None:
        prepare(session)
    if events is not None:
        session.store.bus.subscribe(events.append)
    losses = []
    with session:
        for x, y in make_batches(steps):
            loss = model(x, y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            if reference is not None:
                assert losses[-1] == reference.train_step([(x, y)])[0], f"step {len(losses)}"
        if inspect is not None:
            inspect(session, optimizer)
        masters = session.master_state_dict()
    return losses, masters


def config_of(moment_dtype: str, **optimizer) -> dict:
    # moment_kernel torch: the same update on every machine, no build in the quick suite (the compiled kernel's
    # training is tests/integration/test_moment_kernel_training.py's, slow)
    return {"dtype": "fp32", "device": "cpu",
            "optimizer": {"grad_clip": None, "moment_dtype": moment_dtype, "moment_kernel": "torch", **optimizer}}


@pytest.mark.parametrize("grad_clip", [None, 1e6, 0.05], ids=["streaming", "early-published", "early-redone"])
def test_bf16_moments_equal_a_plain_loop_keeping_bf16_moments(grad_clip):
    """Bit for bit, step by step, in the losses, the fp32 masters and the moments; with the clip the updates run
    early into the spare buffers (out of place) and are published (a clip that does not bind) or redone."""
    torch.manual_seed(0)
    reference = bf16_moment_reference(ExampleLM(SHAPE), grad_clip)
    seen = {}

    def inspect(session, optimizer):
        seen["state"] = optimizer.state_dict()["state"]
        seen["worker"] = session.controller.worker.stats

    # With a clip, the commit's verdict waits for the worker to have started each early job (a verdict on a job still
    # queued withdraws it: exact too, but then neither the publish nor the redo is exercised, as on a loaded machine).
    prepare = early_jobs_run_before_their_verdict if grad_clip is not None else None
    _, masters = train_offloaded(config_of("bf16", grad_clip=grad_clip), 5, reference, inspect=inspect, prepare=prepare)
    assert_identical(masters, reference)
    theirs = [reference.optimizer.state[p] for p in reference.masters]
    for index, state in seen["state"].items():
        for kind in MOMENT_KINDS:
            assert torch.equal(state[kind], theirs[index][kind]), (index, kind)
    if grad_clip == 1e6:
        assert seen["worker"].published > 0
    if grad_clip == 0.05:
        assert seen["worker"].redone > 0


def test_int8_moments_stay_close_to_fp32_and_the_loss_falls():
    torch.manual_seed(0)
    init = {name: p.detach().clone() for name, p in ExampleLM(SHAPE).named_parameters()}
    fp32_losses, fp32_masters = train_offloaded(config_of("fp32"), INT8_STEPS)
    int8_losses, int8_masters = train_offloaded(config_of("int8"), INT8_STEPS)
    assert int8_losses[0] == fp32_losses[0]  # the first step's forward precedes any update
    for ours, theirs in zip(int8_losses, fp32_losses, strict=True):
        assert abs(ours - theirs) <= INT8_LOSS_SHARE * theirs
    assert int8_losses[-1] < int8_losses[0] - 0.1

    def distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
        return sum(float(((a[name] - b[name]) ** 2).sum()) for name in a) ** 0.5

    apart = distance(int8_masters, fp32_masters)
    assert 0 < apart <= INT8_UPDATE_SHARE * distance(fp32_masters, init)  # int8 is approximate, and close


@pytest.mark.parametrize("moment_dtype", ["fp32", "bf16", "int8"])
def test_moments_on_nvme_in_their_compact_size(tmpfs_dir, moment_dtype):
    """placement.moments: nvme: each step reads and writes every moment's swap file, whose payload is the compact
    size; bf16 there stays bit for bit the bf16 reference's."""
    config = {**config_of(moment_dtype), "tiers": {"nvme": {"path": str(tmpfs_dir)}},
              "placement": {"moments": "nvme", "master": "host"}}
    torch.manual_seed(0)
    reference = bf16_moment_reference(ExampleLM(SHAPE), None) if moment_dtype == "bf16" else None
    events: list = []
    sizes: dict[str, int] = {}

    def inspect(session, optimizer):
        for block in session.blocks:
            for kind in MOMENT_KINDS:
                record = session.store.record(block.key(kind))
                assert record.home is TierName.NVME
                expected = moment_nbytes(moment_dtype, [slot.numel for slot in block.slots])
                assert record.meta.nbytes == expected
                sizes[block.key(kind)] = expected
        files = [p for p in Path(tmpfs_dir).rglob("*") if p.is_file() and any(k in p.name for k in MOMENT_KINDS)]
        assert len(files) == len(sizes)
        on_disk = sorted(p.stat().st_size for p in files)
        assert on_disk == sorted(HEADER_NBYTES + align_up(n, 4096) for n in sizes.values())

    steps = 3
    _, masters = train_offloaded(config, steps, reference, events, inspect=inspect)
    if reference is not None:
        assert_identical(masters, reference)
    # Every step writes each moment back in its stored size (the only NVMe state here) and reads it from the second on.
    moments = sum(sizes.values())
    assert nbytes_moved(events, "write") == moments * steps
    assert nbytes_moved(events, "read") >= moments * (steps - 1)


@pytest.mark.parametrize("moment_dtype", ["bf16", "int8"])
def test_state_dict_gives_fp32_moments_of_the_parameters_shapes_and_load_encodes(moment_dtype):
    torch.manual_seed(0)
    model = ExampleLM(SHAPE)
    shapes = [tuple(p.shape) for p in model.parameters()]
    model, optimizer = offload(model, config_of(moment_dtype))
    with optimizer.session:
        for x, y in make_batches(2):
            model(x, y).backward()
            optimizer.step()
            optimizer.zero_grad()
        state = optimizer.state_dict()
        for index, shape in enumerate(shapes):
            for kind in MOMENT_KINDS:
                assert state["state"][index][kind].dtype == torch.float32
                assert tuple(state["state"][index][kind].shape) == shape
        assert state["state"][0]["exp_avg"].abs().sum() > 0
        # Loading fp32 moments encodes them: bf16 values come back as they were, int8 ones quantized again (within
        # a few codes of the largest value of the parameter).
        optimizer.load_state_dict(state)
        again = optimizer.state_dict()
        for index in state["state"]:
            for kind in MOMENT_KINDS:
                before, after = state["state"][index][kind], again["state"][index][kind]
                if moment_dtype == "bf16":
                    assert torch.equal(after, before), (index, kind)
                else:
                    assert (after - before).abs().max() <= 0.05 * before.abs().max(), (index, kind)


def moments_by_block(session, optimizer) -> dict[int, dict[str, torch.Tensor]]:
    """Each block's flat fp32 moments from ``optimizer.state_dict()`` (one group: the parameters in block order)."""
    state = optimizer.state_dict()["state"]
    out, index = {}, 0
    for block in session.blocks:
        parts: dict[str, list[torch.Tensor]] = {kind: [] for kind in MOMENT_KINDS}
        for _slot in block.slots:
            for kind in MOMENT_KINDS:
                parts[kind].append(state[index][kind].reshape(-1))
            index += 1
        out[block.index] = {kind: torch.cat(parts[kind]) for kind in MOMENT_KINDS}
    return out


@pytest.mark.parametrize("device_share", [False, True], ids=["host", "device-share-alternating"])
def test_checkpoints_load_across_formats(tmp_path, caplog, device_share):
    """fp32 -> int8 -> bf16 -> fp32: each load decodes the saved format and encodes into the run's (said once), so
    the moments a run reads are the saved ones put through its format; the masters come through unchanged. With
    ``device_share`` every other run updates some blocks on the device (their moments saved from and loaded into the
    device tier)."""
    chain = ["fp32", "int8", "bf16", "fp32"]
    previous: dict[int, dict[str, torch.Tensor]] | None = None
    masters: dict[str, torch.Tensor] | None = None
    for number, moment_dtype in enumerate(chain):
        torch.manual_seed(0)
        shares = {"gpu_update_fraction": 0.4, "gpu_stream_fraction": 0.3} if device_share and number % 2 == 0 else {}
        model, optimizer = offload(ExampleLM(SHAPE), config_of(moment_dtype, **shares))
        session = optimizer.session
        with session:
            if previous is None:
                for x, y in make_batches(2):
                    model(x, y).backward()
                    optimizer.step()
                    optimizer.zero_grad()
            else:
                caplog.clear()
                with caplog.at_level(logging.INFO, logger="runtime.checkpoint.state"):
                    assert load_checkpoint(session, tmp_path / chain[number - 1]) == 2
                said = [r for r in caplog.records if "Adam moments" in r.getMessage()]
                assert len(said) == 1 and chain[number - 1] in said[0].getMessage()
                ours = moments_by_block(session, optimizer)
                for block in session.blocks:
                    sizes = [slot.numel for slot in block.slots]
                    for kind in MOMENT_KINDS:
                        dtype, numel = moment_storage(moment_dtype, sizes)
                        stored = torch.empty(numel, dtype=dtype)
                        encode_moment(previous[block.index][kind], moment_dtype, kind, sizes, stored)
                        expected = decode_moment(stored, moment_dtype, kind, sizes)
                        assert torch.equal(ours[block.index][kind], expected), (moment_dtype, block.name, kind)
                now = session.master_state_dict()
                assert masters is not None and all(torch.equal(now[k], masters[k]) for k in masters)
            previous = moments_by_block(session, optimizer)
            masters = session.master_state_dict()
            if number < len(chain) - 1:
                save_checkpoint(session, tmp_path / moment_dtype)


@pytest.mark.parametrize("moment_dtype", ["bf16", "int8"])
def test_resume_within_one_format_is_exact(tmp_path, moment_dtype):
    """Stopped at step 3 and resumed (the moments in swap files before, in host memory after): the losses equal an
    uninterrupted run's bit for bit, and the checkpoint's meta records the format."""
    import json

    total = 6
    for name in ("ref", "a", "b"):
        (tmp_path / name).mkdir()

    def config(swap: Path, moments: str) -> dict:
        return tiny_config(swap, moments=moments, optimizer={"moment_dtype": moment_dtype})

    corpus = stdlib_text_bytes(1 << 20)
    reference = train(config(tmp_path / "ref", "nvme"), corpus, total)
    first = train(config(tmp_path / "a", "nvme"), corpus, total, checkpoint_dir=tmp_path / "ckpt", save_every=3,
                  stop_after=3)
    meta = json.loads((tmp_path / "ckpt" / "step-000003" / "meta.json").read_text())
    assert meta["moment_dtype"] == moment_dtype
    moment_files = [entry for key, entry in meta["tensors"].items() if key.endswith(MOMENT_KINDS)]
    assert moment_files and {entry["dtype"] for entry in moment_files} == {{"bf16": "bfloat16", "int8": "uint8"}[moment_dtype]}
    second = train(config(tmp_path / "b", "host"), corpus, total, checkpoint_dir=tmp_path / "ckpt", resume=True)
    assert {**first, **second} == reference


SPILL_SHAPE = ModelShape(vocab_size=256, hidden_size=64, num_layers=8, num_heads=4, ffn_size=128, max_seq_len=64)


def _layout(name: str, swap: str) -> tuple[dict, ModelShape, int]:
    """(config extras, model shape, micro-batches a step) of a layout the bf16 moments must not change."""
    if name == "host-sums":  # micro-batch gradients summed in host memory, then one update
        return {"optimizer": {"accumulation_steps": 2, "accumulate_on": "host"}}, SHAPE, 2
    if name == "all-nvme":  # master on NVMe too: the weights come from a host copy refreshed after each update
        return {"placement": {"master": "nvme", "moments": "nvme"}, "tiers": {"nvme": {"path": swap}}}, SHAPE, 1
    # placement.moments: auto under a host budget 32 KiB short of the plan: some blocks' moments spill to NVMe
    return {"placement": {"moments": "auto"}, "tiers": {"nvme": {"path": swap}}, "blocks": {"min_block_size": 1}}, SPILL_SHAPE, 1


@pytest.mark.parametrize("layout", ["host-sums", "all-nvme", "spill"])
def test_bf16_moments_stay_exact_in_other_layouts(layout, tmpfs_dir):
    extra, shape, micro = _layout(layout, str(tmpfs_dir))
    config = config_of("bf16")
    for section, values in extra.items():
        config.setdefault(section, {}).update(values)
    if layout == "spill":
        torch.manual_seed(0)
        _, probe = offload(ExampleLM(shape), {**config, "tiers": {**config["tiers"], "host": {"budget": 1 << 30}}})
        with probe.session:
            config["tiers"]["host"] = {"budget": probe.session.plan.host_nbytes - 2 * 16384}
    torch.manual_seed(0)
    reference = bf16_moment_reference(ExampleLM(shape), None)
    reference.accumulation_steps = micro
    torch.manual_seed(0)
    model, optimizer = offload(ExampleLM(shape), config)
    session = optimizer.session
    follow_blocks(reference, session)
    with session:
        if layout == "spill":
            assert 0 < len(session.controller.options.spilled_blocks) < len(session.blocks)
        batches = make_batches(4 * micro)
        for step in range(4):
            steps_and_check(model, optimizer, reference, batches[step * micro : (step + 1) * micro], f"step {step + 1}")
        assert_identical(session.master_state_dict(), reference)


# The device's share of the update (on the CPU the "device" is the CPU: the same code over CPU tensors standing in).
DEVICE_SHARES = [(0.5, 0.0), (0.0, 0.6), (0.3, 0.4)]


@pytest.mark.parametrize("grad_clip", [None, 0.05], ids=["streaming", "clipped"])
@pytest.mark.parametrize("update_fraction, stream_fraction", DEVICE_SHARES, ids=["updated", "streamed", "both"])
def test_bf16_moments_updated_on_the_device_equal_the_plain_loop(update_fraction, stream_fraction, grad_clip):
    torch.manual_seed(0)
    reference = bf16_moment_reference(ExampleLM(SHAPE), grad_clip)
    seen = {}

    def inspect(session, optimizer):
        seen["updated"], seen["streamed"] = session.controller.gpu_updated, session.controller.gpu_streamed
        seen["state"] = optimizer.state_dict()["state"]

    config = config_of("bf16", grad_clip=grad_clip, gpu_update_fraction=update_fraction,
                       gpu_stream_fraction=stream_fraction)
    _, masters = train_offloaded(config, 4, reference, inspect=inspect)
    assert_identical(masters, reference)
    assert bool(seen["updated"]) == (update_fraction > 0) and bool(seen["streamed"]) == (stream_fraction > 0)
    theirs = [reference.optimizer.state[p] for p in reference.masters]
    for index, state in seen["state"].items():  # read from the device tier for the device-updated blocks
        for kind in MOMENT_KINDS:
            assert torch.equal(state[kind], theirs[index][kind]), (index, kind)


def test_int8_moments_updated_on_the_device_match_the_cpu_update():
    """The device update runs the same kernel as the worker's: an int8 run with a GPU share equals one without, bit
    for bit (on the CPU both run on CPU tensors; on a GPU the kernels' rounding may differ)."""
    cpu_losses, cpu_masters = train_offloaded(config_of("int8"), 4)
    device_losses, device_masters = train_offloaded(config_of("int8", gpu_update_fraction=0.3, gpu_stream_fraction=0.4), 4)
    assert device_losses == cpu_losses
    assert all(torch.equal(device_masters[name], cpu_masters[name]) for name in cpu_masters)


def test_a_placement_adopted_between_steps_moves_compact_moments_to_the_device():
    """What the measured first step does on a GPU (``Controller.adopt_placement``): the first blocks' master and int8
    moments move to the device tier, as stored, and training goes on as if they had not moved."""
    stay_losses, stay_masters = train_offloaded(config_of("int8"), 4)
    torch.manual_seed(0)
    model, optimizer = offload(ExampleLM(SHAPE), config_of("int8"))
    session = optimizer.session
    losses = []
    with session:
        for step, (x, y) in enumerate(make_batches(4)):
            if step == 1:
                before = moments_by_block(session, optimizer)
                session.controller.adopt_placement(0.4, 0.3, 0)
                moved = session.controller.gpu_updated
                assert moved and all(session.store.record(session.blocks[i].key(kind)).home is TierName.GPU
                                     for i in moved for kind in MOMENT_KINDS)
                after = moments_by_block(session, optimizer)
                assert all(torch.equal(after[i][kind], before[i][kind]) for i in before for kind in MOMENT_KINDS)
            loss = model(x, y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        masters = session.master_state_dict()
    assert losses == stay_losses
    assert all(torch.equal(masters[name], stay_masters[name]) for name in stay_masters)
