"""A placement adopted between steps (``Controller.adopt_placement``, driven after the first step by
``runtime.planning.measured_placement``): the moved blocks' state really lives on the device tier afterwards, and training
stays bit-identical to the plain loop, with clipping that clips, clipping that does not, and resident weights."""

from __future__ import annotations

import functools
import logging
import weakref

import pytest
import torch

from runtime import offload
from runtime.bundled.example_model import ExampleLM
from runtime.engine.spill_return import bring_moments_home
from runtime.engine.step_phase import StepPhase
from runtime.planning.auto_placement import Placement, gpu_streamed_blocks, gpu_updated_blocks
from runtime.planning.measured_placement import FIRST_STEP_NOTE, FirstStepPlacement
from runtime.planning.peak_hint import StreamPools, supported_reserve
from runtime.session import _adopt_placement
from tests.integration.reference_loop import ReferenceTrainer
from tests.integration.test_parity import SHAPE, assert_identical, make_batches, step_and_check
from tierstore import TierName

GiB = 1 << 30


def _session(clip: float | None, weights: str = "host", gpu_budget: int | None = None, seed: int = 0):
    torch.manual_seed(seed)
    model = ExampleLM(SHAPE)
    reference = ReferenceTrainer(model, dtype=torch.float32, grad_clip=clip)
    config = {"dtype": "fp32", "placement": {"weights": weights},
              "optimizer": {"grad_clip": clip, "gpu_update_fraction": 0.0, "gpu_stream_fraction": 0.0}}
    if gpu_budget is not None:
        config["tiers"] = {"gpu": {"budget": gpu_budget}}
    model, optimizer = offload(model, config)
    return model, optimizer, reference


def _train(model, optimizer, reference, batches) -> None:
    """Offloaded steps beside the reference's, each loss equal."""
    for x, y in batches:
        step_and_check(model, optimizer, reference, x, y)


def _homes(session, kind: str) -> list[TierName]:
    return [session.store.record(block.key(kind)).home for block in session.blocks]


@pytest.mark.parametrize("clip, weights", [(None, "host"), (0.05, "host"), (10.0, "host"), (0.05, "gpu")])
def test_a_placement_adopted_between_steps_trains_like_the_plain_loop(clip, weights):
    model, optimizer, reference = _session(clip, weights)
    session = optimizer.session
    batches = make_batches(5)
    with session:
        for x, y in batches[:2]:
            step_and_check(model, optimizer, reference, x, y)
        assert set(_homes(session, "master")) == {TierName.HOST}
        session.controller.adopt_placement(0.4, 0.3, 0)
        updated = gpu_updated_blocks(session.blocks, 0.4)
        streamed = gpu_streamed_blocks(session.blocks, 0.4, 0.3)
        assert updated and streamed and session.controller.gpu_updated == updated
        for kind in ("master", "exp_avg", "exp_avg_sq"):  # the moved blocks' state lives on the device tier now
            assert [i for i, home in enumerate(_homes(session, kind)) if home is TierName.GPU] == sorted(updated)
        keys = {str(k) for k in session.store.keys()}
        for index in updated | streamed:  # their gradients no longer go to host memory
            assert str(session.blocks[index].key("grad")) not in keys
        for x, y in batches[2:]:
            step_and_check(model, optimizer, reference, x, y)
        assert session.controller.worker.stats.jobs > 0  # the rest still updates on the CPU
        assert_identical(session.master_state_dict(), reference)


def test_a_placement_change_refuses_to_shrink_the_devices_share_or_to_run_mid_step():
    model, optimizer, reference = _session(None)
    session = optimizer.session
    with session:
        (x, y), (x2, y2) = make_batches(2)
        session.controller.adopt_placement(0.5, 0.0, 0)
        with pytest.raises(RuntimeError, match="more blocks"):
            session.controller.adopt_placement(0.0, 0.0, 0)
        loss = model(x, y)
        loss.backward()
        assert session.controller.phase is StepPhase.READY
        with pytest.raises(RuntimeError, match="between steps"):
            session.controller.adopt_placement(0.8, 0.0, 0)
        optimizer.step()
        optimizer.zero_grad()
        assert loss.item() == reference.train_step([(x, y)])[0]
        step_and_check(model, optimizer, reference, x2, y2)  # the refusals changed nothing
        assert_identical(session.master_state_dict(), reference)


class _Asked:
    """A stand-in for auto placement: records the reserve it is asked at and answers a fixed placement."""

    def __init__(self, placement: Placement | None):
        self.placement, self.reserves = placement, []

    def __call__(self, reserve: int) -> Placement | None:
        self.reserves.append(reserve)
        return self.placement


def _listener(session, ask, peak_nbytes: int, budget: int, resets: list[int], pools=None) -> FirstStepPlacement:
    listener = FirstStepPlacement(plan_gpu_nbytes=1 * GiB, budget_nbytes=budget, ask=ask,
                                  adopt=functools.partial(_adopt_placement, weakref.ref(session)),
                                  peak=lambda: peak_nbytes, reset_peak=lambda: resets.append(1), pools=pools)
    session.controller.step_listeners.append(listener)
    return listener


def test_the_first_training_step_is_measured_and_its_placement_adopted(caplog):
    """An evaluation forward before training is not measured; the first training step's commit asks at the reserve
    its peak supports, adopts the answer (session placement, plan and the controller's blocks), and training stays
    exact before and after."""
    model, optimizer, reference = _session(0.05)
    session = optimizer.session
    chosen = Placement(0.4, 0.3, 0, notes=("auto placement: chosen for the test",), activation_reserve_nbytes=5 * GiB)
    ask, resets = _Asked(chosen), []
    listener = _listener(session, ask, peak_nbytes=4 * GiB, budget=20 * GiB, resets=resets,
                         pools=lambda: StreamPools(3 * GiB, 2 * GiB, GiB // 2, GiB // 4))
    batches = make_batches(4)
    with session:
        with torch.no_grad():
            model(*batches[0])
        assert resets == []
        caplog.set_level(logging.INFO, logger="runtime.planning.measured_placement")
        step_and_check(model, optimizer, reference, *batches[0])
        assert resets == [1] and ask.reserves == [supported_reserve(3 * GiB, 20 * GiB)]
        assert listener.chosen is chosen and session.placement is chosen
        assert session.controller.gpu_updated == gpu_updated_blocks(session.blocks, 0.4)
        assert session.plan.notes[0] == FIRST_STEP_NOTE and "the first step peaked at 4.00 GiB" in caplog.text
        assert ("beyond its plan; held at the commit: 3.00 GiB for the compute stream (2.00 GiB of it free), 512.0 MiB "
                "for side streams (256.0 MiB free)" in caplog.text)
        for x, y in batches[1:]:
            step_and_check(model, optimizer, reference, x, y)
        assert ask.reserves == [supported_reserve(3 * GiB, 20 * GiB)]  # asked once
        assert_identical(session.master_state_dict(), reference)


def test_a_placement_the_device_tier_cannot_hold_changes_nothing(caplog):
    """Auto placement's answer needs more of the device tier than its budget has: a warning, every update stays on
    the CPU, and training goes on exactly."""
    model, optimizer, reference = _session(None, gpu_budget=320 << 10)
    session = optimizer.session
    before = session.placement
    listener = _listener(session, _Asked(Placement(1.0, 0.0, 0, notes=("everything",))), peak_nbytes=2 * GiB,
                         budget=320 << 10, resets=[])
    batches = make_batches(3)
    with session:
        caplog.set_level(logging.WARNING, logger="runtime.planning.measured_placement")
        _train(model, optimizer, reference, batches)
        assert listener.done and listener.chosen is None and "could not be adopted" in caplog.text
        assert session.placement is before and not session.controller.gpu_updated
        assert set(_homes(session, "master")) == {TierName.HOST}
        assert_identical(session.master_state_dict(), reference)


def test_a_move_the_device_refuses_half_way_puts_everything_back(monkeypatch, caplog):
    """The device runs out of memory on the fourth key moved (the tier budget had room, the allocator not): the
    keys moved before it go home again, nothing else changed, the listener says so, and training goes on exactly."""
    model, optimizer, reference = _session(None)
    session = optimizer.session
    store = session.store
    real_move, calls = store.move_home, []

    def refusing(key, to):
        calls.append(key)
        if len(calls) == 4:
            raise torch.OutOfMemoryError("the device has no room (test)")
        return real_move(key, to)

    monkeypatch.setattr(store, "move_home", refusing)
    listener = _listener(session, _Asked(Placement(0.5, 0.2, 0, notes=("half",))), peak_nbytes=2 * GiB,
                         budget=20 * GiB, resets=[])
    keys_before = {str(k) for k in store.keys()}
    batches = make_batches(3)
    with session:
        caplog.set_level(logging.WARNING, logger="runtime.planning.measured_placement")
        _train(model, optimizer, reference, batches)
        assert len(calls) > 4 and listener.chosen is None and "could not be adopted" in caplog.text
        assert not session.controller.gpu_updated and not session.controller.gpu_streamed
        assert set(_homes(session, "master")) == set(_homes(session, "exp_avg")) == {TierName.HOST}
        assert {str(k) for k in store.keys()} == keys_before  # host gradients still registered
        assert_identical(session.master_state_dict(), reference)


def test_a_loop_that_trains_in_eval_mode_is_measured():
    """Forwards that record a graph with the model in eval mode ('grad-eval') are training steps too."""
    model, optimizer, reference = _session(None)
    session = optimizer.session
    resets: list[int] = []
    listener = _listener(session, _Asked(Placement(0.4, 0.0, 0, notes=("eval mode",))), peak_nbytes=2 * GiB,
                         budget=20 * GiB, resets=resets)
    model.eval()
    reference.model.eval()
    with session:
        _train(model, optimizer, reference, make_batches(2))
        assert resets == [1] and listener.chosen is not None and session.controller.gpu_updated
        assert_identical(session.master_state_dict(), reference)


def test_a_profile_started_before_the_first_step_reports_the_adopted_placement():
    from runtime.profiler import Profiler

    model, optimizer, reference = _session(0.05)
    session = optimizer.session
    _listener(session, _Asked(Placement(0.4, 0.3, 0, notes=("profiled",), activation_reserve_nbytes=3 * GiB)),
              peak_nbytes=2 * GiB, budget=20 * GiB, resets=[])
    with session, Profiler(session) as profiler:
        _train(model, optimizer, reference, make_batches(2))
        meta = profiler.raw().meta
        flagged = [i for i, block in enumerate(meta["blocks"]) if block["gpu_updated"]]
        assert flagged == sorted(gpu_updated_blocks(session.blocks, 0.4))
        assert any(block["gpu_streamed"] for block in meta["blocks"])


def test_weights_the_device_cannot_hold_put_the_moved_state_back(monkeypatch, caplog):
    """The state moved, then the first block's compute weights do not fit the device: everything goes back."""
    model, optimizer, reference = _session(None)
    session = optimizer.session
    weights = session.controller.weights

    def no_room(index, master=None):
        raise torch.OutOfMemoryError("no room for the weights (test)")

    monkeypatch.setattr(weights, "load_resident", no_room)
    listener = _listener(session, _Asked(Placement(0.5, 0.0, 0, notes=("weights",))), peak_nbytes=2 * GiB,
                         budget=20 * GiB, resets=[])
    with session:
        caplog.set_level(logging.WARNING, logger="runtime.planning.measured_placement")
        _train(model, optimizer, reference, make_batches(3))
        assert listener.chosen is None and "could not be adopted" in caplog.text
        assert set(_homes(session, "master")) == {TierName.HOST} and not session.controller.gpu_updated
        assert not any(state.resident for state in weights.states)
        assert_identical(session.master_state_dict(), reference)


def test_a_change_that_cannot_be_undone_stops_the_next_step(monkeypatch):
    """A key that can go neither forward nor back: the session refuses the next step and says why."""
    model, optimizer, reference = _session(None)
    session = optimizer.session
    real_move, calls = session.store.move_home, []

    def forward_once(key, to):
        calls.append(key)
        if len(calls) == 1:
            return real_move(key, to)
        raise torch.OutOfMemoryError("no room anywhere (test)")

    batches = make_batches(2)
    with session:
        step_and_check(model, optimizer, reference, *batches[0])
        monkeypatch.setattr(session.store, "move_home", forward_once)
        with pytest.raises(torch.OutOfMemoryError):
            session.controller.adopt_placement(0.5, 0.0, 0)
        assert session.controller.phase is StepPhase.INTERRUPTED
        session.controller.clear_interrupted()  # what a checkpoint load calls: it cannot mend this
        with pytest.raises(RuntimeError, match="failed placement change left block0.master on the device"):
            model(*batches[1]).backward()


def test_a_failing_question_leaves_every_update_on_the_cpu():
    """Auto placement itself raising (not the device): the outcome lands in the plan's notes, training goes on."""
    model, optimizer, reference = _session(None)
    session = optimizer.session

    def broken(reserve: int) -> Placement:
        raise ValueError("the question failed (test)")

    lines: list[str] = []
    _listener(session, broken, peak_nbytes=2 * GiB, budget=20 * GiB, resets=[]).report = lines.append
    with session:
        _train(model, optimizer, reference, make_batches(2))
        assert len(lines) == 1 and "the question failed" in lines[0] and not session.controller.gpu_updated
        assert_identical(session.master_state_dict(), reference)


def test_a_checkpoint_taken_after_the_change_resumes_exactly_in_a_fresh_session(tmp_path):
    """Saved with the first blocks' state on the device tier, loaded into a new session that still updates
    everything on the CPU (its first step not taken yet): training goes on bit-identical to the plain loop."""
    from runtime.checkpoint.state import load_checkpoint, save_checkpoint

    model, optimizer, reference = _session(0.05)
    session = optimizer.session
    batches = make_batches(5)
    with session:
        _train(model, optimizer, reference, batches[:2])
        session.controller.adopt_placement(0.4, 0.3, 0)
        _train(model, optimizer, reference, batches[2:3])
        save_checkpoint(session, tmp_path / "ckpt")
    fresh_model, fresh_optimizer, _ = _session(0.05, seed=1)  # other initial weights: the load replaces them all
    fresh = fresh_optimizer.session
    with fresh:
        assert load_checkpoint(fresh, tmp_path / "ckpt") == 3 and not fresh.controller.gpu_updated
        _train(fresh_model, fresh_optimizer, reference, batches[3:])
        assert_identical(fresh.master_state_dict(), reference)


def test_the_model_reads_and_saves_as_usual_after_the_change():
    """Parameters and state_dict() between steps after a placement change: the current weights, every block."""
    model, optimizer, reference = _session(None)
    session = optimizer.session
    with session:
        _train(model, optimizer, reference, make_batches(1))
        session.controller.adopt_placement(0.5, 0.2, 0)
        _train(model, optimizer, reference, make_batches(2, seed=1))
        expected = reference.master_state()
        saved = model.state_dict()
        for name, value in expected.items():
            assert torch.equal(saved[name].float(), value), name
            assert torch.equal(dict(model.named_parameters())[name].detach().float(), value), name


def _adopt_after_first_step(placement: Placement, seen: dict):
    """A ``run_both`` prepare: the first step's commit adopts ``placement`` through the session's own path
    (``_adopt_placement``: the spill the pinned arena allows is worked out there); ``seen`` gets the spilled blocks
    before and the store's keys."""

    def prepare(session) -> None:
        seen["spilled_before"] = session.controller.options.spilled_blocks
        seen["listener"] = _listener(session, _Asked(placement), peak_nbytes=2 * GiB, budget=20 * GiB, resets=[])

    return prepare


def _spilling_session_config(nvme_dir, short_by_layers: int, vocab_size: int = 256):
    """The 8B scenario's kind of config on a 10-layer model (clipping, host sums, every update on the CPU, moments
    auto) with a host budget ``short_by_layers`` layers' moments short of holding them all: (config, shape, blocks
    spilled at offload)."""
    from runtime.bundled.example_model import ModelShape
    from runtime.config.loader import load_config
    from runtime.core.blocks import build_blocks
    from runtime.planning.memory_plan import PRE_COMMIT_BUFFERS
    from runtime.planning.placement import resolve_plan
    from runtime.planning.settings import resolve_device

    shape = ModelShape(vocab_size=vocab_size, hidden_size=32, num_layers=10, num_heads=4, ffn_size=64, max_seq_len=64)
    config = {"dtype": "fp32", "tiers": {"nvme": {"path": str(nvme_dir)}}, "placement": {"moments": "auto"},
              "optimizer": {"grad_clip": 0.05, "accumulation_steps": 2, "accumulate_on": "host",
                            "gpu_update_fraction": 0.0, "gpu_stream_fraction": 0.0}}
    blocks = build_blocks(ExampleLM(shape), load_config(config).blocks.min_block_size)
    plan = resolve_plan(blocks, load_config(config), resolve_device(load_config(config))).plan
    spares = sum(nbytes for kind, _, nbytes in plan.rows if kind == PRE_COMMIT_BUFFERS)
    layer_moments = 2 * 4 * sorted(b.numel for b in blocks)[len(blocks) // 2]
    config["tiers"]["host"] = {"budget": plan.host_nbytes - spares - short_by_layers * layer_moments}
    spilled = resolve_plan(blocks, load_config(config), resolve_device(load_config(config))).spilled_blocks
    return config, shape, spilled


@pytest.mark.parametrize("update, stream", [(0.4, 0.3), (1.0, 0.0)], ids=["some-streamed", "every-block"])
def test_a_placement_adopted_over_host_gradient_sums_trains_like_the_plain_loop(update, stream):
    """Micro-batch gradients summed in host memory (accumulate_on: host), clipping on: after the first step the
    moved blocks sum on the device (their host gradient buffers are gone) and the rest still sum on the host; with
    every block moved, the host sums stop and give their buffers back. Every loss and weight is the plain loop's."""
    from tests.integration.test_parity import run_both

    config = {"dtype": "fp32", "optimizer": {"grad_clip": 0.05, "accumulation_steps": 2, "accumulate_on": "host",
                                             "gpu_update_fraction": 0.0, "gpu_stream_fraction": 0.0}}
    seen: dict = {}
    after: dict = {}

    def inspect(session) -> None:
        controller = session.controller
        after["sums"] = None if controller.sums is None else set(controller.sums.blocks)
        after["moved"] = controller.gpu_updated | controller.gpu_streamed
        after["host"] = {b.index for b in controller.host_updated_blocks}
        after["grads"] = {i for i, b in enumerate(session.blocks) if session.store.has(b.key("grad"))}
        after["staging"] = any(str(k).startswith("grad_sum_staging") for k in session.store.keys())

    ours, theirs, weights, reference, _, _ = run_both(config, prepare=_adopt_after_first_step(
        Placement(update, stream, 0, notes=("test",), host_sums=True), seen), inspect=inspect)
    assert ours == theirs
    assert_identical(weights, reference)
    assert seen["listener"].chosen is not None
    assert after["moved"] and after["grads"] == after["host"]
    if after["host"]:
        assert after["sums"] == after["host"] and after["staging"]
    else:  # nothing left to sum on the host
        assert after["sums"] is None and not after["staging"]


@pytest.mark.parametrize("update, ask_all", [(0.2, False), (0.5, False), (0.1, True)],
                         ids=["some-stay", "all-back", "asked-beyond-the-room"])
@pytest.mark.quick_cases({"update": 0.2}, {"update": 0.1})
def test_a_placement_adopted_over_spilled_moments_brings_them_back_into_the_freed_room(tmpfs_dir, update, ask_all):
    """The 8B scenario's kind of plan (clipping, host sums, moments spilled past the host budget): adopting a
    placement that moves the first blocks to the device brings spilled moments back from NVMe into the pinned room
    those blocks freed, as many as the arena holds beside the staging room of the ones left (through the session's
    path, which works that out from the plan; or asked for every block, where the arena's own check stops it);
    training stays exact."""
    from runtime.core.events import StepEvent
    from tests.integration.test_parity import nbytes_moved, run_both

    config, shape, spilled = _spilling_session_config(tmpfs_dir, short_by_layers=4)
    assert len(spilled) >= 4
    seen: dict = {}
    after: dict = {}

    def adopt_asking_for_all(session) -> None:
        seen["spilled_before"] = session.controller.options.spilled_blocks

        def on_commit(event: StepEvent) -> None:
            if event.kind == "commit" and not seen.get("done"):
                seen["done"] = True
                session.controller.adopt_placement(update, 0.0, 0, frozenset())

        session.controller.step_listeners.append(on_commit)

    def inspect(session) -> None:
        controller = session.controller
        after["spilled"] = controller.options.spilled_blocks
        after["updated"] = controller.gpu_updated
        after["homes"] = {i: {session.store.record(b.key(kind)).home for kind in ("exp_avg", "exp_avg_sq")}
                          for i, b in enumerate(session.blocks)}
        after["early"] = controller.table.spilled_in_update_order if controller._reads_early else []

    prepare = adopt_asking_for_all if ask_all else _adopt_after_first_step(
        Placement(update, 0.0, 0, notes=("test",), host_sums=True), seen)
    ours, theirs, weights, reference, events, (stats, _, _) = run_both(config, shape=shape, prepare=prepare,
                                                                       inspect=inspect)
    assert ours == theirs
    assert_identical(weights, reference)
    assert seen["spilled_before"] == spilled and (ask_all or seen["listener"].chosen is not None)
    back = spilled - after["spilled"] - after["updated"]
    assert back and after["spilled"] < spilled  # some came back; the rest stay spilled, read early in update order
    assert (len(after["spilled"]) > 0) == (update != 0.5)
    assert after["early"] == sorted(after["spilled"])
    for index in back:
        assert after["homes"][index] == {TierName.HOST}, index
    for index in after["spilled"]:
        assert after["homes"][index] == {TierName.NVME}, index
    for index in after["updated"]:
        assert after["homes"][index] == {TierName.GPU}, index
    assert nbytes_moved(events, "read") > 0 and stats.early_reads > 0


def test_every_spilled_block_the_plan_asks_back_finds_ranges_in_the_room_the_first_blocks_leave(tmpfs_dir, monkeypatch):
    """The 8B scenario's arena at small scale: an embedding larger than a layer, a host budget five layers' moments
    short, a placement moving the embedding and the first layer to the device. The plan asks ten spilled blocks back;
    the room is there by bytes, and by ranges too because the blocks' pinned state is packed at the arena's end
    (``PinnedArena.packed_at_end``): the embedding's ranges join the arena's free room when it leaves (laid out from
    the arena's start, they were holes apart from it and only four of the ten came back). Training stays exact."""
    import runtime.engine.relocation as relocation_module
    from tests.integration.test_parity import nbytes_moved, run_both

    config, shape, spilled = _spilling_session_config(tmpfs_dir, short_by_layers=5, vocab_size=512)
    returns: list = []

    def recording(store, blocks, indices, staying):
        still = bring_moments_home(store, blocks, indices, staying)
        returns.append((list(indices), staying, still))
        return still

    monkeypatch.setattr(relocation_module, "bring_moments_home", recording)
    seen: dict = {}
    after: dict = {}

    def inspect(session) -> None:
        after["updated"] = session.controller.gpu_updated
        after["homes"] = {i: {session.store.record(b.key(kind)).home for kind in ("exp_avg", "exp_avg_sq")}
                          for i, b in enumerate(session.blocks)}

    prepare = _adopt_after_first_step(Placement(0.2, 0.0, 0, notes=("test",), host_sums=True), seen)
    ours, theirs, weights, reference, events, _ = run_both(config, shape=shape, prepare=prepare, inspect=inspect)
    assert ours == theirs
    assert_identical(weights, reference)
    assert after["updated"] == {0, 1}
    assert nbytes_moved(events, "read") > 0  # the moments came back through the NVMe tier
    [(asked, staying, still)] = returns
    assert len(asked) == 10 and set(asked) <= spilled
    assert still == staying  # every block asked back came
    for index in asked:
        assert after["homes"][index] == {TierName.HOST}, index


def test_a_spilled_block_whose_moments_cannot_be_read_back_stays_spilled_and_the_placement_stands(tmpfs_dir, caplog):
    """A read error while a spilled block's moments come back (the second moment of the first block asked back):
    the first goes back to NVMe, the block stays spilled, the rest of the placement is adopted (the controller's
    options say what runs), and training stays exact."""
    from tests.integration.test_parity import run_both

    config, shape, _ = _spilling_session_config(tmpfs_dir, short_by_layers=4)
    seen: dict = {}
    after: dict = {}
    failed: list[str] = []

    def prepare(session) -> None:
        _adopt_after_first_step(Placement(0.5, 0.0, 0, notes=("test",), host_sums=True), seen)(session)
        store, real = session.store, session.store.move_home
        moved_home: list[str] = []

        def failing(key, to):
            if TierName(to) is TierName.HOST and session.controller.gpu_updated:  # bringing moments back
                moved_home.append(str(key))
                if len(moved_home) == 2:
                    failed.append(str(key))
                    raise OSError(5, "Input/output error (test)")
            return real(key, to)

        store.move_home = failing

    def inspect(session) -> None:
        controller = session.controller
        after["spilled"], after["fraction"] = controller.options.spilled_blocks, controller.options.gpu_update_fraction
        after["homes"] = {i: {session.store.record(b.key(kind)).home for kind in ("exp_avg", "exp_avg_sq")}
                          for i, b in enumerate(session.blocks)}
        after["placement"] = session.placement

    caplog.set_level(logging.WARNING, logger="runtime.engine.spill_return")
    ours, theirs, weights, reference, _, _ = run_both(config, shape=shape, prepare=prepare, inspect=inspect)
    assert ours == theirs
    assert_identical(weights, reference)
    assert failed and "moments stay where they were" in caplog.text
    assert after["fraction"] == 0.5 and after["placement"] is seen["listener"].chosen
    assert after["spilled"] and after["spilled"] < seen["spilled_before"]
    for index in after["spilled"]:  # the block whose read failed is among them, both moments on NVMe
        assert after["homes"][index] == {TierName.NVME}, index


def test_the_time_a_placement_takes_at_a_commit_is_in_no_steps_time():
    """Adopting the measured placement runs at the first step's commit (state moved, spilled moments read back; half
    a minute at 8B): the profile leaves it out of both steps' times and says it in its header, so the steady steps
    are not charged with it."""
    import time

    from runtime.profiler import Profiler
    from runtime.profiler.analysis import summarize
    from runtime.profiler.report import format_report

    model, optimizer, reference = _session(0.05)
    session = optimizer.session
    ask, ref = _Asked(Placement(0.4, 0.0, 0, notes=("slow",))), weakref.ref(session)

    def slow_adopt(placement: Placement) -> None:
        time.sleep(0.4)  # a placement that takes measurable time: the profile must leave it out of the steps
        _adopt_placement(ref, placement)

    session.controller.step_listeners.append(FirstStepPlacement(
        plan_gpu_nbytes=GiB, budget_nbytes=20 * GiB, ask=ask, adopt=slow_adopt, peak=lambda: 2 * GiB,
        reset_peak=lambda: None))
    with session, Profiler(session) as profiler:
        _train(model, optimizer, reference, make_batches(3))
        summary = summarize(profiler.raw())
    steps = summary["steps"]
    assert steps[0]["placing_s"] >= 0.4 and all(step["placing_s"] == 0 for step in steps[1:])
    # the second step starts where the placing ended, not at the first step's commit
    assert steps[1]["start_s"] == pytest.approx(steps[0]["start_s"] + steps[0]["step_s"] + steps[0]["placing_s"])
    assert "s after step 1's commit placing the run from its measured peak" in format_report(summary)
