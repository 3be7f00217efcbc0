"""adamw_update on per-parameter views of flat buffers is bit-identical to torch.optim.AdamW(fused=True)."""

from __future__ import annotations

import pytest
import torch

from runtime.update.adam import AdamWHyper, adamw_update, split_views

SIZES = [1, 3, 7, 64, 1001, 4097, 33]


def test_split_views_sizes_offsets_and_sharing():
    flat = torch.arange(20, dtype=torch.float32)
    views = split_views(flat, [3, 0, 5, 12])
    assert [v.numel() for v in views] == [3, 0, 5, 12]
    assert [v.storage_offset() for v in views] == [0, 3, 3, 8]
    assert all(v.dim() == 1 and v.is_contiguous() for v in views)
    assert views[2].tolist() == [3.0, 4.0, 5.0, 6.0, 7.0]
    views[3].fill_(-1.0)  # views, not copies
    assert flat[8:].eq(-1.0).all() and flat[:8].ge(0).all()
    partial = split_views(flat, [2, 2])  # need not cover the whole buffer
    assert [v.storage_offset() for v in partial] == [0, 2]
    assert split_views(flat, []) == []


def test_hyper_defaults_are_torch_adamw_defaults():
    ref = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))]).defaults
    h = AdamWHyper()
    assert (h.lr, (h.beta1, h.beta2), h.eps, h.weight_decay) == (ref["lr"], ref["betas"], ref["eps"], ref["weight_decay"])


@pytest.mark.parametrize("hyper,lr", [
    (AdamWHyper(), None),
    (AdamWHyper(lr=3e-3, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.1), None),
    (AdamWHyper(lr=1.0), 2e-2),  # the per-call lr overrides hyper.lr
])
def test_bit_identical_to_fused_torch_adamw_over_several_steps(hyper, lr):
    torch.manual_seed(0)
    total = sum(SIZES)
    init = torch.randn(total)
    effective_lr = hyper.lr if lr is None else lr
    ref_params = [torch.nn.Parameter(v.clone()) for v in split_views(init, SIZES)]
    ref = torch.optim.AdamW(ref_params, lr=effective_lr, betas=(hyper.beta1, hyper.beta2), eps=hyper.eps,
                            weight_decay=hyper.weight_decay, fused=True)
    master, exp_avg, exp_avg_sq, grad = init.clone(), torch.zeros(total), torch.zeros(total), torch.empty(total)
    steps = [torch.zeros((), dtype=torch.float32) for _ in SIZES]

    for step in range(1, 6):
        g = torch.randn(total) * (10.0 ** (step - 3))  # different magnitudes from step to step
        grad.copy_(g)
        for p, gv in zip(ref_params, split_views(g, SIZES), strict=True):
            p.grad = gv.clone()
        ref.step()
        adamw_update(split_views(master, SIZES), split_views(grad, SIZES), split_views(exp_avg, SIZES),
                     split_views(exp_avg_sq, SIZES), steps, hyper, lr=lr)
        assert [float(s) for s in steps] == [float(step)] * len(SIZES)
        for i, p in enumerate(ref_params):
            state = ref.state[p]
            assert torch.equal(split_views(master, SIZES)[i], p.detach()), f"param {i} step {step}"
            assert torch.equal(split_views(exp_avg, SIZES)[i], state["exp_avg"])
            assert torch.equal(split_views(exp_avg_sq, SIZES)[i], state["exp_avg_sq"])
            assert float(state["step"]) == float(steps[i])
    assert not torch.equal(master, init)


def test_own_step_counters_per_parameter():
    """A parameter left out of a call keeps its step count (and its bias correction) as in the reference."""
    torch.manual_seed(1)
    hyper = AdamWHyper(lr=1e-2)
    ref_params = [torch.nn.Parameter(torch.randn(n)) for n in (5, 9)]
    ref = torch.optim.AdamW(ref_params, lr=hyper.lr, fused=True)
    sizes = [5, 9]
    master = torch.cat([p.detach().clone() for p in ref_params])
    m, v, grad = torch.zeros(14), torch.zeros(14), torch.zeros(14)
    steps = [torch.zeros(()), torch.zeros(())]
    for it in range(4):
        g = torch.randn(14)
        both = it % 2 == 0
        ref_params[0].grad = g[:5].clone()
        ref_params[1].grad = g[5:].clone() if both else None
        ref.step()
        grad.copy_(g)
        keep = [True, both]
        pick = lambda views, keep=keep: [x for x, k in zip(views, keep, strict=True) if k]  # noqa: E731
        adamw_update(pick(split_views(master, sizes)), pick(split_views(grad, sizes)), pick(split_views(m, sizes)),
                     pick(split_views(v, sizes)), pick(steps), hyper)
    assert [float(s) for s in steps] == [4.0, 2.0]
    assert torch.equal(master[:5], ref_params[0].detach())
    assert torch.equal(master[5:], ref_params[1].detach())
    assert torch.equal(m[5:], ref.state[ref_params[1]]["exp_avg"])


def test_empty_lists_are_a_no_op():
    adamw_update([], [], [], [], [], AdamWHyper())  # nothing to do, no error


def test_updates_in_place_only_within_the_views():
    """Elements of the flat buffers outside the views are untouched."""
    master = torch.ones(10)
    grad = torch.full((10,), 0.5)
    m, v = torch.zeros(10), torch.zeros(10)
    steps = [torch.zeros(())]
    views = lambda t: [t[2:6]]  # noqa: E731
    adamw_update(views(master), views(grad), views(m), views(v), steps, AdamWHyper(lr=0.1))
    assert torch.equal(master[:2], torch.ones(2)) and torch.equal(master[6:], torch.ones(4))
    assert master[2:6].lt(1.0).all()
    assert torch.equal(m[:2], torch.zeros(2)) and m[2:6].gt(0).all() and v[2:6].gt(0).all()


@pytest.mark.parametrize("piece", [64, 4096, 1 << 20])
def test_out_of_place_update_is_bit_identical_and_leaves_the_old_state(piece):
    from runtime.update.adam import adamw_update_grouped, adamw_update_out_of_place

    torch.manual_seed(0)
    sizes = [3000, 70001, 17, 1 << 16, 5]
    hypers = [AdamWHyper(lr=1e-2), AdamWHyper(lr=1e-2), AdamWHyper(lr=3e-3, weight_decay=0.0), AdamWHyper(lr=1e-2),
              AdamWHyper(lr=1e-2, eps=1e-6)]
    grads = [torch.randn(n) for n in sizes]
    state = [[torch.randn(n) for n in sizes], [torch.randn(n) for n in sizes], [torch.rand(n) for n in sizes]]
    in_place = [[t.clone() for t in kind] for kind in state]
    steps_in_place = [torch.tensor(3.0) for _ in sizes]
    adamw_update_grouped(*in_place[:1], grads, *in_place[1:], steps_in_place, hypers)
    old = [[t.clone() for t in kind] for kind in state]
    new = [[torch.full_like(t, float("nan")) for t in kind] for kind in state]
    steps = [torch.tensor(3.0) for _ in sizes]
    adamw_update_out_of_place(tuple(old), tuple(new), grads, steps, hypers, piece_numel=piece)
    for kind in range(3):
        for got, want, before, kept in zip(new[kind], in_place[kind], state[kind], old[kind], strict=True):
            assert torch.equal(got, want)
            assert torch.equal(kept, before)
    assert [float(s) for s in steps] == [4.0] * len(sizes)
