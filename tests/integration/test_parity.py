"""Parity: training with offload equals a plain PyTorch loop, step by step (bit-identical in fp32 on CPU)."""

from __future__ import annotations

import time

import pytest
import torch

from runtime import offload
from runtime.bundled.data import ByteBatches, stdlib_text_bytes
from runtime.bundled.example_model import ExampleLM, ModelShape
from tests.integration.reference_loop import ReferenceTrainer
from tierstore import TierName

SHAPE = ModelShape(vocab_size=256, hidden_size=32, num_layers=3, num_heads=4, ffn_size=64, max_seq_len=64)
STEPS = 4


def make_batches(num: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    data = ByteBatches(stdlib_text_bytes(1 << 20), batch_size=2, seq_len=32, seed=seed)
    return [data.next() for _ in range(num)]


def force_weights_copy(monkeypatch) -> None:
    """Make resolve_plan consider (and so take, when it fits) the compute-dtype weights copy on the CPU, as it does
    on a GPU under accumulation."""
    import runtime.planning.placement as placement
    from runtime.planning.memory_plan import WeightSource

    monkeypatch.setattr(placement, "copy_fetch_may_pay", lambda cfg, device, source: source is WeightSource.MASTER
                        and cfg.optimizer.accumulation_steps > 1)


def run_both(config: dict, shape: ModelShape = SHAPE, steps: int = STEPS, checkpointing: bool = False,
             dtype: torch.dtype = torch.float32, loss_scale: float | None = None, inspect=None, prepare=None,
             loss_scale_growth_interval: int = 2000):
    """Train the same model with offload and with the reference; return both loss lists, both weights,
    the transfer events and the session's stats. ``prepare(session)`` runs before training, ``inspect(session)``
    after it, before close."""
    torch.manual_seed(0)
    model = ExampleLM(shape, activation_checkpointing=checkpointing)
    opt_cfg = config.setdefault("optimizer", {})
    opt_cfg.setdefault("grad_clip", None)
    accumulation = opt_cfg.get("accumulation_steps", 1)
    reference = ReferenceTrainer(model, dtype=dtype, grad_clip=opt_cfg["grad_clip"], accumulation_steps=accumulation,
                                 loss_scale=loss_scale, growth_interval=loss_scale_growth_interval)
    model, optimizer = offload(model, config)
    session = optimizer.session
    events = []
    session.store.bus.subscribe(events.append)
    batches = make_batches(steps * accumulation)
    ours, theirs = [], []
    try:
        if prepare is not None:
            prepare(session)
        for step in range(steps):
            micro = batches[step * accumulation : (step + 1) * accumulation]
            for x, y in micro:
                loss = model(x, y)
                ours.append(loss.item())
                optimizer.scale_loss(loss).backward()
            optimizer.step()
            optimizer.zero_grad()
            theirs += reference.train_step(micro)
        weights = session.master_state_dict()
        stats = (session.controller.stats, session.controller.schedule.stats, session.controller.worker.stats)
        if inspect is not None:
            inspect(session)
    finally:
        session.close()
    return ours, theirs, weights, reference, events, stats


def step_and_check(model, optimizer, reference: ReferenceTrainer, x: torch.Tensor, y: torch.Tensor) -> None:
    """One offloaded training step and one reference step on the same batch; their losses must be equal."""
    steps_and_check(model, optimizer, reference, [(x, y)])


def steps_and_check(model, optimizer, reference: ReferenceTrainer, micro_batches: list, what: str = "") -> None:
    """One offloaded optimizer step over ``micro_batches`` (a backward each) and the reference's over the same; each
    micro-batch's loss must be equal."""
    ours = []
    for x, y in micro_batches:
        loss = model(x, y)
        loss.backward()
        ours.append(loss.item())
    optimizer.step()
    optimizer.zero_grad()
    assert ours == reference.train_step(micro_batches), what


def train_with_the_users_clip(max_norm: float, prepare=None):
    """Four steps of a loop that calls clip_grad_norm_(max_norm) before step() (``optimizer.user_grad_clip``), each
    loss and the final weights equal to the plain loop's; ``prepare(session)`` runs first. Returns the closed
    session, whose statistics the caller reads."""
    torch.manual_seed(0)
    model = ExampleLM(SHAPE)
    reference = ReferenceTrainer(model, grad_clip=max_norm)
    model, optimizer = offload(model, {"dtype": "fp32", "optimizer": {"grad_clip": None, "user_grad_clip": True}})
    session = optimizer.session
    if prepare is not None:
        prepare(session)
    with session:
        for x, y in make_batches(4):
            loss = model(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            optimizer.step()
            optimizer.zero_grad()
            assert loss.item() == reference.train_step([(x, y)])[0]
        assert_identical(session.master_state_dict(), reference)
    return session


def assert_identical(weights: dict[str, torch.Tensor], reference: ReferenceTrainer) -> None:
    expected = reference.master_state()
    assert weights.keys() == expected.keys()
    for name in expected:
        assert torch.equal(weights[name], expected[name]), f"{name} differs by {(weights[name] - expected[name]).abs().max()}"


def nbytes_moved(events, kind: str) -> int:
    return sum(e.nbytes for e in events if e.kind == kind)


def test_fp32_states_on_nvme_bit_identical(tmpfs_dir):
    config = {"dtype": "fp32", "tiers": {"nvme": {"path": str(tmpfs_dir)}}, "placement": {"moments": "nvme", "master": "host"}}
    ours, theirs, weights, reference, events, _ = run_both(config)
    assert ours == theirs
    assert_identical(weights, reference)
    # The moments really lived on NVMe: read before and written after every update.
    moments_nbytes = 2 * 4 * sum(p.numel() for p in reference.masters)
    assert nbytes_moved(events, "read") >= moments_nbytes * (STEPS - 1)
    assert nbytes_moved(events, "write") >= moments_nbytes * STEPS


def test_fp32_master_on_nvme_weights_from_host_copy(tmpfs_dir):
    config = {"dtype": "fp32", "tiers": {"nvme": {"path": str(tmpfs_dir)}}, "placement": {"moments": "nvme", "master": "nvme"}}
    ours, theirs, weights, reference, events, _ = run_both(config)
    assert ours == theirs
    assert_identical(weights, reference)
    assert nbytes_moved(events, "write") >= 3 * 4 * sum(p.numel() for p in reference.masters) * STEPS


def test_fp32_gradient_accumulation():
    ours, theirs, weights, reference, _, _ = run_both({"dtype": "fp32", "optimizer": {"accumulation_steps": 3}})
    assert len(ours) == 3 * STEPS
    assert ours == theirs
    assert_identical(weights, reference)


def test_fp32_global_norm_clipping_is_exact_and_active():
    ours, theirs, weights, reference, _, (stats, _, _) = run_both({"dtype": "fp32", "optimizer": {"grad_clip": 0.05}})
    assert ours == theirs
    assert_identical(weights, reference)
    assert stats.grad_norms and max(stats.grad_norms) > 0.05  # clipping actually scaled the gradients


def test_fp32_activation_checkpointing():
    ours, theirs, weights, reference, _, (_, schedule, _) = run_both({"dtype": "fp32"}, checkpointing=True)
    assert ours == theirs
    assert_identical(weights, reference)


def test_fp32_weights_resident_on_device():
    ours, theirs, weights, reference, _, _ = run_both({"dtype": "fp32", "placement": {"weights": "gpu"}})
    assert ours == theirs
    assert_identical(weights, reference)


@pytest.mark.parametrize("clip", [None, 1e-3])
def test_bf16_weights_from_a_host_copy_under_accumulation_bit_identical(monkeypatch, clip):
    """The plan's compute-dtype copy of the weights (master in pinned memory, accumulation; on a GPU the plan
    takes it when it fits): the optimizer worker refreshes it after every update, and training matches the
    mixed-precision reference bit for bit, also when every step clips. The plan is made to take it on the CPU."""
    from runtime.planning.memory_plan import WeightSource

    force_weights_copy(monkeypatch)
    seen = {}

    def inspect(session):
        seen["source"] = session.controller.options.weight_source
        seen["table"] = session.plan.table()

    config = {"dtype": "bf16", "optimizer": {"accumulation_steps": 3, "grad_clip": clip}}
    ours, theirs, weights, reference, events, (stats, _, _) = run_both(config, dtype=torch.bfloat16, inspect=inspect)
    assert seen["source"] is WeightSource.WEIGHTS and "a compute-dtype copy in pinned memory" in seen["table"]
    assert "placement.weights: a bf16 copy" in seen["table"]
    assert ours == theirs
    assert_identical(weights, reference)
    if clip:
        assert len(stats.grad_norms) == STEPS and min(stats.grad_norms) > clip  # every step clipped
    # Every fetch read the 2-byte copy, never the fp32 master: each block's copy once per micro-batch at least.
    fetched = [e for e in events if e.kind == "h2d"]
    assert fetched and all(e.key.endswith("weights") for e in fetched), {e.key for e in fetched}
    assert sum(e.nbytes for e in fetched) >= 2 * sum(p.numel() for p in reference.masters) * 3 * STEPS


@pytest.mark.parametrize("clip", [None, 0.05])
def test_bf16_host_gradients_without_accumulation_lose_nothing(clip):
    """``optimizer.host_grad_dtype: compute`` where nothing is summed: a bf16 gradient crosses to host as bf16 (half
    the bytes of fp32, which ``auto`` keeps here so that a clip can be applied on the device) and is widened on the
    CPU exactly, so training matches the mixed-precision reference bit for bit, every step clipped or not."""
    seen = {}

    def inspect(session):
        seen["dtypes"] = {session.store.record(b.key("grad")).meta.dtype for b in session.blocks}

    config = {"dtype": "bf16", "optimizer": {"grad_clip": clip, "host_grad_dtype": "compute"}}
    ours, theirs, weights, reference, events, (stats, _, _) = run_both(config, dtype=torch.bfloat16, inspect=inspect)
    assert seen["dtypes"] == {torch.bfloat16}
    assert ours == theirs
    assert_identical(weights, reference)
    if clip:
        assert min(stats.grad_norms) > clip  # every step clipped: the clip multiplied the widened gradients


def test_bf16_weights_fetched_from_the_master_in_pieces_bit_identical(monkeypatch):
    """Weights fetched from the fp32 master cross in pieces of at most FETCH_PIECE_NUMEL elements, each cast into
    the compute weights after its copy ([Note: fetch staging] in runtime.engine.weights): with pieces far smaller than a
    block, training matches the mixed-precision reference bit for bit, and every block's master crossed whole
    (its pieces' bytes add up to its fp32 size, once per forward and backward fetch)."""
    import runtime.engine.weights as weights_module
    from runtime.planning.memory_plan import WeightSource

    monkeypatch.setattr(weights_module, "FETCH_PIECE_NUMEL", 1000)
    seen = {}

    def inspect(session):
        seen["source"] = session.controller.options.weight_source
        seen["numels"] = {block.key("master"): block.numel for block in session.blocks}

    config = {"dtype": "bf16", "placement": {"weights": "host"}}
    ours, theirs, weights, reference, events, _ = run_both(config, dtype=torch.bfloat16, inspect=inspect)
    assert seen["source"] is WeightSource.MASTER
    assert ours == theirs
    assert_identical(weights, reference)
    fetched: dict[str, list[int]] = {}
    for event in events:
        if event.kind == "h2d":
            fetched.setdefault(event.key, []).append(event.nbytes)
    assert set(fetched) == set(seen["numels"]), set(fetched) ^ set(seen["numels"])
    for key, sizes in fetched.items():
        numel = seen["numels"][key]
        assert max(sizes) <= 1000 * 4 and sum(sizes) % (numel * 4) == 0 and sum(sizes) >= 2 * numel * 4, (key, sizes)


def test_fp32_tied_embeddings():
    shape = ModelShape(vocab_size=256, hidden_size=32, num_layers=2, num_heads=4, ffn_size=64, tie_embeddings=True)
    ours, theirs, weights, reference, _, _ = run_both({"dtype": "fp32"}, shape=shape)
    assert ours == theirs
    assert_identical(weights, reference)


def test_fp16_overflow_step_is_skipped_like_the_reference():
    # A loss scale of 2**18 overflows this model's fp16 gradients for the first three steps: they must be
    # skipped, the scale halved each time, and the later steps must update exactly as the reference does.
    # (2**40 skipped all six steps, so no update was ever compared.)
    config = {"dtype": "fp16", "optimizer": {"grad_clip": 1.0, "loss_scale": {"initial": 2.0**18}}}
    ours, theirs, weights, reference, _, (stats, _, _) = run_both(config, steps=6, dtype=torch.float16, loss_scale=2.0**18)
    assert 1 <= reference.skipped < 6
    assert stats.skipped_steps == reference.skipped
    assert ours == theirs
    assert_identical(weights, reference)


@pytest.mark.parametrize("clip", [None, 0.05])
def test_fp32_part_of_the_update_on_the_device(clip):
    config = {"dtype": "fp32", "optimizer": {"gpu_update_fraction": 0.5, "grad_clip": clip}}
    ours, theirs, weights, reference, events, _ = run_both(config)
    assert ours == theirs
    assert_identical(weights, reference)
    # Only the CPU-updated blocks' gradients went to host: fewer bytes than the whole model's.
    all_grads = 4 * sum(p.numel() for p in reference.masters)
    assert 0 < nbytes_moved(events, "d2h") < all_grads * STEPS


def test_fp32_weights_resident_with_master_on_nvme(tmpfs_dir):
    config = {"dtype": "fp32", "placement": {"weights": "gpu", "master": "nvme", "moments": "nvme"},
              "tiers": {"nvme": {"path": str(tmpfs_dir)}}}
    ours, theirs, weights, reference, events, _ = run_both(config)
    assert ours == theirs
    assert_identical(weights, reference)
    assert nbytes_moved(events, "read") > 0 and nbytes_moved(events, "write") > 0


def test_moments_spilled_past_the_host_budget_bit_identical(tmpfs_dir):
    """placement.moments: auto with a host budget too small for every block's moments: the last blocks'
    moments go to NVMe (bytes really move through it), the first stay pinned, and training is unchanged."""
    torch.manual_seed(0)
    from runtime.config.loader import load_config
    from runtime.core.blocks import build_blocks
    from runtime.planning.placement import resolve_plan
    from runtime.planning.settings import resolve_device

    base = {"dtype": "fp32", "tiers": {"nvme": {"path": str(tmpfs_dir)}}, "placement": {"moments": "auto"},
            "optimizer": {"grad_clip": None}}  # with clipping, the pre-commit buffers would be given up first
    cfg = load_config(base)
    shape = ModelShape(vocab_size=256, hidden_size=32, num_layers=10, num_heads=4, ffn_size=64, max_seq_len=64)
    blocks = build_blocks(ExampleLM(shape), cfg.blocks.min_block_size)  # 12 blocks: spilling 6+ saves host memory
    everything_on_host = resolve_plan(blocks, cfg, resolve_device(cfg)).plan.host_nbytes
    base["tiers"]["host"] = {"budget": everything_on_host - 8192}  # two pages short: at least one block spills
    resolved = resolve_plan(blocks, load_config(base), resolve_device(cfg))
    assert 0 < len(resolved.spilled_blocks) < len(blocks)
    assert resolved.spilled_blocks == frozenset(range(len(blocks) - len(resolved.spilled_blocks), len(blocks)))
    ours, theirs, weights, reference, events, _ = run_both(base, shape=shape)
    assert ours == theirs
    assert_identical(weights, reference)
    spilled_keys = {blocks[i].key(kind) for i in resolved.spilled_blocks for kind in ("exp_avg", "exp_avg_sq")}
    written = {e.key for e in events if e.kind == "write"}
    assert spilled_keys <= written  # the spilled moments were written to their swap files every step
    assert not {e.key for e in events if e.kind in ("read", "write")} - spilled_keys  # nothing else touched the disk


def test_weights_kept_for_backward_fetch_once_per_step_bit_identical():
    """prefetch.keep_for_backward: blocks stay on the device from their forward to their backward, so each
    is fetched once a step instead of twice, and training is unchanged."""
    def fetched(keep: int) -> int:
        config = {"dtype": "fp32", "prefetch": {"keep_for_backward": keep}}
        ours, theirs, weights, reference, events, _ = run_both(config)
        assert ours == theirs
        assert_identical(weights, reference)
        return sum(1 for e in events if e.kind == "h2d")

    without, kept = fetched(0), fetched(1 << 30)
    assert kept < without * 0.7, (kept, without)
    partial = fetched(45_000)  # room for one layer block: the newest kept, the rest fetched again
    assert kept < partial < without, (kept, partial, without)


@pytest.mark.parametrize("clip,on_gpu", [(None, 0.0), (0.5, 0.0), (0.5, 0.3)])
def test_a_backward_keeps_and_fetches_the_next_micro_batch_s_first_blocks_bit_identical(clip, on_gpu, monkeypatch):
    """[Note: prefetch across micro-batches]: the backward of a micro-batch another follows keeps the next forward's
    first ``depth`` fetched blocks (blocks updated on the device, ``on_gpu``, are not fetched and do not count), so
    each such backward saves exactly ``depth`` fetches; the step's last backward wraps nothing and the losses and
    weights equal the plain loop's."""
    depth, accumulation = 2, 4

    def fetches(wrap: bool) -> tuple[int, list[int]]:
        """The run's weight copies, and how many fetched blocks each forward found on the device."""
        found: list[int] = []

        def watch(session) -> None:  # noqa: ANN001
            ctl = session.controller
            ctl.step_listeners.append(lambda event: event.kind == "begin" and found.append(
                sum(ctl.weights.is_fetched(i) for i in range(len(ctl.blocks)) if i not in ctl.gpu_updated)))

        if not wrap:
            monkeypatch.setattr("runtime.engine.fetch.Fetcher.wraps", lambda self: False)
        config = {"dtype": "fp32", "prefetch": {"depth": depth, "keep_for_backward": 0},
                  "optimizer": {"grad_clip": clip, "accumulation_steps": accumulation, "gpu_update_fraction": on_gpu}}
        ours, theirs, weights, reference, events, _ = run_both(config, prepare=watch)
        monkeypatch.undo()
        assert ours == theirs
        assert_identical(weights, reference)
        return sum(1 for e in events if e.kind == "h2d"), found

    (without, found_without), (wrapped, found) = fetches(False), fetches(True)
    # Every backward but each step's last wraps; the very first has no trace yet to wrap into.
    assert without - wrapped == depth * (STEPS * (accumulation - 1) - 1), (without, wrapped)
    # It kept `depth` blocks and fetched one more: depth + 1 wait for each forward that follows a wrapping backward.
    assert found[2:] == [0 if micro == 0 else depth + 1 for micro in list(range(accumulation)) * STEPS][2:], found
    assert not any(found_without)


@pytest.mark.parametrize("clip,weights,ahead", [(None, "host", 1), (0.5, "host", 1), (None, "gpu", 1), (None, "host", 2), (0.5, "host", 2)])
@pytest.mark.quick_cases({"clip": None, "weights": "host", "ahead": 1}, {"clip": 0.5, "weights": "host", "ahead": 2})
def test_streamed_gpu_update_bit_identical(clip, weights, ahead):
    """optimizer.gpu_stream_fraction: the streamed blocks' master and moments stay home in host memory,
    are copied to the device each step, updated there and written back; training is unchanged (on the
    CPU the "device" is host memory, so this is bit-identical), and the streamed blocks have no host
    gradient. ``gpu_stream_ahead`` blocks' state is on its way before the first update writes back."""
    config = {"dtype": "fp32", "placement": {"weights": weights},
              "optimizer": {"gpu_stream_fraction": 0.5 if ahead == 1 else 0.8, "gpu_update_fraction": 0.2 if ahead == 1 else 0.0,
                            "grad_clip": clip, "gpu_stream_ahead": ahead}}
    ours, theirs, weights, reference, events, _ = run_both(config)
    assert ours == theirs
    assert_identical(weights, reference)
    moments = [e for e in events if e.key.endswith(".exp_avg") and e.kind in ("h2d", "d2h")]
    streamed_in = {e.key for e in moments if e.kind == "h2d"}
    written_back = {e.key for e in moments if e.kind == "d2h"}
    assert streamed_in and streamed_in == written_back  # the moments went to the device and came back
    # In backward, or with clipping once the norm is known, the next blocks' state moves while one updates.
    first_write = next(i for i, e in enumerate(moments) if e.kind == "d2h")
    in_before_first_write = {e.key for e in moments[:first_write] if e.kind == "h2d"}
    assert len(in_before_first_write) == min(len(streamed_in), ahead + 1), in_before_first_write
    assert len(streamed_in) >= ahead + 1  # enough streamed blocks that a shallower start would show


class _SkippingNet(torch.nn.Module):
    """Four layers; layer 1 is skipped when asked, so its block gets no gradient that step."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))
        self.head = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, skip: bool) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            if not (i == 1 and skip):
                x = torch.tanh(layer(x))
        return self.head(x).pow(2).mean()


def test_streamed_block_without_gradient_keeps_its_state_and_frees_the_device():
    """A streamed block that gets no gradient in a step is not updated (as torch.optim.AdamW skips a
    parameter without grad), and the state streamed in for it does not stay on the device."""
    import copy

    torch.manual_seed(0)
    model = _SkippingNet()
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    config = {"dtype": "fp32", "blocks": {"modules": ["layers.*"]},
              "optimizer": {"lr": 1e-2, "weight_decay": 0.01, "grad_clip": None, "gpu_stream_fraction": 0.6}}
    model, optimizer = offload(model, config)
    session = optimizer.session
    try:
        streamed = session.controller.gpu_streamed
        assert 1 in streamed  # layer 1's block is among the streamed ones
        for step in range(4):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
            skip = step % 2 == 1
            model(x, skip).backward()
            optimizer.step()
            optimizer.zero_grad()
            reference(x, skip).backward()
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
        weights = session.master_state_dict()
        for name, p in reference.named_parameters():
            assert torch.equal(weights[name], p.detach()), name
        from tierstore import CopyState, TierName

        for index in streamed:  # nothing of a streamed block's state is left on the device between steps
            for kind in ("master", "exp_avg", "exp_avg_sq"):
                assert session.store.state(session.blocks[index].key(kind), TierName.GPU) is CopyState.ABSENT
    finally:
        session.close()


def test_streaming_ahead_stays_within_the_planned_gpu_budget():
    """optimizer.gpu_stream_ahead brings more streamed blocks in while the GPU budget allows, but never the
    room the plan keeps for weight fetches: with tiers.gpu.budget set to exactly the plan's GPU bytes only
    the blocks the plan counts are brought in early, and training is unchanged either way."""
    from runtime.config.loader import load_config
    from runtime.core.blocks import build_blocks
    from runtime.planning.placement import resolve_plan

    shape = ModelShape(vocab_size=256, hidden_size=32, num_layers=8, num_heads=4, ffn_size=64, max_seq_len=64, tie_embeddings=False)
    config = {"dtype": "fp32", "optimizer": {"gpu_stream_fraction": 0.8, "gpu_stream_ahead": 8, "grad_clip": None}}
    planned = resolve_plan(build_blocks(ExampleLM(shape)), load_config(config), torch.device("cpu")).plan.gpu_nbytes

    def early_and_all(events) -> tuple[int, int]:
        moments = [e for e in events if e.key.endswith(".exp_avg") and e.kind in ("h2d", "d2h")]
        first_write = next(i for i, e in enumerate(moments) if e.kind == "d2h")
        return (len({e.key for e in moments[:first_write] if e.kind == "h2d"}),
                len({e.key for e in moments if e.kind == "h2d"}))

    counts = []
    for budget in (None, planned):
        run = {**config, "tiers": {"gpu": {"budget": budget}}} if budget else dict(config)
        ours, theirs, weights, reference, events, _ = run_both(run, shape=shape)
        assert ours == theirs
        assert_identical(weights, reference)
        counts.append(early_and_all(events))
    (free_early, streamed), (capped_early, _) = counts
    assert streamed > 4 and free_early == streamed  # unbounded: every streamed block before the first write-back
    assert capped_early == 3, counts  # the plan's three: the next, the updated, the written back


def test_spilled_moments_read_during_the_micro_batches_bit_identical(tmpfs_dir):
    """Clipping, accumulation summed on the host and moments spilled past the host budget (the 8B scenario's
    configuration): the first spilled blocks' moments are read while the micro-batches compute, and training is
    unchanged."""
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
    spares = sum(nbytes for kind, _, nbytes in plan.rows if kind == PRE_COMMIT_BUFFERS)  # given up first
    base["tiers"]["host"] = {"budget": plan.host_nbytes - spares - 8192}
    resolved = resolve_plan(blocks, load_config(base), resolve_device(load_config(base)))
    assert 0 < len(resolved.spilled_blocks) < len(blocks)
    commits: list[tuple[set[int], list[int]]] = []  # per commit: blocks read early, host updates as they ran

    def record_update_order(session) -> None:
        controller = session.controller
        submit_jobs, updated = controller.commit._submit_host_jobs, controller.worker.on_updated

        def submit_host_jobs(*args, **kwargs):
            # The blocks whose moments were read whole and have landed: the worker prefers those (a read still in
            # flight, or half refused for room, does not count).
            for index in controller.table.read_early():
                for kind in ("exp_avg", "exp_avg_sq"):
                    handle = session.store.record(controller.blocks[index].key(kind)).copies[TierName.HOST].handle
                    if handle is not None:
                        handle.wait()
            landed = {index for index in controller.table.read_early()
                      if controller.worker._disk_state_landed(controller.blocks[index])}
            commits.append((landed, []))
            return submit_jobs(*args, **kwargs)

        def on_updated(index: int) -> None:
            if commits:
                commits[-1][1].append(index)
            updated(index)

        controller.commit._submit_host_jobs, controller.worker.on_updated = submit_host_jobs, on_updated

    ours, theirs, weights, reference, events, (stats, _, _) = run_both(base, shape=shape, prepare=record_update_order)
    assert ours == theirs
    assert_identical(weights, reference)
    assert stats.early_reads > 0
    assert nbytes_moved(events, "read") > 0
    # At each commit the updates whose moments wait in memory run first: their write-backs free the room the other
    # spilled blocks are read into. The rest follow in forward order.
    assert len(commits) == STEPS and all(early for early, _ in commits)
    for early, order in commits:  # one more: the worker may take the first job queued before the next arrives
        assert early <= set(order[: len(early) + 1]), (early, order)


def test_skipped_fp16_steps_with_every_moment_on_nvme_do_not_hold_the_staging_room(tmpfs_dir):
    """fp16 overflow steps skip every update; a skipped update read its (NVMe) state and never gave the room
    back, so with more blocks than staging rooms the worker waited for room forever. Now skipped updates read
    nothing and release what was read ahead for them; training then matches the reference."""
    shape = ModelShape(vocab_size=256, hidden_size=32, num_layers=8, num_heads=4, ffn_size=64, max_seq_len=64)
    config = {"dtype": "fp16", "tiers": {"nvme": {"path": str(tmpfs_dir)}}, "placement": {"moments": "nvme"},
              "optimizer": {"grad_clip": 1.0, "loss_scale": {"initial": 2.0**18}}}
    ours, theirs, weights, reference, _, (stats, _, _) = run_both(config, shape=shape, steps=6, dtype=torch.float16,
                                                                 loss_scale=2.0**18)
    assert 1 <= reference.skipped < 6 and stats.skipped_steps == reference.skipped
    assert ours == theirs
    assert_identical(weights, reference)


def test_master_on_nvme_with_spilled_moments_and_clipping_bit_identical(tmpfs_dir):
    """Master on NVMe, moments spilled past the budget, clipping: the first updates need host room for their
    masters, so the spilled moments are not read early (they filled that room and the worker gave up)."""
    from runtime.config.loader import load_config
    from runtime.core.blocks import build_blocks
    from runtime.planning.placement import resolve_plan
    from runtime.planning.settings import resolve_device

    base = {"dtype": "fp32", "tiers": {"nvme": {"path": str(tmpfs_dir)}},
            "placement": {"moments": "auto", "master": "nvme"}, "optimizer": {"grad_clip": 0.05}}
    shape = ModelShape(vocab_size=256, hidden_size=32, num_layers=10, num_heads=4, ffn_size=64, max_seq_len=64)
    blocks = build_blocks(ExampleLM(shape), load_config(base).blocks.min_block_size)
    plan = resolve_plan(blocks, load_config(base), resolve_device(load_config(base))).plan
    base["tiers"]["host"] = {"budget": plan.host_nbytes - 8192}
    assert resolve_plan(blocks, load_config(base), resolve_device(load_config(base))).spilled_blocks
    ours, theirs, weights, reference, _, (stats, _, _) = run_both(base, shape=shape)
    assert ours == theirs
    assert_identical(weights, reference)
    assert stats.early_reads == 0


def test_an_fp16_overflow_right_after_an_update_waits_for_its_write_back(tmpfs_dir, monkeypatch):
    """Moments on NVMe, the loss scale doubled every step until the gradients overflow: the overflow's skipped
    update gives back what was read ahead for it only after the block's last write-back has released the host copy
    it wrote from (writes slowed here: before, the skip could find that copy still the only current one and the
    optimizer worker failed). Training goes on exactly as the reference, which skips the same steps."""
    from tierstore.nvme import NVMeDirectory

    write = NVMeDirectory.write

    def slow_write(directory, swap, src, step=0, fsync=False):
        time.sleep(0.02)  # a slow disk: the write-back is still in flight when the overflow's skip comes
        return write(directory, swap, src, step, fsync)

    monkeypatch.setattr(NVMeDirectory, "write", slow_write)
    config = {"dtype": "fp16", "placement": {"moments": "nvme"}, "tiers": {"nvme": {"path": str(tmpfs_dir)}},
              "optimizer": {"grad_clip": None, "loss_scale": {"initial": 2.0**14, "growth_interval": 1}}}
    ours, theirs, weights, reference, _, (stats, _, _) = run_both(config, steps=8, dtype=torch.float16,
                                                                  loss_scale=2.0**14, loss_scale_growth_interval=1)
    assert 1 <= reference.skipped < 8 and stats.skipped_steps == reference.skipped
    assert ours == theirs
    assert_identical(weights, reference)
