"""Gradient accumulation summed in host memory (``optimizer.accumulate_on: host``) equals a plain loop's, bit for
bit in fp32 on the CPU (and under bf16 the plain bf16 loop's, whose ``.grad`` sums in bf16 as the host sums do):
without clipping, with a clip coefficient below 1 and of exactly 1 (early updates), with activation checkpointing,
tied embeddings and fp16 overflow steps. The gradients of the micro-batches that do not end a step really leave the
device (bytes counted) and the parameters hold no gradient between micro-batches."""

from __future__ import annotations

import pytest
import torch

from runtime import offload
from runtime.bundled.example_model import ExampleLM, ModelShape
from runtime.engine.clipping import OffloadedGrad
from tests.integration.reference_loop import ReferenceTrainer
from tests.integration.test_parity import SHAPE, assert_identical, make_batches

STEPS = 3


def train_both(config: dict, accumulation: int, *, shape: ModelShape = SHAPE, checkpointing: bool = False,
               dtype: torch.dtype = torch.float32, loss_scale: float | None = None, steps: int = STEPS,
               grad_dtype: torch.dtype | None = None):
    """Both loops on the same micro-batches; ``grad_dtype``: the host gradient dtype the session must have."""
    torch.manual_seed(0)
    model = ExampleLM(shape, activation_checkpointing=checkpointing)
    opt = config.setdefault("optimizer", {})
    opt.update(accumulation_steps=accumulation, accumulate_on="host")
    opt.setdefault("grad_clip", None)
    reference = ReferenceTrainer(model, dtype=dtype, grad_clip=opt["grad_clip"], accumulation_steps=accumulation,
                                 loss_scale=loss_scale)
    model, optimizer = offload(model, config)
    session = optimizer.session
    sums = session.controller.sums
    assert sums is not None, "accumulate_on: host did not give the session host sums"
    batches = make_batches(steps * accumulation)
    ours, theirs = [], []
    host_grad_dtype = session.store.record(session.blocks[0].key("grad")).meta.dtype
    assert grad_dtype is None or host_grad_dtype == grad_dtype
    itemsize = host_grad_dtype.itemsize
    with session:
        for step in range(steps):
            micro = batches[step * accumulation : (step + 1) * accumulation]
            for position, (x, y) in enumerate(micro):
                loss = model(x, y)
                ours.append(loss.item())
                optimizer.scale_loss(loss).backward()
                if position < accumulation - 1:  # the device keeps nothing between micro-batches
                    assert all(isinstance(p.grad, OffloadedGrad) for p in model.parameters())
                    with pytest.raises(RuntimeError, match="summed in host memory.*accumulate_on: gpu"):
                        next(model.parameters()).grad.abs()  # its norm is served (from the host sum), not its values
            optimizer.step()
            optimizer.zero_grad()
            theirs += reference.train_step(micro)
        weights = session.master_state_dict()
        stats = session.controller.stats
    hosted = sum(block.numel for block in session.blocks)
    # Every non-final gradient left the device, in the host gradient dtype (fp32, or bf16 under bf16: the default).
    assert sums.stats.nbytes == steps * (accumulation - 1) * hosted * itemsize
    return ours, theirs, weights, reference, stats


@pytest.mark.parametrize("accumulation", [2, 3])
def test_host_sums_equal_the_plain_loop(accumulation):
    ours, theirs, weights, reference, _ = train_both({"dtype": "fp32"}, accumulation)
    assert ours == theirs
    assert_identical(weights, reference)


@pytest.mark.parametrize("clip", [None, 0.05, 1e6], ids=["no-clip", "clipped", "clip-not-binding"])
def test_bf16_host_sums_equal_the_plain_bf16_loop_bit_for_bit(clip):
    """Under bf16 the host gradients are bf16 (``optimizer.host_grad_dtype: auto``): the micro-batches sum in bf16 in
    their order, as the plain loop's bf16 ``.grad`` accumulates, and the CPU widens the sum to fp32 for the clip and
    AdamW, as the plain loop's fp32 masters take it. Bit for bit on the CPU, half the bytes across."""
    config = {"dtype": "bf16", "optimizer": {"grad_clip": clip}}
    ours, theirs, weights, reference, stats = train_both(config, 3, dtype=torch.bfloat16, grad_dtype=torch.bfloat16)
    assert ours == theirs
    assert_identical(weights, reference)
    if clip == 0.05:
        assert min(stats.grad_norms) > 0.05  # every step clipped


def test_fp32_host_sums_under_bf16_differ_from_the_plain_bf16_loop_by_rounding():
    """``host_grad_dtype: fp32`` under bf16: the sums are exact to fp32, so the weights differ from the plain bf16
    loop's (whose ``.grad`` rounds at each micro-batch), by rounding only."""
    config = {"dtype": "bf16", "optimizer": {"host_grad_dtype": "fp32"}}
    ours, theirs, weights, reference, _ = train_both(config, 3, dtype=torch.bfloat16)
    assert ours[:3] == theirs[:3]  # the first step's losses, before any update
    expected = reference.master_state()
    assert any(not torch.equal(weights[name], expected[name]) for name in expected)
    for name in expected:  # within bf16 rounding of the sums: a relative norm, as the GPU tests compare
        difference = (weights[name] - expected[name]).double().norm() / expected[name].double().norm()
        assert difference < 1e-2, name


def test_host_sums_in_pieces_that_cut_across_parameters_equal_the_plain_loop(monkeypatch):
    """Pieces of 7 elements: each micro-batch's gradient leaves the device built a piece at a time from the
    parameters' gradients (a piece holds the end of one parameter and the start of the next), and the last
    micro-batch brings the host sum in a piece at a time; the result is the plain loop's, bit for bit."""
    monkeypatch.setattr("runtime.engine.host_sums.PIECE_NUMEL", 7)
    ours, theirs, weights, reference, stats = train_both({"dtype": "fp32", "optimizer": {"grad_clip": 0.05}}, 3)
    assert ours == theirs
    assert_identical(weights, reference)
    assert min(stats.grad_norms) > 0.05  # every step clipped: the updates read the summed gradients after the commit


def test_host_sums_with_a_clip_below_one_and_checkpointing():
    ours, theirs, weights, reference, stats = train_both({"dtype": "fp32", "optimizer": {"grad_clip": 0.05}}, 2,
                                                         checkpointing=True)
    assert ours == theirs
    assert_identical(weights, reference)
    assert min(stats.grad_norms) > 0.05  # every step clipped


def test_host_sums_with_a_clip_that_keeps_early_updates():
    ours, theirs, weights, reference, stats = train_both({"dtype": "fp32", "optimizer": {"grad_clip": 1e6}}, 2)
    assert ours == theirs
    assert_identical(weights, reference)
    assert stats.early_updates > 0  # the last micro-batch's updates ran before the commit and were kept


def test_host_sums_with_tied_embeddings():
    shape = ModelShape(vocab_size=256, hidden_size=32, num_layers=2, num_heads=4, ffn_size=64, tie_embeddings=True)
    ours, theirs, weights, reference, _ = train_both({"dtype": "fp32"}, 2, shape=shape)
    assert ours == theirs
    assert_identical(weights, reference)


def test_host_sums_of_fp16_gradients_skip_overflow_steps_like_the_reference():
    # 2**18 overflows the first three steps' fp16 gradients; the last three update. The reference sums its
    # micro-batches' fp16 gradients in fp16 (its .grad), the host in fp32, so the updated weights agree to the
    # fp16 sum's rounding, not bit for bit; every loss before the first update is equal.
    config = {"dtype": "fp16", "optimizer": {"grad_clip": 1.0, "loss_scale": {"initial": 2.0**18}}}
    ours, theirs, weights, reference, stats = train_both(config, 2, dtype=torch.float16, loss_scale=2.0**18, steps=6)
    assert 1 <= reference.skipped < 6 and stats.skipped_steps == reference.skipped
    before_update = 2 * (reference.skipped + 1)
    assert ours[:before_update] == theirs[:before_update]
    expected = reference.master_state()
    for name in expected:
        torch.testing.assert_close(weights[name], expected[name], rtol=0, atol=1e-4)


def test_a_backward_waiting_for_the_host_sums_is_reported_as_its_own_stall(monkeypatch):
    """When the CPU sums fall behind, the backward waits for a buffer: the profiler hears it as a 'grad_sum'
    stall (shown as 'sum buffer'), not as time nobody accounts for."""
    import time

    import runtime.engine.host_sums
    from runtime.core.events import STALL_GRAD_SUM
    from runtime.profiler.report import CAUSE_NAMES

    monkeypatch.setattr(runtime.engine.host_sums, "STAGING_SLOTS", 2)  # fewer buffers than this model's blocks
    torch.manual_seed(0)
    model, optimizer = offload(ExampleLM(SHAPE), {"dtype": "fp32", "optimizer": {
        "grad_clip": None, "accumulation_steps": 2, "accumulate_on": "host"}})
    session = optimizer.session
    sums = session.controller.sums
    slow = sums._sum
    sums._sum = lambda pending: (time.sleep(0.3), slow(pending))  # a CPU that sums slower than any backward
    stalls = []
    session.controller.stall_listeners.append(stalls.append)
    with session:
        assert len(session.blocks) > len(sums._staging)  # more blocks than buffers: a backward must wait
        for x, y in make_batches(2):
            model(x, y).backward()
        optimizer.step()
    waits = [s for s in stalls if s.cause == STALL_GRAD_SUM]
    assert waits and sum(s.seconds for s in waits) > 0.02
    assert CAUSE_NAMES[STALL_GRAD_SUM] == "sum buffer"


@pytest.mark.parametrize("set_to_none", [True, False])
def test_model_zero_grad_between_micro_batches_drops_the_host_sum_like_plain_pytorch(set_to_none):
    """A plain loop's model.zero_grad() after micro-batch 1 of 3 drops what .grad summed so far; the host sums
    drop it too (before, the host kept it and the weights came out different)."""
    import copy

    torch.manual_seed(0)
    plain = ExampleLM(SHAPE)
    model = copy.deepcopy(plain)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3, weight_decay=0.01, fused=True)
    model, optimizer = offload(model, {"dtype": "fp32", "optimizer": {
        "grad_clip": None, "accumulation_steps": 3, "accumulate_on": "host"}})
    batches = make_batches(6)
    with optimizer.session as session:
        for step in range(2):
            for which, opt in ((model, optimizer), (plain, plain_opt)):
                for micro, (x, y) in enumerate(batches[3 * step : 3 * step + 3]):
                    which(x, y).backward()
                    if micro == 1 and step == 0:
                        which.zero_grad(set_to_none=set_to_none)
                opt.step()
                opt.zero_grad()
        weights = session.master_state_dict()
    expected = dict(plain.named_parameters())
    for name, value in weights.items():
        assert torch.equal(value, expected[name].detach()), name


def test_a_dropped_step_gives_back_the_room_of_the_moments_read_early(tmpfs_dir):
    """Moments spilled to NVMe are read during the micro-batches; optimizer.zero_grad() before step() drops the
    step, and those copies must give their room back: reading the optimizer state afterwards needs it."""
    from runtime.config.loader import load_config
    from runtime.core.blocks import build_blocks
    from runtime.planning.memory_plan import PRE_COMMIT_BUFFERS
    from runtime.planning.placement import resolve_plan
    from runtime.planning.settings import resolve_device

    base = {"dtype": "fp32", "tiers": {"nvme": {"path": str(tmpfs_dir)}}, "placement": {"moments": "auto"},
            "optimizer": {"grad_clip": 0.05, "accumulation_steps": 2, "accumulate_on": "host"}}
    shape = ModelShape(vocab_size=256, hidden_size=32, num_layers=10, num_heads=4, ffn_size=64, max_seq_len=64)
    blocks = build_blocks(ExampleLM(shape), load_config(base).blocks.min_block_size)
    plan = resolve_plan(blocks, load_config(base), resolve_device(load_config(base))).plan
    spares = sum(nbytes for kind, _, nbytes in plan.rows if kind == PRE_COMMIT_BUFFERS)
    base["tiers"]["host"] = {"budget": plan.host_nbytes - spares - 8192}
    torch.manual_seed(0)
    model, optimizer = offload(ExampleLM(shape), base)
    batches = make_batches(4)
    with optimizer.session as session:
        assert session.controller.options.spilled_blocks
        for x, y in batches[:2]:
            model(x, y).backward()
        optimizer.step()
        optimizer.zero_grad()
        model(*batches[2]).backward()  # micro-batch 0 of step 2: the early reads start
        assert session.controller.stats.early_reads > 0
        optimizer.zero_grad()  # the step is dropped
        state = optimizer.state_dict()  # reads every block's moments through the same room
        assert len(state["state"]) == sum(len(b.slots) for b in session.blocks)


def test_a_script_that_ends_mid_accumulation_without_close_exits_cleanly():
    """The sums' thread and buffers go at interpreter exit (before the store they write into), with a
    micro-batch's gradient still on its way into the host sum and no close() called."""
    import subprocess
    import sys

    script = (
        "import torch\n"
        "from runtime import offload\n"
        "from runtime.bundled.example_model import ExampleLM\n"
        "from tests.integration.test_parity import SHAPE, make_batches\n"
        "model, optimizer = offload(ExampleLM(SHAPE), {'dtype': 'fp32', 'optimizer': {'grad_clip': None,\n"
        "    'accumulation_steps': 4, 'accumulate_on': 'host'}})\n"
        "assert optimizer.session.controller.sums is not None\n"
        "for i, (x, y) in enumerate(make_batches(6)):\n"
        "    model(x, y).backward()\n"
        "    if i % 4 == 3:\n"
        "        optimizer.step()\n"
        "        optimizer.zero_grad()\n"
        "assert optimizer.session.controller.micro == 2  # two micro-batches summed on the host, no step\n"
        "print('END', flush=True)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("END") and "Traceback" not in done.stderr and "Fatal" not in done.stderr
