"""The user's contract: an offloaded model is still an ordinary nn.Module, and its optimizer a torch optimizer.

Each test runs an unchanged plain PyTorch loop next to the offloaded one (fp32 on the CPU, so equal means
bit-identical) and touches the model the way a user does: reading parameters between steps, state_dict,
load_state_dict, torch.save, clip_grad_norm_, param groups, optimizer state_dict, close().
"""

from __future__ import annotations

import copy
import dataclasses
import io
from collections.abc import Callable

import pytest
import torch
from torch import nn

from runtime import offload
from runtime.bundled.example_model import ExampleLM, ModelShape
from runtime.engine.step_phase import StepPhase
from tests.integration.test_parity import make_batches

SHAPE = ModelShape(vocab_size=256, hidden_size=32, num_layers=3, num_heads=4, ffn_size=64, max_seq_len=64)
LR = 1e-3


def config(tmp_path, **optimizer) -> dict:
    opt = {"lr": LR, "weight_decay": 0.01, "grad_clip": None, **optimizer}
    (tmp_path / "swap").mkdir(parents=True, exist_ok=True)
    return {"device": "cpu", "dtype": "fp32", "optimizer": opt,
            "tiers": {"nvme": {"path": str(tmp_path / "swap")}},
            "placement": {"master": "nvme", "moments": "nvme"}}


def fresh_model(seed: int = 0) -> ExampleLM:
    torch.manual_seed(seed)
    return ExampleLM(SHAPE)


def plain_step(model: nn.Module, opt: torch.optim.Optimizer, batch, clip: float | None = None) -> torch.Tensor | None:
    loss = model(*batch)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip) if clip is not None else None
    opt.step()
    opt.zero_grad()
    return norm


def plain_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    """The reference: the same model with torch's fused AdamW and the config's hyper-parameters."""
    plain = fresh_model()
    return plain, torch.optim.AdamW(plain.parameters(), lr=LR, weight_decay=0.01, fused=True)


def offloaded_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch) -> None:
    """One step of the user's unchanged loop on the offloaded model."""
    model(*batch).backward()
    optimizer.step()
    optimizer.zero_grad()


def assert_same(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    assert ours.keys() == theirs.keys()
    for name in theirs:
        assert torch.equal(ours[name].cpu(), theirs[name].detach().cpu()), name


def edit_then_train_both(edit: Callable[[nn.Module], None], plain: tuple[nn.Module, torch.optim.Optimizer],
                         offloaded: tuple[nn.Module, torch.optim.Optimizer]) -> None:
    """The same edit of both models between steps, then two steps of each: equal weights and masters after the
    edit, equal weights after the steps."""
    edit(plain[0])
    edit(offloaded[0])
    assert_same(offloaded[0].state_dict(), plain[0].state_dict())
    assert_same(offloaded[1].session.master_state_dict(), plain[0].state_dict())
    for batch in make_batches(2):
        plain_step(*plain, batch)
        offloaded_step(*offloaded, batch)
    assert_same(offloaded[0].state_dict(), plain[0].state_dict())


def test_parameters_read_between_steps_equal_the_plain_loop(tmp_path):
    plain, plain_opt = plain_model()
    model, optimizer = offload(fresh_model(), config(tmp_path))
    try:
        for batch in make_batches(3):
            plain_step(plain, plain_opt, batch)
            offloaded_step(model, optimizer, batch)
            # The reads a user makes: clone by name, norms, a view kept across a step, repr.
            snapshot = {n: p.clone() for n, p in model.named_parameters()}
            assert_same(snapshot, dict(plain.named_parameters()))
            assert torch.equal(model.layers[1].gate_up.weight.norm(), plain.layers[1].gate_up.weight.norm())
            assert "Parameter containing" in repr(model.layers[0].qkv.weight)
        view = model.layers[2].down.weight.detach()
        batch = make_batches(4)[3]
        plain_step(plain, plain_opt, batch)
        offloaded_step(model, optimizer, batch)
        assert torch.equal(view, plain.layers[2].down.weight.detach())  # a view follows the parameter
        assert_same(model.state_dict(), plain.state_dict())
    finally:
        optimizer.session.close()
    # After close() the model is a plain module holding the trained weights.
    assert type(model.layers[0].qkv.weight) is nn.Parameter
    assert_same(dict(model.named_parameters()), dict(plain.named_parameters()))
    batch = make_batches(1, seed=3)[0]
    assert torch.equal(model(*batch), plain(*batch))


def test_state_dict_saves_into_a_fresh_model_and_pretrained_weights_load(tmp_path):
    model, optimizer = offload(fresh_model(), config(tmp_path))
    with optimizer.session:
        for batch in make_batches(2):
            offloaded_step(model, optimizer, batch)
        buffer = io.BytesIO()
        torch.save(model.state_dict(), buffer)
        expected = optimizer.session.master_state_dict()
    buffer.seek(0)
    restored = fresh_model(seed=1)
    restored.load_state_dict(torch.load(buffer))
    assert_same(dict(restored.named_parameters()), expected)

    # offload first, then load pretrained weights: fine-tuning equals the plain loop started from them.
    pretrained = fresh_model(seed=7).state_dict()
    plain = fresh_model()
    plain.load_state_dict(pretrained)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=LR, weight_decay=0.01, fused=True)
    model, optimizer = offload(fresh_model(), config(tmp_path))
    with optimizer.session:
        model.load_state_dict(pretrained)
        assert_same(model.state_dict(), pretrained)
        for batch in make_batches(3):
            plain_step(plain, plain_opt, batch)
            offloaded_step(model, optimizer, batch)
        assert_same(model.state_dict(), plain.state_dict())
        with pytest.raises(RuntimeError, match="assign"):
            model.load_state_dict(pretrained, assign=True)


@pytest.mark.parametrize("how", ["torch", "optimizer"])
def test_user_clipping_is_exact_and_returns_the_true_norm(tmp_path, how):
    plain, plain_opt = plain_model()
    model, optimizer = offload(fresh_model(), config(tmp_path, user_grad_clip=True))
    with optimizer.session:
        for step, batch in enumerate(make_batches(4)):
            clip = 0.05 if step % 2 else 100.0  # clips on odd steps, not on even ones
            expected = plain_step(plain, plain_opt, batch, clip)
            model(*batch).backward()
            if how == "torch":
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            else:
                norm = optimizer.clip_grad_norm_(clip)
            optimizer.step()
            optimizer.zero_grad()
            assert torch.equal(norm, expected)
            assert optimizer.last_grad_norm == float(expected)
        assert_same(model.state_dict(), plain.state_dict())


@pytest.mark.parametrize("loop_clip", [None, 5.0], ids=["no-clip", "clip-5"])
def test_user_grad_clip_leaves_tierstore_s_own_clip_off_by_default(tmp_path, loop_clip):
    """With ``user_grad_clip: true`` and ``grad_clip`` left out, the loop's clip is the only one, as in plain
    PyTorch: at 5.0 (binding in the last window only) and with none at all (the HF Trainer's max_grad_norm=0), under
    accumulation, bit for bit. tierstore's default 1.0 used to clip these steps on top (found by an audit)."""
    plain, plain_opt = plain_model()
    cfg = config(tmp_path, user_grad_clip=True, accumulation_steps=2)
    del cfg["optimizer"]["grad_clip"]  # left out: `auto`
    model, optimizer = offload(fresh_model(), cfg)
    batches = make_batches(6)
    with optimizer.session:
        for i in range(0, len(batches), 2):
            for m, opt in ((plain, plain_opt), (model, optimizer)):
                for batch in batches[i:i + 2]:
                    m(*batch).backward()
                if loop_clip is not None:
                    torch.nn.utils.clip_grad_norm_(m.parameters(), loop_clip)
                opt.step()
                opt.zero_grad()
        assert_same(model.state_dict(), plain.state_dict())


def test_a_loop_clip_beside_tierstore_s_clip_is_refused_not_stacked(tmp_path):
    """tierstore's default clip (1.0) and a clip in the loop would clip every step twice: refused at the loop's clip
    with the key to set, and refused in the config where both are set by hand. A multiply by hand is refused too,
    saying what the loop did (it had said the loop called clip_grad_norm_)."""
    from runtime.config.loader import ConfigError, load_config

    cfg = config(tmp_path)
    del cfg["optimizer"]["grad_clip"]  # the default: `auto`, 1.0 without user_grad_clip
    model, optimizer = offload(fresh_model(), cfg)
    with optimizer.session:
        model(*make_batches(1)[0]).backward()
        with pytest.raises(RuntimeError, match="clipped twice.*optimizer.user_grad_clip: true"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
        with pytest.raises(RuntimeError, match=r"^mul_ on the gradient of embed\.weight: your loop multiplies gradients"):
            model.embed.weight.grad.mul_(0)
        optimizer.zero_grad()
    with pytest.raises(ConfigError, match="would clip every step twice"):
        load_config({"optimizer": {"grad_clip": 1.0, "user_grad_clip": True}})
    both = load_config({"device": "cpu", "dtype": "fp32", "optimizer": {"user_grad_clip": True}})
    both = dataclasses.replace(both, optimizer=dataclasses.replace(both.optimizer, grad_clip=1.0))
    with pytest.raises(ConfigError, match="would clip every step twice"):  # a config built in code
        offload(fresh_model(), both)


def test_gradient_calls_tierstore_cannot_serve_say_what_to_use(tmp_path):
    """What a loop may call on a gradient that left the device, and cannot: torch.amp.GradScaler's unscale (the
    message names optimizer.scale_loss), clip_grad_value_ and a norm other than 2 (refused, naming what works);
    a forward between the step's last backward and step() names step()."""
    model, optimizer = offload(fresh_model(), config(tmp_path, user_grad_clip=True))
    batch = make_batches(1)[0]
    with optimizer.session:
        scaler = torch.amp.GradScaler("cpu")
        scaler.scale(model(*batch)).backward()
        with pytest.raises(RuntimeError, match=r"GradScaler in your loop.*optimizer\.scale_loss"):
            scaler.unscale_(optimizer)
        with pytest.raises(RuntimeError, match="clip_grad_value_, a norm other than 2"):
            torch.nn.utils.clip_grad_value_(model.parameters(), 0.1)
        with pytest.raises(RuntimeError, match="only the 2-norm"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, norm_type=float("inf"))
        with torch.no_grad(), pytest.raises(RuntimeError, match=r"Call optimizer\.step\(\) first"):
            model(*batch)
        optimizer.zero_grad()


def test_norms_of_an_offloaded_gradient_are_its_whole_2_norm_or_refused(tmp_path):
    """What a loop reads of a gradient that left the device: its whole 2-norm, however asked (through .data or
    .detach(), a logging idiom that had been refused naming __get__; over every dim, with keepdim), equal to the
    plain loop's; torch.linalg.norm(g, 2) of a matrix, torch's spectral norm, is refused (it had returned the
    Frobenius norm), and so is a norm over some dims, naming them. A multiply through .data scales the gradient,
    bit for bit."""
    plain, plain_opt = plain_model()
    model, optimizer = offload(fresh_model(), config(tmp_path, user_grad_clip=True))
    batch = make_batches(1)[0]
    with optimizer.session:
        reads = {
            "norm": lambda g: g.norm(), "data": lambda g: g.data.norm(2), "detach": lambda g: g.detach().norm(2),
            "linalg": lambda g: torch.linalg.norm(g), "fro": lambda g: torch.linalg.norm(g, "fro"),
            "every dim": lambda g: g.norm(2, dim=(0, 1)), "vector": lambda g: torch.linalg.vector_norm(g, 2, (-1, 0)),
            "keepdim": lambda g: torch.norm(g, 2, dim=(1, 0), keepdim=True),
        }
        for m in (plain, model):
            m(*batch).backward()
        for name, read in reads.items():
            ours, theirs = read(model.layers[0].qkv.weight.grad), read(plain.layers[0].qkv.weight.grad)
            assert ours.shape == theirs.shape and torch.equal(ours, theirs), name
        # Of a vector, torch.linalg.norm(g, 2) is its 2-norm.
        assert torch.equal(torch.linalg.norm(model.layers[0].attn_norm.weight.grad, 2),
                           torch.linalg.norm(plain.layers[0].attn_norm.weight.grad, 2))
        grad = model.layers[0].qkv.weight.grad
        # print(p.grad) while debugging says what it is (it raised)
        assert repr(grad) == str(grad) == f"{grad}" and "the gradient of layers.0.qkv.weight, shape (96, 32)" in repr(grad)
        with pytest.raises(RuntimeError, match="spectral norm"):
            torch.linalg.norm(grad, 2)
        with pytest.raises(RuntimeError, match="spectral norm"):
            torch.linalg.norm(grad, ord=2)
        with pytest.raises(RuntimeError, match=r"over dim=0 .*whole gradient"):
            grad.norm(2, dim=0)
        for m, opt in ((plain, plain_opt), (model, optimizer)):
            for p in m.parameters():
                p.grad.data.mul_(0.5)
            opt.step()
            opt.zero_grad()
        assert_same(model.state_dict(), plain.state_dict())


def test_a_bf16_gradient_s_norm_comes_in_the_dtype_asked(tmp_path):
    """g.norm(dtype=torch.float32) of a bf16 gradient is fp32 in torch; it came back in bf16 (rounded)."""
    plain = fresh_model().to(torch.bfloat16)
    model, optimizer = offload(fresh_model(), {**config(tmp_path, user_grad_clip=True), "dtype": "bf16"})
    batch = make_batches(1)[0]
    with optimizer.session:
        for m in (plain, model):
            m(*batch).backward()
        ours, theirs = model.layers[0].qkv.weight.grad, plain.layers[0].qkv.weight.grad
        for read in (lambda g: g.norm(dtype=torch.float32), lambda g: torch.linalg.vector_norm(g, dtype=torch.float32),
                     lambda g: g.norm(2, None, False, torch.float32)):
            assert read(ours).dtype == read(theirs).dtype == torch.float32
            assert read(ours).item() == pytest.approx(read(theirs).item(), rel=1e-6)
        assert ours.norm().dtype == theirs.norm().dtype == torch.bfloat16


def test_an_elementwise_factor_on_an_offloaded_gradient_is_refused_and_a_scalar_one_is_exact(tmp_path):
    """``p.grad.mul_`` after backward: one number is applied exactly (as clip_grad_norm_'s coefficient is); a
    tensor of several elements would change the stored norm in a way nobody could know, so it raises."""
    plain, plain_opt = plain_model()
    model, optimizer = offload(fresh_model(), config(tmp_path, user_grad_clip=True))
    batch = make_batches(1)[0]
    with optimizer.session:
        model(*batch).backward()
        with pytest.raises(RuntimeError, match="only by one number"):
            model.layers[0].attn_norm.weight.grad.mul_(torch.full_like(model.layers[0].attn_norm.weight, 0.5))
        model.layers[1].qkv.weight.grad.mul_(0.5)
        model.layers[2].down.weight.grad.mul_(torch.tensor([0.25]))  # one element, not 0-dim: still one number
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)  # stacks every parameter's stored factor
        optimizer.step()
        optimizer.zero_grad()
    plain(*batch).backward()
    plain.layers[1].qkv.weight.grad.mul_(0.5)
    plain.layers[2].down.weight.grad.mul_(torch.tensor([0.25]))
    torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.05)
    plain_opt.step()
    assert_same(model.state_dict(), plain.state_dict())


def test_user_clipping_with_streaming_updates_is_refused_not_ignored(tmp_path):
    model, optimizer = offload(fresh_model(), config(tmp_path))
    with optimizer.session:
        batch = make_batches(1)[0]
        model(*batch).backward()
        with pytest.raises(RuntimeError, match="optimizer.user_grad_clip: true"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with pytest.raises(RuntimeError, match="optimizer.user_grad_clip: true"):
            optimizer.clip_grad_norm_(1.0)


def test_zero_grad_before_step_drops_the_step_like_plain_pytorch(tmp_path):
    plain, plain_opt = plain_model()
    model, optimizer = offload(fresh_model(), config(tmp_path, user_grad_clip=True))
    with optimizer.session:
        def drop_the_second_batch(m: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
            if step == 1:
                opt.zero_grad()  # the user drops this batch

        train_side_by_side((plain, plain_opt), (model, optimizer), steps=4, after_backward=drop_the_second_batch)
        assert_same(model.state_dict(), plain.state_dict())


@pytest.mark.parametrize("clip", [None, 0.05])
def test_a_second_backward_before_step_is_refused_and_the_step_still_commits_exactly(tmp_path, clip):
    """Plain PyTorch would add a second backward's gradients to the first; here each block's gradient left the
    device (and its update may have started) when the first backward reached it. The second backward raises,
    naming the call to make, instead of silently dropping its gradients; the first one's step commits."""
    plain, plain_opt = plain_model()
    model, optimizer = offload(fresh_model(), config(tmp_path, grad_clip=clip))
    batches = make_batches(2)
    with optimizer.session:
        for step, batch in enumerate(batches):
            plain_step(plain, plain_opt, batch, clip)
            loss = model(*batch)
            loss.backward(retain_graph=True)
            if step == 0:
                with pytest.raises(RuntimeError, match="a backward ran after the last micro-batch's backward"):
                    loss.backward()
                assert optimizer.session.controller.phase is StepPhase.READY  # the first backward's step waits
            optimizer.step()
            optimizer.zero_grad()
        assert_same(model.state_dict(), plain.state_dict())


@pytest.mark.parametrize("clip", [None, 0.05])
def test_a_second_backward_reaching_only_a_parameter_is_refused_and_leaves_nothing_behind(tmp_path, clip):
    """The second backward's first hook is a parameter's gradient hook, not a block's: refused before its gradient
    is counted or kept, so later steps (whose blocks count their parameters' gradients) train exactly."""
    plain, plain_opt = plain_model()
    # Without a clip, updates wait for step() with user_grad_clip: with streaming ones a read before step() raises.
    model, optimizer = offload(fresh_model(), config(tmp_path, grad_clip=clip) if clip else config(tmp_path, user_grad_clip=True))
    with optimizer.session:
        for step, batch in enumerate(make_batches(3)):
            plain_step(plain, plain_opt, batch, clip)
            model(*batch).backward()
            if step == 0:
                with pytest.raises(RuntimeError, match="a backward ran after the last micro-batch's backward"):
                    model.layers[0].attn_norm.weight.pow(2).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        assert_same(model.state_dict(), plain.state_dict())


def test_a_failed_last_micro_batch_whose_first_hook_was_a_parameters_is_an_abandoned_step(tmp_path, caplog):
    """Accumulation 2, updates starting as gradients land: the last micro-batch's backward completes one block's
    gradient (through a parameter's hook, before any block's), then raises. The dropped step had started that
    block's update, so the next step refuses with the recovery to make; so do reads and saves, which would hand
    out a mix of the two steps, until a checkpoint load; close() hands the weights back and says what they are."""
    from runtime.checkpoint.state import save_checkpoint

    model, optimizer = offload(fresh_model(), config(tmp_path, accumulation_steps=2))
    batches = make_batches(3)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}

    def fail(param: torch.Tensor) -> None:  # runs after tierstore's own hook on the same parameter
        raise ValueError("planted")

    with optimizer.session:
        model(*batches[0]).backward()
        model.embed.weight.register_post_accumulate_grad_hook(fail)
        with pytest.raises(ValueError, match="planted"):
            model.embed.weight.pow(2).sum().backward()
        assert optimizer.session.controller.update_under_way(0)
        optimizer.zero_grad()  # drops the step
        with pytest.raises(RuntimeError, match="a step was abandoned"):
            model(*batches[1])
        for read in (model.state_dict, optimizer.state_dict, optimizer.session.master_state_dict,
                     lambda: model.layers[0].qkv.weight.clone(), lambda: model.embed.weight.sum(),
                     lambda: save_checkpoint(optimizer.session, tmp_path / "mixed")):
            with pytest.raises(RuntimeError, match="a step was abandoned"):
                read()
        assert not (tmp_path / "mixed").exists()
    with caplog.at_level("ERROR", logger="runtime.session"):
        optimizer.session.close()  # hands back what there is, and says it is not one step's
    assert "not the last committed step's" in caplog.text and "1 of" in caplog.text
    assert not torch.equal(model.embed.weight, before["embed.weight"])  # the block whose update had started
    assert torch.equal(model.layers[0].qkv.weight, before["layers.0.qkv.weight"])


def abandon_in_backward(model: nn.Module, optimizer: torch.optim.Optimizer, batch) -> None:
    """A micro-batch whose backward raises after layer 2's blocks (a planted hook on layer 1), caught, and the
    step dropped with zero_grad(): under streaming updates the later blocks' updates had started."""
    def fail(*_: object) -> None:
        raise ValueError("planted")

    handle = model.layers[1].register_full_backward_hook(fail)
    with pytest.raises(ValueError, match="planted"):
        model(*batch).backward()
    handle.remove()
    optimizer.zero_grad()


def test_reads_after_an_abandoned_streaming_step_come_back_with_a_checkpoint_load(tmp_path, caplog):
    """A backward that raises after some blocks' streaming updates started, then zero_grad(): reads refuse (they
    would mix steps) until load_checkpoint puts every block at the saved step; then they equal the plain loop's
    state at that step, and training goes on exactly."""
    from runtime.checkpoint.state import load_checkpoint, save_checkpoint

    plain, plain_opt = plain_model()
    model, optimizer = offload(fresh_model(), config(tmp_path))
    batches = make_batches(3)
    with optimizer.session:
        plain_step(plain, plain_opt, batches[0])
        offloaded_step(model, optimizer, batches[0])
        save_checkpoint(optimizer.session, tmp_path / "ckpt")
        abandon_in_backward(model, optimizer, batches[1])
        with pytest.raises(RuntimeError, match="would mix two steps"):
            model.state_dict()
        load_checkpoint(optimizer.session, tmp_path / "ckpt")
        assert_same(model.state_dict(), plain.state_dict())
        for batch in batches[1:]:
            plain_step(plain, plain_opt, batch)
            offloaded_step(model, optimizer, batch)
        assert_same(model.state_dict(), plain.state_dict())
    assert "not the last committed step's" not in caplog.text


def train_side_by_side(*pairs: tuple[nn.Module, torch.optim.Optimizer], steps: int,
                       after_backward: Callable[[nn.Module, torch.optim.Optimizer, int], None]) -> None:
    """The same batches through each (model, optimizer) pair; ``after_backward(model, optimizer, step)`` is the
    user's code between a backward and its ``step()``."""
    for step, batch in enumerate(make_batches(steps)):
        for m, opt in pairs:
            m(*batch).backward()
            after_backward(m, opt, step)
            opt.step()
            opt.zero_grad()


def test_param_groups_and_hyperparameter_changes_equal_torch_adamw(tmp_path):
    def groups(model: nn.Module) -> list[dict]:
        decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
        no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
        return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 2 * LR}]

    plain = fresh_model()
    plain_opt = torch.optim.AdamW(groups(plain), lr=LR, fused=True)
    plain_sched = torch.optim.lr_scheduler.StepLR(plain_opt, step_size=1, gamma=0.5)
    model = fresh_model()
    model, optimizer = offload(model, config(tmp_path), param_groups=groups(model))
    sched = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    with optimizer.session:
        for step, batch in enumerate(make_batches(4)):
            if step == 2:  # hand edits take effect at the next step
                for opt in (plain_opt, optimizer):
                    opt.param_groups[0]["betas"] = (0.8, 0.95)
                    opt.param_groups[1]["eps"] = 1e-6
            plain_step(plain, plain_opt, batch)
            plain_sched.step()
            offloaded_step(model, optimizer, batch)
            sched.step()
        assert_same(model.state_dict(), plain.state_dict())


def test_optimizer_state_dict_round_trip_resumes_bit_for_bit(tmp_path):
    plain, plain_opt = plain_model()
    batches = make_batches(5)
    model, optimizer = offload(fresh_model(), config(tmp_path / "a"))
    with optimizer.session:
        for batch in batches[:3]:
            plain_step(plain, plain_opt, batch)
            offloaded_step(model, optimizer, batch)
        saved_opt = optimizer.state_dict()
        saved_model = model.state_dict()
        theirs = plain_opt.state_dict()
        for index, state in theirs["state"].items():
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(saved_opt["state"][index][key], state[key])
            assert float(saved_opt["state"][index]["step"]) == float(state["step"])
    buffer = io.BytesIO()
    torch.save(saved_opt, buffer)
    buffer.seek(0)
    # A new session (moments on NVMe again) resumes from the saved states and equals the plain loop.
    model, optimizer = offload(fresh_model(seed=5), config(tmp_path / "b"))
    with optimizer.session:
        model.load_state_dict(saved_model)
        optimizer.load_state_dict(torch.load(buffer))
        for batch in batches[3:]:
            plain_step(plain, plain_opt, batch)
            offloaded_step(model, optimizer, batch)
        assert_same(model.state_dict(), plain.state_dict())
    # The other way: the saved state into torch's fused AdamW over a plain model (training moved off tierstore)
    # goes on exactly like the plain loop; its groups say which AdamW they are for (a group without `fused`
    # falls back to torch's foreach kernel, 1e-8 off).
    assert saved_opt["param_groups"][0].keys() == theirs["param_groups"][0].keys()
    moved = fresh_model(seed=5)
    moved.load_state_dict(saved_model)
    moved_opt = torch.optim.AdamW(moved.parameters(), lr=LR, weight_decay=0.01, fused=True)
    buffer.seek(0)
    moved_opt.load_state_dict(torch.load(buffer))
    for batch in batches[3:]:
        plain_step(moved, moved_opt, batch)
    assert_same(moved.state_dict(), plain.state_dict())


def test_the_optimizer_after_close_refuses_instead_of_doing_nothing(tmp_path):
    """After `with optimizer.session:` ends, step() changed nothing and state_dict() raised a KeyError: each
    now says the session was closed and what to do; zero_grad() still clears the plain model's gradients."""
    model, optimizer = offload(fresh_model(), config(tmp_path))
    batch = make_batches(1)[0]
    with optimizer.session:
        offloaded_step(model, optimizer, batch)
    model(*batch).backward()  # a plain module now
    for call in (optimizer.step, optimizer.state_dict, lambda: optimizer.clip_grad_norm_(1.0),
                 lambda: optimizer.load_state_dict({"state": {}, "param_groups": optimizer.param_groups})):
        with pytest.raises(RuntimeError, match="offload session was closed"):
            call()
    optimizer.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_a_parameter_unfrozen_after_offload_is_refused_not_left_untrained(tmp_path):
    """Progressive unfreezing: plain AdamW over all the parameters trains a layer from the step it is unfrozen;
    tierstore never offloaded it (frozen at offload()), so step() refuses, naming it, instead of ignoring it."""
    model = fresh_model()
    model.layers[1].requires_grad_(False)
    model, optimizer = offload(model, config(tmp_path))
    batches = make_batches(2)
    with optimizer.session:
        offloaded_step(model, optimizer, batches[0])  # frozen: fine
        model.layers[1].requires_grad_(True)
        # Refused at the forward, before anything of the step ran (a streaming update would already have started
        # by step(), leaving the blocks at two steps).
        with pytest.raises(ValueError, match=r"layers\.1\.\S+ .*frozen \(requires_grad=False\) when offload\(\) ran"):
            model(*batches[1])
        model.layers[1].requires_grad_(False)
        model.layers[1].down.weight.grad = torch.ones(model.layers[1].down.weight.shape)  # assigned by hand
        with pytest.raises(ValueError, match=r"layers\.1\.down\.weight got a gradient but was frozen"):
            optimizer.step()
        model.layers[1].down.weight.grad = None
        offloaded_step(model, optimizer, batches[1])  # the session goes on


def test_offload_twice_says_the_model_is_offloaded_and_the_first_session_trains_on(tmp_path):
    plain, plain_opt = plain_model()
    model, optimizer = offload(fresh_model(), config(tmp_path / "a"))
    with optimizer.session:
        with pytest.raises(ValueError, match="already offloaded"):
            offload(model, config(tmp_path / "b"))
        for batch in make_batches(2):
            plain_step(plain, plain_opt, batch)
            offloaded_step(model, optimizer, batch)
        assert_same(model.state_dict(), plain.state_dict())
    again, second = offload(model, config(tmp_path / "c"))  # closed: offloading again is fine
    second.session.close()


def test_in_place_writes_and_unsupported_settings(tmp_path):
    model, optimizer = offload(fresh_model(), config(tmp_path))
    with optimizer.session:
        weight = model.layers[0].gate_up.weight
        with torch.no_grad():
            weight.mul_(0.5)
            weight[0].fill_(2.0)
        expected = fresh_model().layers[0].gate_up.weight.detach() * 0.5
        expected[0] = 2.0
        assert torch.equal(weight.detach().clone(), expected)
        assert torch.equal(optimizer.session.master_state_dict()["layers.0.gate_up.weight"], expected)
        with pytest.raises(RuntimeError, match="in-place"):
            weight.mul_(2.0)  # grad mode on, as plain torch refuses it for a leaf
        optimizer.param_groups[0]["amsgrad"] = True
        batch = make_batches(1)[0]
        with pytest.raises(ValueError, match="amsgrad"):  # refused when the update is queued, never ignored
            model(*batch).backward()
            optimizer.step()


def test_nn_init_and_reset_parameters_after_offload_reach_the_master(tmp_path):
    """torch.nn.init's functions pass the tensor as a keyword (``tensor=w``): re-initialising a head or a layer
    after offload() (a new classifier, reset_parameters()) must change the trained weights as in plain PyTorch, not
    only the copy read back. Bit for bit against the plain loop, through a step."""
    plain, plain_opt = plain_model()
    model, optimizer = offload(fresh_model(), config(tmp_path))

    def reinit(net: nn.Module) -> None:
        torch.manual_seed(5)
        with torch.no_grad():
            nn.init.normal_(net.layers[2].down.weight, std=0.02)
            nn.init.constant_(net.norm.weight, 0.5)
            net.layers[1].gate_up.reset_parameters()  # kaiming_uniform_ through nn.init

    with optimizer.session:
        edit_then_train_both(reinit, (plain, plain_opt), (model, optimizer))


def test_nn_init_without_no_grad_initialises_an_offloaded_parameter_as_in_plain_pytorch(tmp_path):
    """torch.nn.init's functions run their write under their own no_grad, so plain PyTorch accepts them outside one:
    on an offloaded parameter they were refused ("a leaf Variable that requires grad is being used in an in-place
    operation": the guard saw the call before nn.init's no_grad). Bit for bit against the plain loop, through a step;
    a bare p.mul_() with grad on is still refused, as plain PyTorch refuses it."""
    plain, plain_opt = plain_model()
    model, optimizer = offload(fresh_model(), config(tmp_path))

    def reinit(net: nn.Module) -> None:
        torch.manual_seed(5)
        nn.init.normal_(net.layers[2].down.weight, std=0.02)
        nn.init.uniform_(net.layers[0].down.weight, -0.1, 0.1)
        nn.init.constant_(net.norm.weight, 0.5)
        net.layers[1].gate_up.reset_parameters()  # kaiming_uniform_ through nn.init

    with optimizer.session:
        edit_then_train_both(reinit, (plain, plain_opt), (model, optimizer))
        with pytest.raises(RuntimeError, match="in-place"):
            model.norm.weight.mul_(2.0)


def test_foreach_aten_and_inplace_keyword_writes_between_steps_reach_the_master(tmp_path):
    """Writes between steps that name no single parameter as the method's target: ``torch._foreach_*_`` over a list
    of parameters, an ATen overload (``torch.ops.aten.mul_.Tensor``), a functional call with ``inplace=True``. Each
    had changed only the compute copy fetched for it (reads right after looked right; ``state_dict()``, the next
    step and ``close()`` used the old weights). Bit for bit against the plain loop, through a step; inside a pass
    the same writes are refused."""
    plain, plain_opt = plain_model()
    model, optimizer = offload(fresh_model(), config(tmp_path))

    def edit(net: nn.Module) -> None:
        params = list(net.parameters())
        with torch.no_grad():
            torch._foreach_mul_(params, 0.5)
            torch._foreach_add_(params[:3], [torch.ones_like(p) for p in params[:3]], alpha=0.1)
            torch._foreach_zero_(params[3:4])
            torch.ops.aten.mul_.Tensor(params[5], 0.25)
            torch.manual_seed(3)
            torch.nn.functional.dropout(params[6], 0.5, True, True)
            torch.nn.functional.relu(params[7], inplace=True)
            torch.ops.aten._foreach_mul_.Scalar(params, 0.5)  # an ATen overload of a foreach op
            ones = [torch.ones_like(p) for p in params]
            torch._foreach_addcmul_(params, ones, ones, [0.01 * i for i in range(len(params))])  # scalars per tensor
            torch._foreach_addcdiv_(params, ones, ones, torch.arange(len(params)) * 0.01)  # a tensor of scalars
            torch._foreach_maximum_(params, [torch.full_like(p, -0.01) for p in params])  # no Tensor.maximum_

    with optimizer.session:
        edit_then_train_both(edit, (plain, plain_opt), (model, optimizer))

        def scale(module, args):
            with torch.no_grad():
                torch._foreach_mul_(list(module.parameters()), 1.0)

        handle = model.layers[0].gate_up.register_forward_pre_hook(scale)
        with pytest.raises(RuntimeError, match="mul_ writes into an offloaded parameter while its block runs"):
            model(*make_batches(1)[0])
        handle.remove()


def test_parameters_tied_through_their_memory_are_refused_and_disjoint_views_are_not(tmp_path):
    """Two Parameter objects over one memory (``head.weight.data = embed.weight.data``, an old way to tie): tierstore
    would update each one's own copy and split them, where plain PyTorch updates the one memory with both. Refused
    before anything changes, naming both and the tie to write instead. Parameters that are disjoint slices of one
    buffer share no bytes: each is copied on its own, and training is bit for bit the plain loop's."""
    tied = fresh_model()
    tied.head.weight.data = tied.embed.weight.data
    with pytest.raises(ValueError, match=r"embed\.weight and head\.weight are two Parameter objects over the same "
                                         r"memory.*model\.head\.weight = model\.embed\.weight"):
        offload(tied, config(tmp_path))
    assert not any(type(p) is not nn.Parameter for p in tied.parameters())  # left as it was
    frozen = fresh_model()  # a frozen parameter over a trainable one's memory would keep the old values
    frozen.head.weight = nn.Parameter(frozen.embed.weight.data, requires_grad=False)
    with pytest.raises(ValueError, match=r"embed\.weight and head\.weight are two Parameter objects"):
        offload(frozen, config(tmp_path))

    def sliced() -> nn.Module:
        net = fresh_model()
        flat = torch.cat([net.norm.weight.detach(), net.layers[0].attn_norm.weight.detach()])
        net.norm.weight = nn.Parameter(flat[: SHAPE.hidden_size])  # two views of one buffer, no byte in common
        net.layers[0].attn_norm.weight = nn.Parameter(flat[SHAPE.hidden_size :])
        return net

    woven_net = fresh_model()  # interleaved views, every other element each: no byte in common, accepted
    woven = torch.stack([woven_net.norm.weight.detach(), woven_net.layers[0].attn_norm.weight.detach()], dim=1)
    woven_net.norm.weight = nn.Parameter(woven[:, 0])
    woven_net.layers[0].attn_norm.weight = nn.Parameter(woven[:, 1])
    offload(woven_net, config(tmp_path))[1].session.close()

    plain = sliced()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=LR, weight_decay=0.01, fused=True)
    model, optimizer = offload(sliced(), config(tmp_path))
    with optimizer.session:
        for batch in make_batches(2):
            plain_step(plain, plain_opt, batch)
            offloaded_step(model, optimizer, batch)
        assert_same(model.state_dict(), plain.state_dict())


def test_a_param_group_added_after_offload_is_refused_not_ignored(tmp_path):
    """optimizer.add_param_group after offload(): refused with the way to do it (param_groups at offload), and the
    optimizer is left as it was. It had been accepted, its parameter never updated (zeros after three steps where
    torch's AdamW moved it), and state_dict() then failed with a bare KeyError."""
    model, optimizer = offload(fresh_model(), config(tmp_path))
    with optimizer.session:
        groups = len(optimizer.param_groups)
        with pytest.raises(ValueError, match=r"add_param_group after offload\(\).*param_groups="):
            optimizer.add_param_group({"params": [nn.Parameter(torch.zeros(4))], "lr": 1e-2})
        assert len(optimizer.param_groups) == groups
        model(*make_batches(1)[0]).backward()
        optimizer.step()
        assert len(optimizer.state_dict()["state"]) == len(list(model.parameters()))


def test_a_write_into_a_parameter_during_its_forward_is_refused_not_lost(tmp_path):
    """A forward pre-hook registered after offload() that clamps its layer's weight in place runs inside the pass,
    on the compute copy fetched for it: the write would be lost (the fp32 master keeps the old values; plain torch
    keeps the clamped ones). Refused with what to do instead; without the hook the next step equals the plain
    loop's."""
    plain, plain_opt = plain_model()
    model, optimizer = offload(fresh_model(), config(tmp_path))
    batch = make_batches(1)[0]

    def clamp(module, args):
        with torch.no_grad():
            module.weight.clamp_(-0.05, 0.05)

    with optimizer.session:
        hook = model.layers[0].gate_up.register_forward_pre_hook(clamp)
        with pytest.raises(RuntimeError, match=r"clamp_ writes into an offloaded parameter while its block runs"):
            model(*batch)
        hook.remove()
        offloaded_step(model, optimizer, batch)
        plain_step(plain, plain_opt, batch)
        assert_same(optimizer.session.master_state_dict(), dict(plain.named_parameters()))


def test_a_write_between_steps_after_a_forward_that_raised_reaches_the_master(tmp_path):
    """A forward raised inside a block (its blocks stay held until the next forward): a write between steps, as a
    retry loop's recovery makes (load_state_dict, an in-place edit), is still a write to the fp32 master, not
    refused as a write during a pass and not lost in the held compute copy."""
    model, optimizer = offload(fresh_model(), config(tmp_path))

    def boom(module, args):
        raise RuntimeError("planted failure")

    with optimizer.session:
        hook = model.layers[1].register_forward_pre_hook(boom)
        with pytest.raises(RuntimeError, match="planted failure"):
            model(*make_batches(1)[0])
        hook.remove()
        assert optimizer.session.controller.weights.states[2].users  # layers.1's block, held by the raised forward
        weight = model.layers[1].gate_up.weight
        with torch.no_grad():
            weight.mul_(0.5)
        expected = fresh_model().layers[1].gate_up.weight.detach() * 0.5
        assert torch.equal(optimizer.session.master_state_dict()["layers.1.gate_up.weight"], expected)
        assert torch.equal(weight.detach().clone(), expected)


def test_model_to_device_is_a_no_op_and_a_dtype_change_is_refused(tmp_path):
    model, optimizer = offload(fresh_model(), config(tmp_path))
    with optimizer.session:
        before = model.state_dict()
        assert model.to("cpu") is model  # what HF Trainer and accelerate call
        assert model.to("cpu:1") is model  # their name for the CPU in several processes (cpu:<local rank>)
        assert_same(model.state_dict(), before)
        with pytest.raises(RuntimeError, match="before offload"):
            model.to(torch.float64)


def test_checkpoints_carry_param_groups_and_the_lr_scheduler(tmp_path):
    from runtime.checkpoint.state import load_checkpoint, save_checkpoint

    def build(model: nn.Module, optimizer: torch.optim.Optimizer | None = None):
        groups = [{"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": 0.1},
                  {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0}]
        return groups, (lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 3) * 0.9 ** step))

    batches = make_batches(4)
    plain = fresh_model()
    groups, make_sched = build(plain)
    plain_opt = torch.optim.AdamW(groups, lr=LR, fused=True)
    plain_sched = make_sched(plain_opt)
    for step, batch in enumerate(batches):
        if step == 1:
            plain_opt.param_groups[1]["betas"] = (0.8, 0.9)
        plain_step(plain, plain_opt, batch)
        plain_sched.step()

    model = fresh_model()
    groups, make_sched = build(model)
    model, optimizer = offload(model, config(tmp_path / "a"), param_groups=groups)
    sched = make_sched(optimizer)
    with optimizer.session as session:
        for step, batch in enumerate(batches[:2]):
            if step == 1:
                optimizer.param_groups[1]["betas"] = (0.8, 0.9)
            offloaded_step(model, optimizer, batch)
            sched.step()
        save_checkpoint(session, tmp_path / "ckpt", scheduler=sched)
    model = fresh_model(seed=3)
    groups, make_sched = build(model)
    model, optimizer = offload(model, config(tmp_path / "b"), param_groups=groups)
    sched = make_sched(optimizer)
    with optimizer.session as session:
        assert load_checkpoint(session, tmp_path / "ckpt", scheduler=sched) == 2
        assert optimizer.param_groups[1]["betas"] == (0.8, 0.9)
        for batch in batches[2:]:
            offloaded_step(model, optimizer, batch)
            sched.step()
        assert_same(model.state_dict(), plain.state_dict())
        assert sched.get_last_lr() == plain_sched.get_last_lr()


@pytest.mark.parametrize("error", [MemoryError("no room"), OSError(5, "Input/output error")])
def test_close_when_the_weights_cannot_be_kept(tmp_path, monkeypatch, error):
    """Weights that do not fit in host memory (or can't be read) leave meta parameters, never freed memory; a
    read error is raised after everything is given back."""
    model, optimizer = offload(fresh_model(), config(tmp_path))
    session = optimizer.session

    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(session.access, "slot_values", fail)
    if isinstance(error, MemoryError):
        session.close()
    else:
        with pytest.raises(OSError, match="Input/output"):
            session.close()
    assert session.closed and not list((tmp_path / "swap").glob("*.tsw"))
    weight = model.layers[0].qkv.weight
    assert weight.is_meta and type(weight) is nn.Parameter
    assert model.head.weight.is_meta
    with pytest.raises((NotImplementedError, RuntimeError)):
        weight.sum().item()


def test_a_refused_offload_leaves_the_model_usable(tmp_path):
    model = fresh_model()
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="amsgrad"):
        offload(model, config(tmp_path), param_groups=[{"params": list(model.parameters()), "amsgrad": True}])
    assert_same(dict(model.named_parameters()), expected)
    model(*make_batches(1)[0]).backward()  # an ordinary module again


def test_views_taken_in_forward_or_kept_across_close_never_read_freed_memory(tmp_path):
    model, optimizer = offload(fresh_model(), config(tmp_path))
    kept = []
    model.layers[1].gate_up.register_forward_hook(lambda m, i, o: kept.append(m.weight.detach().view(-1)[:8]))
    with optimizer.session:
        for batch in make_batches(2):
            offloaded_step(model, optimizer, batch)
        assert torch.equal(kept[-1], model.layers[1].gate_up.weight.detach().view(-1)[:8])  # read after release
        view = model.layers[0].qkv.weight.detach()
    with pytest.raises(RuntimeError, match="session that was closed"):
        view.sum()


def test_numpy_dlpack_and_pickle_get_copies(tmp_path):
    model, optimizer = offload(fresh_model(), config(tmp_path))
    with optimizer.session:
        weight = model.layers[0].down.weight
        array = weight.detach().numpy()
        packed = torch.from_dlpack(weight.detach())
        buffer = io.BytesIO()
        torch.save(weight.detach(), buffer)
        for batch in make_batches(2):  # the blocks are released and refetched in between
            offloaded_step(model, optimizer, batch)
        first = optimizer.session.master_state_dict()
    buffer.seek(0)
    assert type(torch.load(buffer)) is torch.Tensor
    assert array.shape == tuple(packed.shape) == tuple(first["layers.0.down.weight"].shape)
    assert not torch.equal(torch.from_numpy(array), first["layers.0.down.weight"])  # a snapshot, not the live block


def test_state_dict_after_a_refused_call_is_current(tmp_path):
    model, optimizer = offload(fresh_model(), config(tmp_path, user_grad_clip=True))
    with optimizer.session:
        batch = make_batches(1)[0]
        model(*batch).backward()
        with pytest.raises(RuntimeError, match="between steps"):
            model.state_dict()
        optimizer.step()
        optimizer.zero_grad()
        assert_same(model.state_dict(), optimizer.session.master_state_dict())


def test_item_assignment_and_ema_reads(tmp_path):
    model, optimizer = offload(fresh_model(), config(tmp_path))
    with optimizer.session:
        weight = model.layers[0].gate_up.weight
        ema = torch.zeros_like(weight.detach())
        with torch.no_grad():
            weight[0, :4] = 5.0
            weight.data[1] = 7.0
            ema.lerp_(weight, 0.5)  # a read of the parameter into the user's tensor
        master = optimizer.session.master_state_dict()["layers.0.gate_up.weight"]
        assert torch.all(master[0, :4] == 5.0) and torch.all(master[1] == 7.0)
        assert torch.equal(ema, master * 0.5)


def test_model_zero_grad_after_backward_drops_those_gradients(tmp_path):
    plain, plain_opt = plain_model()
    model, optimizer = offload(fresh_model(), config(tmp_path, user_grad_clip=True))
    with optimizer.session:
        def layer_1_sits_out_the_second_step(m: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
            if step == 1:
                m.layers[1].zero_grad()

        train_side_by_side((plain, plain_opt), (model, optimizer), steps=3, after_backward=layer_1_sits_out_the_second_step)
        assert_same(model.state_dict(), plain.state_dict())
        assert_same(optimizer.state_dict()["state"][3], plain_opt.state_dict()["state"][3])


def test_optimizer_state_dict_right_after_step_and_recovery_by_checkpoint(tmp_path):
    from runtime.checkpoint.state import load_checkpoint, save_checkpoint

    model, optimizer = offload(fresh_model(), config(tmp_path, gpu_update_fraction=1.0))
    with optimizer.session as session:
        batches = make_batches(3)
        model(*batches[0]).backward()
        optimizer.step()
        assert len(optimizer.state_dict()["state"]) == len(list(model.parameters()))  # waits for the update
        optimizer.zero_grad()
        save_checkpoint(session, tmp_path / "ckpt")
        model(*batches[1]).backward()
        optimizer.zero_grad()  # device updates ran as gradients landed: the step can't be dropped
        with pytest.raises(RuntimeError, match="Restore the last checkpoint"):
            model(*batches[2])
        load_checkpoint(session, tmp_path / "ckpt")
        model(*batches[2]).backward()  # recovered
        optimizer.step()


def test_load_state_dict_writes_each_block_once(tmp_path):
    """Masters on NVMe: a whole-model load stages and writes back each block once, not once per parameter."""
    model, optimizer = offload(fresh_model(), config(tmp_path))
    with optimizer.session as session:
        events = []
        session.store.bus.subscribe(events.append)
        pretrained = fresh_model(seed=9).state_dict()
        model.load_state_dict(pretrained)
        master_writes = {e.key for e in events if e.kind == "write" and str(e.key).endswith(".master")}
        writes = [e for e in events if e.kind == "write" and str(e.key).endswith(".master")]
        assert len(writes) == len(master_writes) == len(session.blocks)
        assert_same(model.state_dict(), pretrained)
        model(*make_batches(1)[0]).backward()  # and training goes on from the loaded weights
        optimizer.step()


def test_deepcopy_gives_a_plain_model_with_the_current_weights(tmp_path):
    """The usual EMA / evaluation copy: copy.deepcopy(model) is an ordinary model that does not drive the session."""
    plain, plain_opt = plain_model()
    model, optimizer = offload(fresh_model(), config(tmp_path))
    with optimizer.session:
        batches = make_batches(3)
        for batch in batches:
            plain_step(plain, plain_opt, batch)
            offloaded_step(model, optimizer, batch)
            ema = copy.deepcopy(model)
            assert all(type(p) is nn.Parameter for p in ema.parameters())
            assert_same(dict(ema.named_parameters()), dict(plain.named_parameters()))
            assert torch.equal(ema(*batch), plain(*batch))
        assert_same(model.state_dict(), plain.state_dict())


@pytest.mark.parametrize("model_dtype, dtype, said", [(torch.bfloat16, "fp32", "in bfloat16"), (torch.float64, "fp32", "in float64"),
                                                      (torch.float32, "bf16", None), (torch.float32, "fp32", None)])
def test_parameters_in_another_dtype_than_the_config_s_are_said_at_offload(caplog, model_dtype, dtype, said):
    """A bf16 model under dtype: fp32 trains in fp32 and an fp64 one with fp32 masters (plain PyTorch: each in its
    own dtype): said once at offload(), naming the dtype to set; fp32 parameters under bf16 are the usual case."""
    import logging

    with caplog.at_level(logging.WARNING, logger="runtime.session"):
        model, optimizer = offload(fresh_model().to(model_dtype), {"device": "cpu", "dtype": dtype,
                                                                    "optimizer": {"grad_clip": None}})
        optimizer.session.close()
    notices = [r.getMessage() for r in caplog.records if "the config's dtype" in r.getMessage()]
    if said is None:
        assert notices == []
    else:
        assert len(notices) == 1 and said in notices[0] and "Set dtype to match the model" in notices[0]


@pytest.mark.parametrize("between", ["nothing", "zero_grad", "zero_grad(set_to_none=False)"])
def test_a_second_step_with_no_backward_is_said_where_plain_pytorch_would_apply_the_gradients_again(tmp_path, caplog,
                                                                                                    between):
    """Plain PyTorch's .grad still holds the last gradients after step(): a second step() with no backward applies
    them again (unless model.zero_grad() cleared them); tierstore has used them up. That step did nothing silently:
    now it says so, once, naming optimizer.zero_grad(). After the optimizer's zero_grad both agree: nothing to say."""
    import logging

    model, optimizer = offload(fresh_model(), config(tmp_path))
    with optimizer.session, caplog.at_level(logging.WARNING, logger="runtime.engine"):
        for batch in make_batches(2):
            model(*batch).backward()
            optimizer.step()
            if between == "zero_grad":
                optimizer.zero_grad()
            elif between != "nothing":
                optimizer.zero_grad(set_to_none=False)
            optimizer.step()
    said = [r.getMessage() for r in caplog.records if "with no backward since the last step" in r.getMessage()]
    assert len(said) == (1 if between == "nothing" else 0), said


@pytest.mark.parametrize("clear", ["model.zero_grad()", "model.zero_grad(set_to_none=False)",
                                   "optimizer.zero_grad(set_to_none=False), model.zero_grad()", "nothing"])
def test_between_steps_p_grad_is_there_where_plain_pytorch_holds_one_so_model_zero_grad_reaches_it(tmp_path, caplog,
                                                                                                  clear):
    """After step() plain PyTorch's .grad still holds the step's gradient: p.grad is a stand-in there (it read None,
    so the module's zero_grad() found nothing: its zeros, or its clearing after the optimizer kept zeros, were
    silently not done). Reading its values is refused, saying where they went; model.zero_grad() clears or zeroes
    it as in plain PyTorch, and a step() with no backward then does what plain PyTorch's does, bit for bit. With
    nothing cleared, the next backward says once that plain PyTorch would add to the last gradients."""
    import logging

    plain, plain_opt = plain_model()
    model, optimizer = offload(fresh_model(), config(tmp_path))
    batches = make_batches(3)
    with optimizer.session, caplog.at_level(logging.WARNING, logger="runtime.engine"):
        for m, opt in ((plain, plain_opt), (model, optimizer)):
            m(*batches[0]).backward()
            opt.step()
        grad = model.layers[0].qkv.weight.grad
        assert grad is not None and grad.shape == plain.layers[0].qkv.weight.grad.shape
        with pytest.raises(RuntimeError, match="still holds the last step's gradient.*used it for that step's update"):
            grad.norm()
        for m, opt in ((plain, plain_opt), (model, optimizer)):
            if clear == "model.zero_grad()":
                m.zero_grad()
            elif clear == "model.zero_grad(set_to_none=False)":
                m.zero_grad(set_to_none=False)
            elif clear != "nothing":
                opt.zero_grad(set_to_none=False)
                m.zero_grad()
        assert (model.layers[0].qkv.weight.grad is None) == (plain.layers[0].qkv.weight.grad is None)
        for m in (plain, model):  # Module._apply carries each .grad along: a no-op here (it crashed on the stand-in)
            m.to("cpu").cpu()
        if clear != "nothing":
            for opt in (plain_opt, optimizer):
                opt.step()  # no backward: nothing (cleared), or zero gradients (zeroed)
            assert_same(model.state_dict(), plain.state_dict())
        model(*batches[1]).backward()
        optimizer.step()
    said = [r.getMessage() for r in caplog.records if "a backward since the last step" in r.getMessage()]
    assert len(said) == (1 if clear == "nothing" else 0), said


def test_zeroing_part_of_the_gradients_between_steps_zeroes_those_and_says_the_rest_is_not_applied_again(tmp_path,
                                                                                                       caplog):
    """model.layers[0].zero_grad(set_to_none=False) after a step: plain PyTorch updates those with zeros at a step()
    with no backward, and applies the others' last gradients again (not emulated: said once). The zeroed ones
    were taken for every held gradient, silently."""
    import logging

    plain, plain_opt = plain_model()
    model, optimizer = offload(fresh_model(), config(tmp_path))
    with optimizer.session, caplog.at_level(logging.WARNING, logger="runtime.engine"):
        for m, opt in ((plain, plain_opt), (model, optimizer)):
            m(*make_batches(1)[0]).backward()
            opt.step()
            m.layers[0].zero_grad(set_to_none=False)
            opt.step()
        ours, theirs = model.state_dict(), plain.state_dict()
        assert_same({k: v for k, v in ours.items() if k.startswith("layers.0.")},
                    {k: v for k, v in theirs.items() if k.startswith("layers.0.")})
    said = [r.getMessage() for r in caplog.records if "they are not applied again" in r.getMessage()]
    assert len(said) == 1, said


def test_a_p_grad_kept_from_between_steps_is_refused_in_the_next_step(tmp_path):
    """A stand-in read between steps and kept: in the next step's accumulation window it was taken for the new host
    sum (its norm, a zero_() that dropped the new micro-batch's gradient). It is refused there."""
    model, optimizer = offload(fresh_model(), config(tmp_path, accumulation_steps=2, accumulate_on="host"))
    batches = make_batches(4)
    with optimizer.session:
        for batch in batches[:2]:
            model(*batch).backward()
        optimizer.step()
        kept = model.layers[0].qkv.weight.grad
        optimizer.zero_grad()
        model(*batches[2]).backward()
        for use in (lambda g: g.norm(), lambda g: g.zero_()):
            with pytest.raises(RuntimeError, match="kept from a step that has ended: read p.grad again"):
                use(kept)
        model.layers[0].qkv.weight.grad.norm()  # read again: the new sum's


class ScaledLoss(nn.Module):
    """The example model with its loss multiplied: gradients whose elements fp16 holds and whose norm it does not."""

    def __init__(self, factor: float):
        super().__init__()
        self.lm, self.factor = fresh_model(), factor

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.lm(x, y).float() * self.factor  # in fp32: the loss itself is above fp16's range


def test_under_fp16_the_loop_s_clip_takes_the_norm_in_fp32_as_tierstore_s_own_clip(tmp_path):
    """A norm above fp16's 65,504 was returned in fp16, inf: the loop's clip then zeroed the step's gradients. It is
    the fp32 masters' norm, as with optimizer.grad_clip, and the two loops train bit for bit alike."""
    batches = make_batches(2)
    results = []
    for loop_clips in (True, False):
        optimizer_cfg = {"lr": LR, "weight_decay": 0.01, "loss_scale": {"initial": 1.0},
                         **({"grad_clip": None, "user_grad_clip": True} if loop_clips else {"grad_clip": 1.0})}
        model, optimizer = offload(ScaledLoss(6e4), {"device": "cpu", "dtype": "fp16", "optimizer": optimizer_cfg})
        with optimizer.session:
            norms = []
            for batch in batches:
                optimizer.scale_loss(model(*batch)).backward()
                if loop_clips:
                    norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
                optimizer.step()
                optimizer.zero_grad()
                if loop_clips:
                    assert norms[-1].dtype == torch.float32 and 65504 < norms[-1].item() < float("inf")
                    assert norms[-1].item() == pytest.approx(optimizer.last_grad_norm, rel=1e-6)
            results.append(optimizer.session.master_state_dict())
    assert_same(*results)


def test_a_parameter_given_other_memory_by_set_is_refused_at_the_next_forward(tmp_path):
    """p.set_(t) reaches no torch-function override: the parameter silently stopped following the tiers (the
    forward computed with t forever while the master trained on). The next forward refuses, naming it."""
    model, optimizer = offload(fresh_model(), config(tmp_path))
    with optimizer.session:
        batch = make_batches(1)[0]
        offloaded_step(model, optimizer, batch)
        with torch.no_grad():
            model.head.weight.set_(torch.full(model.head.weight.shape, 0.25))
        with pytest.raises(RuntimeError, match=r"parameter head.weight no longer uses tierstore.s memory .*param.copy_"):
            model(*batch)


def test_torch_save_of_the_whole_model_gives_a_plain_model_with_the_current_weights(tmp_path):
    """Older scripts checkpoint with torch.save(model): the pickle failed on the session's hooks (closures). Now
    it holds an ordinary model, the current weights and inert hooks in the session's place."""
    plain, plain_opt = plain_model()
    model, optimizer = offload(fresh_model(), config(tmp_path))
    with optimizer.session:
        batches = make_batches(3)
        for batch in batches[:2]:
            plain_step(plain, plain_opt, batch)
            offloaded_step(model, optimizer, batch)
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        assert all(type(p) is nn.Parameter for p in loaded.parameters())
        assert_same(loaded.state_dict(), plain.state_dict())
        assert torch.equal(loaded(*batches[2]), plain(*batches[2]))  # runs without the session
        plain_step(plain, plain_opt, batches[2])
        offloaded_step(model, optimizer, batches[2])  # and the session is undisturbed
        assert_same(model.state_dict(), plain.state_dict())


@pytest.mark.parametrize("user_clip, when", [(False, "before step"), (True, "before step"), (False, "after step")])
def test_an_lr_change_between_backward_and_step_is_said_when_it_applies_a_step_late(tmp_path, caplog, user_clip, when):
    """Streaming updates start as gradients land, with the lr the backward found: an lr set after backward, before
    step(), applies from the next step (plain torch applies it to this one). Said once, as a warning naming the
    setting that makes it exact; with optimizer.user_grad_clip the updates read it at step(): nothing to say, and
    the weights equal the plain loop's. A change after step() (a scheduler's) applies on time: nothing to say."""
    import logging

    plain, plain_opt = plain_model()
    model, optimizer = offload(fresh_model(), config(tmp_path, user_grad_clip=user_clip))
    batches = make_batches(3)
    with optimizer.session, caplog.at_level(logging.WARNING, logger="runtime.engine"):
        for number, batch in enumerate(batches):
            for net, opt in ((model, optimizer), (plain, plain_opt)):
                net(*batch).backward()
                if when == "before step":
                    opt.param_groups[0]["lr"] = LR * (number + 2)
                opt.step()
                opt.zero_grad()
                if when == "after step":
                    opt.param_groups[0]["lr"] = LR * (number + 2)
        warnings = [r for r in caplog.records if "changed between backward() and step()" in r.getMessage()]
        late = when == "before step" and not user_clip
        assert len(warnings) == (1 if late else 0)
        if not late:
            assert_same(optimizer.session.master_state_dict(), dict(plain.named_parameters()))
