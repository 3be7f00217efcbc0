"""The plan's compute-dtype copy of the weights with the fp32 master in pinned host memory (WeightSource.WEIGHTS,
master home host): every path that changes the master must refresh the copy. The plan takes the copy only on a GPU;
these tests make it take it on the CPU (as test_parity does) and compare with the same run fetching the master,
or with the mixed-precision reference loop."""

from __future__ import annotations

import pytest
import torch

from runtime import offload
from runtime.bundled.example_model import ExampleLM
from runtime.planning.memory_plan import WeightSource
from tests.integration.test_parity import SHAPE, assert_identical, force_weights_copy, make_batches, run_both
from tests.integration.test_user_contract import abandon_in_backward, assert_same

ACC = 2


@pytest.fixture
def force_copy(monkeypatch):
    force_weights_copy(monkeypatch)


def _config(**optimizer) -> dict:
    return {"device": "cpu", "dtype": "bf16",
            "optimizer": {"accumulation_steps": ACC, "grad_clip": None, **optimizer}}


def _session(seed: int = 0, **optimizer):
    torch.manual_seed(seed)
    model, optimizer_ = offload(ExampleLM(SHAPE), _config(**optimizer))
    return model, optimizer_, optimizer_.session


def _train(model, optimizer, batches) -> list[float]:
    losses = []
    for start in range(0, len(batches), ACC):
        for x, y in batches[start : start + ACC]:
            loss = model(x, y)
            losses.append(loss.item())
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return losses


def _fetched_weights(model) -> dict[str, torch.Tensor]:
    """What the next forward computes with: each parameter read through the guard (fetched from the copy)."""
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _masters_as_bf16(session) -> dict[str, torch.Tensor]:
    return {n: t.to(torch.bfloat16) for n, t in session.master_state_dict().items()}


def test_the_copy_is_taken_with_the_master_in_host_memory(force_copy):
    model, optimizer, session = _session()
    with session:
        assert session.controller.options.weight_source is WeightSource.WEIGHTS
        assert session.store.record(session.blocks[0].key("master")).home.value == "host"


@pytest.mark.parametrize("clip", [1e6, 1e-3])
def test_published_and_redone_early_updates_refresh_the_copy(force_copy, clip):
    """grad_clip 1e6: every early (pre-commit) update is published; 1e-3: they are redone after the clip. Each
    commit first lets the early updates run (on a loaded machine the worker may not have started them by the
    commit, which then withdraws them: neither path would run)."""
    def early_updates_first(session) -> None:  # noqa: ANN001
        controller = session.controller
        commit = controller.step

        def step() -> None:
            controller.worker.drain()
            commit()

        controller.step = step

    config = {"dtype": "bf16", "optimizer": {"accumulation_steps": ACC, "grad_clip": clip}}
    ours, theirs, weights, reference, _, (_, _, worker) = run_both(config, dtype=torch.bfloat16, steps=3,
                                                                   prepare=early_updates_first)
    assert ours == theirs
    assert_identical(weights, reference)
    assert (worker.published if clip > 1 else worker.redone) > 0


def test_fp16_skipped_overflow_steps_with_the_copy(force_copy):
    config = {"dtype": "fp16", "optimizer": {"accumulation_steps": ACC, "grad_clip": 1.0,
                                             "loss_scale": {"initial": 2.0**18}}}
    ours, theirs, weights, reference, _, (stats, _, _) = run_both(config, steps=5, dtype=torch.float16,
                                                                   loss_scale=2.0**18)
    assert 1 <= reference.skipped < 5 and stats.skipped_steps == reference.skipped
    assert ours == theirs
    assert_identical(weights, reference)


def test_part_of_the_update_on_the_device_with_the_copy(force_copy):
    config = {"dtype": "bf16", "optimizer": {"accumulation_steps": ACC, "gpu_update_fraction": 0.4}}
    ours, theirs, weights, reference, _, _ = run_both(config, dtype=torch.bfloat16, steps=3)
    assert ours == theirs
    assert_identical(weights, reference)


def _writes_between_steps(monkeypatch, force: bool):
    if force:
        force_weights_copy(monkeypatch)
    batches = make_batches(3 * ACC)
    model, optimizer, session = _session()
    with session:
        assert (session.controller.options.weight_source is WeightSource.WEIGHTS) == force
        losses = _train(model, optimizer, batches[:ACC])
        with torch.no_grad():
            model.layers[0].qkv.weight.mul_(0.5)  # an in-place write on the parameter
            model.layers[1].down.weight.data.copy_(torch.full_like(model.layers[1].down.weight, 0.25))  # via .data
            model.layers[2].gate_up.weight[0].fill_(2.0)  # into a view
        fetched = _fetched_weights(model)
        assert_same(fetched, _masters_as_bf16(session))  # what a read fetches: the written weights
        losses += _train(model, optimizer, batches[ACC : 2 * ACC])
        pretrained = {n: t.clone() for n, t in ExampleLM(SHAPE).state_dict().items()}  # a fresh model's weights
        model.load_state_dict(pretrained)
        assert_same(_fetched_weights(model), _masters_as_bf16(session))
        losses += _train(model, optimizer, batches[2 * ACC :])
        masters = session.master_state_dict()
    return losses, masters, fetched


def test_user_writes_between_steps_reach_the_copy(monkeypatch):
    """In-place writes, ``.data.copy_`` and ``load_state_dict`` between steps: the copy follows the master, and
    training goes on exactly as when the master itself is fetched."""
    plain = _writes_between_steps(monkeypatch, force=False)
    copied = _writes_between_steps(monkeypatch, force=True)
    assert copied[0] == plain[0]
    assert_same(copied[1], plain[1])
    assert_same(copied[2], plain[2])


@pytest.mark.parametrize("clip", [None, 1e6])
def test_checkpoint_round_trip_with_the_copy(force_copy, tmp_path, clip):
    """Save after two steps, train two more; a second session that trained elsewhere loads the checkpoint and
    must train the same two steps with the same losses and end with the same masters."""
    from runtime.checkpoint.state import load_checkpoint, save_checkpoint

    batches = make_batches(4 * ACC)
    model, optimizer, session = _session(grad_clip=clip)
    with session:
        _train(model, optimizer, batches[: 2 * ACC])
        save_checkpoint(session, tmp_path / "ckpt")
        expected = _train(model, optimizer, batches[2 * ACC :])
        expected_masters = session.master_state_dict()
    model, optimizer, session = _session(seed=7, grad_clip=clip)
    with session:
        assert session.controller.options.weight_source is WeightSource.WEIGHTS
        _train(model, optimizer, batches[-ACC:])  # the copy and the fetched blocks hold other values
        _fetched_weights(model)  # leave blocks fetched for a read
        assert load_checkpoint(session, tmp_path / "ckpt") == 2
        assert_same(_fetched_weights(model), _masters_as_bf16(session))
        assert _train(model, optimizer, batches[2 * ACC :]) == expected
        assert_same(session.master_state_dict(), expected_masters)


def test_moments_on_nvme_with_the_copy(force_copy, tmpfs_dir):
    """Master in pinned memory, moments on NVMe (no pre-commit buffers), clipping: the copy follows every update."""
    config = {"dtype": "bf16", "tiers": {"nvme": {"path": str(tmpfs_dir)}}, "placement": {"master": "host", "moments": "nvme"},
              "optimizer": {"accumulation_steps": ACC, "grad_clip": 1e6}}
    seen = {}
    ours, theirs, weights, reference, _, _ = run_both(
        config, dtype=torch.bfloat16, steps=3,
        inspect=lambda session: seen.update(source=session.controller.options.weight_source))
    assert seen["source"] is WeightSource.WEIGHTS
    assert ours == theirs
    assert_identical(weights, reference)


def test_an_explicit_host_budget_that_holds_the_copy_takes_it_with_swap_on_tmpfs():
    """Under an explicit ``tiers.host.budget`` the copy is weighed against the pinned pool's size, as the spill is:
    swap files on tmpfs are RAM but not the pool. A budget that holds the copy plan's pinned bytes with room to
    spare (``check_fits`` accepts that plan), though less than its pinned bytes and swap files together, takes it."""
    from runtime.config.loader import load_config
    from runtime.core.blocks import build_blocks
    from runtime.planning.hostmem import ram_backed
    from runtime.planning.memory_plan import check_fits
    from runtime.planning.placement import resolve_plan
    from tests.unit.runtime.planning.test_auto_placement import REFERENCE
    from tierstore import swap_tmp_root

    if not ram_backed(swap_tmp_root()):
        pytest.skip("the tmp swap path is not on tmpfs here")
    blocks = build_blocks(ExampleLM(SHAPE), 1)
    total = sum(b.numel for b in blocks)
    cuda = torch.device("cuda", 0)

    def config(budget: int | str) -> dict:
        return {"dtype": "bf16", "placement": {"master": "host", "moments": "nvme"},
                "tiers": {"gpu": {"budget": 64 * total}, "host": {"budget": budget}, "nvme": {"path": "tmp"}},
                "optimizer": {"accumulation_steps": 16, "gpu_update_fraction": 0.25, "gpu_stream_fraction": 0,
                              "grad_clip": None}}

    roomy = resolve_plan(blocks, load_config(config(1 << 40)), cuda, rates=REFERENCE)
    assert roomy.source is WeightSource.WEIGHTS
    assert roomy.plan.nvme_nbytes > 0
    # The copy plan's pinned bytes and room to spare, less than its pinned bytes and its swap files together.
    budget = roomy.plan.host_nbytes + roomy.plan.nvme_nbytes // 2
    check_fits(roomy.plan, load_config(config(budget)), torch.device("cpu"))  # that budget holds the copy plan
    resolved = resolve_plan(blocks, load_config(config(budget)), cuda, rates=REFERENCE)
    assert resolved.source is WeightSource.WEIGHTS, [n for n in resolved.plan.notes if "placement.weights" in n]


def _run_with_failures(monkeypatch, force: bool, where: str, clip: float | None):
    """Four accumulated steps with failures planted in micro-batch 1 of step 1 and micro-batch 0 of step 2, each
    caught by the loop, which then drops the step with ``zero_grad()`` (tests/integration/test_failures.py)."""
    from tests.integration.test_failures import plant, run

    if force:
        force_weights_copy(monkeypatch)
    batches = make_batches(4 * ACC)
    torch.manual_seed(0)
    model = ExampleLM(SHAPE)
    armed = plant(model, 1, where)
    # Without a clip, updates wait for step() only with user_grad_clip (streaming ones cannot be rolled back).
    model, optimizer = offload(model, _config(grad_clip=clip) if clip else _config(user_grad_clip=True))
    session = optimizer.session
    with session:
        assert (session.controller.options.weight_source is WeightSource.WEIGHTS) == force
        run(model, optimizer, armed, batches, {(1, 1), (2, 0)}, ACC)
        fetched = _fetched_weights(model)
        masters = session.master_state_dict()
        if force:  # the copy holds the committed master, not a dropped step's update
            assert_same(fetched, _masters_as_bf16(session))
        losses = _train(model, optimizer, batches[:ACC])  # and training goes on from there
    return fetched, masters, losses


@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("clip", [None, 1e-3])
def test_a_caught_failure_mid_step_leaves_the_copy_at_the_last_commit(monkeypatch, where, clip):
    """An exception in a micro-batch's forward or backward, caught by the user's loop: the dropped step changes
    neither the master nor the copy (clip 1e-3: every early update would have been redone), so the run with the
    copy ends exactly where the run fetching the master does."""
    plain = _run_with_failures(monkeypatch, False, where, clip)
    copied = _run_with_failures(monkeypatch, True, where, clip)
    assert_same(copied[0], plain[0])
    assert_same(copied[1], plain[1])
    assert copied[2] == plain[2]


def test_a_placement_change_with_the_copy_and_accumulation(force_copy):
    """After the first step the first blocks move to the device (runtime.planning.measured_placement does this on a GPU):
    their copy goes, their weights are cast from the device master, the rest keep refreshing theirs; bit-identical
    to the mixed-precision reference over micro-batches."""
    from tests.integration.reference_loop import ReferenceTrainer

    torch.manual_seed(0)
    model = ExampleLM(SHAPE)
    reference = ReferenceTrainer(model, dtype=torch.bfloat16, accumulation_steps=ACC)
    model, optimizer = offload(model, _config())
    session = optimizer.session
    batches = make_batches(3 * ACC)
    with session:
        assert session.controller.options.weight_source is WeightSource.WEIGHTS
        ours = _train(model, optimizer, batches[:ACC])
        session.controller.adopt_placement(0.4, 0.0, 0)
        moved = session.controller.gpu_updated
        assert moved and all(not session.store.has(session.blocks[i].key("weights")) for i in moved)
        ours += _train(model, optimizer, batches[ACC:])
        theirs = [loss for start in range(0, len(batches), ACC)
                  for loss in reference.train_step(batches[start : start + ACC])]
        assert ours == theirs
        assert_identical(session.master_state_dict(), reference)


def test_a_write_after_an_abandoned_streaming_step_refreshes_the_copy(force_copy):
    """An abandoned streaming step (a backward that raised part-way) refuses reads, but a write is still a write:
    it reached the master and then failed refreshing the copy with the reads' refusal, leaving the copy stale
    (found by a review). Now the write and a load_state_dict go through; reads stay refused."""
    model, optimizer, session = _session()
    assert session.controller.options.weight_source is WeightSource.WEIGHTS
    batches = make_batches(3)
    with session:
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        model(*batches[0]).backward()
        abandon_in_backward(model, optimizer, batches[1])
        assert session.controller.interrupted is not None
        with torch.no_grad():
            model.layers[0].qkv.weight.mul_(0.5)  # a write: allowed
        model.load_state_dict(saved)  # writes every block's master and copy
        with pytest.raises(RuntimeError, match="would mix two steps"):
            model.state_dict()
