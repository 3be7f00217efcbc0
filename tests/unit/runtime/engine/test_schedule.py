"""PrefetchSchedule: traces per signature, predictions within depth and byte budget, re-synchronisation
and repair after divergence, hit / miss counters."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.engine.schedule import PrefetchSchedule, ScheduleStats

FWD_BWD = [(0, "fwd"), (1, "fwd"), (2, "fwd"), (3, "fwd"), (3, "bwd"), (2, "bwd"), (1, "bwd"), (0, "bwd")]


def make(depth: int = 2, budget: int = 1 << 30, sizes: dict[int, int] | None = None) -> PrefetchSchedule:
    return PrefetchSchedule(depth, budget, lambda b: (sizes or {}).get(b, 100))


def run_step(schedule: PrefetchSchedule, uses, signature: str = "train") -> list[list[int]]:
    """One step; returns upcoming() after each use."""
    schedule.begin(signature)
    seen = []
    for block, phase in uses:
        schedule.observe(block, phase)
        seen.append(schedule.upcoming())
    schedule.end()
    return seen


def second_pass(schedule: PrefetchSchedule, seen: int) -> None:
    """Trace FWD_BWD, then begin a second pass and observe its first ``seen`` uses."""
    run_step(schedule, FWD_BWD)
    schedule.begin("train")
    for use in FWD_BWD[:seen]:
        schedule.observe(*use)


def test_first_step_records_the_trace_and_predicts_nothing():
    s = make()
    assert s.traces() == {}
    s.begin("train")
    assert s.signature == "train"
    for use in FWD_BWD:
        s.observe(*use)
        assert s.upcoming() == []  # no trace yet for this signature
        assert not s.needed_within(use[0], 10)
    s.end()
    assert s.signature is None
    assert s.traces() == {"train": FWD_BWD}
    assert s.stats == ScheduleStats()  # recording is neither a divergence nor a repair


def test_traces_returns_a_copy():
    s = make()
    run_step(s, FWD_BWD)
    s.traces()["train"].clear()
    assert s.traces()["train"] == FWD_BWD


def test_upcoming_follows_the_trace_within_depth():
    s = make(depth=2)
    run_step(s, FWD_BWD)
    s.begin("train")
    assert s.upcoming() == [0, 1]  # before the first use: the first blocks of the step
    assert s.upcoming(limit=5) == [0, 1, 2, 3]  # distinct blocks only
    s.observe(0, "fwd")
    assert s.upcoming() == [1, 2]
    s.observe(1, "fwd")
    s.observe(2, "fwd")
    assert s.upcoming() == [3, 2]  # (3, fwd), (3, bwd) count once, then (2, bwd)
    assert s.upcoming(limit=1) == [3]
    s.observe(3, "fwd")
    assert s.upcoming() == [3, 2]
    s.observe(3, "bwd")
    assert s.upcoming() == [2, 1]
    assert s.upcoming(limit=0) == []
    for use in FWD_BWD[5:]:
        s.observe(*use)
    assert s.upcoming() == []
    s.end()
    assert s.stats.divergences == 0 and s.stats.repairs == 0


def test_depth_zero_predicts_nothing_and_negative_depth_is_refused():
    s = make(depth=0)
    run_step(s, FWD_BWD)
    s.begin("train")
    assert s.upcoming() == []
    with pytest.raises(ValueError, match="depth"):
        make(depth=-1)


def test_upcoming_honours_the_byte_budget_but_always_allows_the_first_block():
    sizes = {0: 100, 1: 100, 2: 300, 3: 50}
    s = make(depth=4, budget=250, sizes=sizes)
    run_step(s, FWD_BWD)
    s.begin("train")
    assert s.upcoming() == [0, 1]  # 0 + 1 = 200; block 2 would make 500 > 250
    s.observe(0, "fwd")
    assert s.upcoming() == [1]  # 100 + 300 > 250: stops at the first block over budget (no skipping ahead)
    s.observe(1, "fwd")
    assert s.upcoming() == [2]  # alone over the budget, but the first block is always allowed
    s.observe(2, "fwd")
    assert s.upcoming() == [3]  # 50 + 300 > 250
    s.budget_nbytes = 350
    assert s.upcoming() == [3, 2]  # 350 <= 350


def test_budget_exactly_reached_is_allowed():
    s = make(depth=4, budget=200, sizes={0: 100, 1: 100, 2: 1})
    run_step(s, [(0, "fwd"), (1, "fwd"), (2, "fwd")])
    s.begin("train")
    assert s.upcoming() == [0, 1]  # 200 <= 200, then 201 > 200


def test_needed_within():
    s = make()
    second_pass(s, 3)
    # Next uses: (3, fwd), (3, bwd), (2, bwd), (1, bwd), (0, bwd)
    assert s.needed_within(3, 1)
    assert not s.needed_within(2, 2)
    assert s.needed_within(2, 3)
    assert not s.needed_within(0, 4)
    assert s.needed_within(0, 5)
    assert not s.needed_within(7, 100)
    assert not s.needed_within(3, 0)


def test_divergence_resynchronises_on_the_next_matching_use():
    s = make(depth=2)
    run_step(s, FWD_BWD)
    s.begin("train")
    s.observe(0, "fwd")
    s.observe(9, "fwd")  # not in the trace at all: the cursor stays put
    assert s.stats.divergences == 1
    assert s.upcoming() == [1, 2]
    s.observe(2, "fwd")  # skips (1, fwd): re-synchronises just past (2, fwd)
    assert s.stats.divergences == 2
    assert s.upcoming() == [3, 2]
    s.observe(3, "fwd")  # matches at the cursor
    assert s.stats.divergences == 2
    assert s.upcoming() == [3, 2]


def test_a_use_behind_the_cursor_does_not_move_it_back():
    s = make(depth=1)
    second_pass(s, 3)
    s.observe(0, "fwd")  # already passed, and not ahead: cursor stays
    assert s.stats.divergences == 1
    assert s.upcoming() == [3]


def test_divergent_step_replaces_the_trace_and_counts_a_repair():
    s = make(depth=2)
    run_step(s, FWD_BWD)
    other = [(0, "fwd"), (2, "fwd"), (1, "fwd"), (1, "bwd"), (2, "bwd"), (0, "bwd")]
    run_step(s, other)
    assert s.stats.repairs == 1
    assert s.stats.divergences > 0
    assert s.traces()["train"] == other
    # The repaired trace now predicts the new path with no divergence.
    before = s.stats.divergences
    seen = run_step(s, other)
    assert s.stats.divergences == before
    assert s.stats.repairs == 1
    assert seen[0] == [2, 1]


def test_a_shorter_step_without_divergence_also_replaces_the_trace():
    s = make()
    run_step(s, FWD_BWD)
    run_step(s, FWD_BWD[:4])  # a prefix: no use diverged, but the length differs (e.g. eval without backward)
    assert s.stats.divergences == 0
    assert s.stats.repairs == 1
    assert s.traces()["train"] == FWD_BWD[:4]


def test_identical_step_keeps_the_trace_without_repair():
    s = make()
    run_step(s, FWD_BWD)
    for _ in range(3):
        run_step(s, FWD_BWD)
    assert s.stats.repairs == 0 and s.stats.divergences == 0
    assert s.traces() == {"train": FWD_BWD}


def test_separate_signatures_keep_separate_traces():
    s = make(depth=1)
    evaluation = [(0, "fwd"), (1, "fwd"), (2, "fwd"), (3, "fwd")]
    run_step(s, FWD_BWD, "train")
    run_step(s, evaluation, "eval")
    assert s.traces() == {"train": FWD_BWD, "eval": evaluation}
    assert s.stats.repairs == 0 and s.stats.divergences == 0
    # Each signature is followed with its own trace.
    assert run_step(s, evaluation, "eval")[-1] == []
    assert run_step(s, FWD_BWD, "train")[3] == [3]
    assert s.stats.repairs == 0 and s.stats.divergences == 0


def test_begin_ends_the_step_in_progress():
    s = make()
    s.begin("train")
    s.observe(0, "fwd")
    s.begin("eval")  # ends "train", recording its trace
    assert s.traces() == {"train": [(0, "fwd")]}
    assert s.signature == "eval"


def test_observe_without_begin_opens_an_other_step():
    s = make()
    s.observe(5, "fwd")
    assert s.signature == "other"
    s.end()
    assert s.traces() == {"other": [(5, "fwd")]}
    s.end()  # ending with no step in progress is a no-op
    assert s.traces() == {"other": [(5, "fwd")]}


def test_hit_miss_counting_and_hit_rate():
    s = make()
    assert s.stats.hit_rate == 1.0  # before any use
    s.record_fetch(True)
    s.record_fetch(True)
    s.record_fetch(False)
    assert (s.stats.hits, s.stats.misses) == (2, 1)
    assert s.stats.hit_rate == pytest.approx(2 / 3)
    for _ in range(3):
        s.record_fetch(False)
    assert s.stats.hit_rate == pytest.approx(2 / 6)


USES = st.lists(st.tuples(st.integers(0, 6), st.sampled_from(["fwd", "bwd", "recompute"])), min_size=1, max_size=40)


def expected_upcoming(remaining, depth: int, budget: int, sizes) -> list[int]:
    picked, total = [], 0
    for block, _ in remaining:
        if len(picked) >= depth:
            break
        if block in picked:
            continue
        if picked and total + sizes(block) > budget:
            break
        picked.append(block)
        total += sizes(block)
    return picked


@settings(max_examples=150, deadline=None)
@given(uses=USES, other=USES, depth=st.integers(0, 4), budget=st.integers(1, 800))
def test_replaying_a_sequence_never_diverges_and_predicts_what_comes_next(uses, other, depth, budget):
    sizes = lambda b: 50 * (b + 1)  # noqa: E731
    s = PrefetchSchedule(depth, budget, sizes)
    run_step(s, other)  # some earlier trace of the same signature, possibly different
    run_step(s, uses)  # repairs it when it differs
    assert s.traces()["train"] == uses
    divergences, repairs = s.stats.divergences, s.stats.repairs
    s.begin("train")
    for i, use in enumerate(uses):
        s.observe(*use)
        remaining = uses[i + 1 :]
        got = s.upcoming()
        assert got == expected_upcoming(remaining, depth, budget, sizes)
        assert len(got) == len(set(got)) <= depth
        next_blocks = [b for b, _ in remaining]
        # Every predicted block really comes next, in the order of first appearance.
        assert got == sorted(got, key=next_blocks.index)
        if got:
            assert got[0] == next_blocks[0]
        for block in range(7):
            assert s.needed_within(block, 3) == (block in next_blocks[:3])
    s.end()
    assert s.stats.divergences == divergences
    assert s.stats.repairs == repairs
    assert s.traces()["train"] == uses


def test_upcoming_passes_over_blocks_that_are_never_fetched():
    """A block updated on the device keeps its weights there: it takes no place in the window or the depth."""
    s = PrefetchSchedule(2, 1 << 30, lambda b: 100, fetched=lambda b: b != 0)
    run_step(s, FWD_BWD)
    s.begin("train")
    assert s.upcoming() == [1, 2]  # block 0 is first in the trace but stays on the device


def test_wrap_limit_continues_into_the_next_pass_only_past_the_trace_end():
    s = make(depth=2)
    second_pass(s, 4)
    assert s.upcoming(wrap_limit=3) == [3, 2]  # the trace still holds `depth` blocks: no wrap
    for use in FWD_BWD[4:7]:
        s.observe(*use)
    assert s.upcoming() == [0]  # (0, bwd) is all that is left of this pass
    assert s.upcoming(wrap_limit=3) == [0, 1, 2]  # then the next pass's first blocks, 3 in all
    s.observe(*FWD_BWD[7])
    assert s.upcoming() == []
    assert s.upcoming(wrap_limit=3) == [0, 1, 2]


def test_wrap_limit_counts_the_bytes_already_picked():
    s = make(depth=2, budget=250, sizes={0: 100, 1: 100, 2: 100})
    second_pass(s, 7)
    assert s.upcoming(wrap_limit=3) == [0, 1]  # (0, bwd) left, then block 1; block 2 would pass 250 bytes


def test_a_pass_cut_short_by_the_byte_budget_does_not_wrap():
    """The blocks of this pass that the budget leaves out come before the next pass's: the budget stops both."""
    s = make(depth=2, budget=250, sizes={3: 100, 2: 200, 0: 100})
    second_pass(s, 4)
    assert s.upcoming(wrap_limit=3) == [3]  # block 2 would pass 250 bytes: not block 0 of the next pass instead
