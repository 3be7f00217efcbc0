"""``placement.activations``: the layers' forwards recomputed in the backward train exactly like the plain loop,
the layers get their classes back at close, refusals name the setting, and ``auto``'s trial after the measured
first step keeps recomputation only when the time model says it pays (``runtime.planning.measured_placement``)."""

from __future__ import annotations

import copy
import functools
import logging
import weakref

import pytest
import torch
from torch import nn

import runtime.model.recompute as recompute_module
from runtime import offload
from runtime.bundled.example_model import ExampleLM
from runtime.core.blocks import build_blocks
from runtime.core.events import StepEvent
from runtime.model.recompute import BufferWatch, Recompute
from runtime.planning.auto_placement import Placement, StepTimes
from runtime.planning.measured_placement import FirstStepPlacement, RecomputeTrial
from runtime.session import OffloadSession, _adopt_placement, _note_in_plan
from tests.integration.reference_loop import ReferenceTrainer
from tests.integration.test_parity import SHAPE, assert_identical, make_batches, run_both, step_and_check
from tierstore import CapacityError

GiB = 1 << 30


@pytest.fixture(autouse=True)
def warn_of_a_cache_again(monkeypatch):
    """The cache warning is said once a process; each test here may look for it (or for its absence)."""
    import runtime.model.recompute as recompute_module

    monkeypatch.setattr(recompute_module, "_warned_of_a_cache", False)


def _layer_classes(model: ExampleLM) -> set[type]:
    return {type(layer) for layer in model.layers}


@pytest.mark.parametrize("clip", [None, 0.05])
def test_recomputed_layers_train_bit_identical_to_the_plain_loop(clip):
    seen = {}

    def inspect(session):
        seen["recomputed"] = session.controller.recomputed_acquires
        seen["model"] = session.model

    ours, theirs, weights, reference, _, _ = run_both(
        {"dtype": "fp32", "placement": {"activations": "recompute"}, "optimizer": {"grad_clip": clip}}, inspect=inspect)
    assert ours == theirs
    assert_identical(weights, reference)
    # every layer's forward ran again in each backward, and close() gave the layers their own class back
    assert seen["recomputed"] == SHAPE.num_layers * len(ours)
    assert {cls.__name__ for cls in _layer_classes(seen["model"])} == {"DecoderLayer"}
    assert all(cls.__module__ == "runtime.bundled.example_model" and not hasattr(cls, "_tierstore_recomputes")
               for cls in _layer_classes(seen["model"]))


def test_recomputed_layers_print_and_evaluate_as_before():
    torch.manual_seed(0)
    model = ExampleLM(SHAPE)
    printed = repr(model)
    x, y = make_batches(1)[0]
    with torch.no_grad():
        before = model(x, y).item()
    model, optimizer = offload(model, {"dtype": "fp32", "placement": {"activations": "recompute"}})
    with optimizer.session:
        assert all(hasattr(type(layer), "_tierstore_recomputes") for layer in model.layers)
        assert repr(model) == printed
        with torch.no_grad():  # no graph: no checkpoint, the same loss
            assert model(x, y).item() == before
        assert optimizer.session.controller.recomputed_acquires == 0


def train_beside_plain(model: nn.Module, config: dict, loss_of, *, steps: int = 3, device: str = "cpu") -> OffloadSession:
    """Train ``model`` offloaded with ``config`` and a copy of it with torch's fused AdamW (the same
    hyper-parameters), ``loss_of(model)`` a step, each step's random state seeded alike for both and another one
    for the offloaded backward (a recomputation must not draw from it); every loss must be equal. Returns the
    offloaded session, closed."""
    plain = copy.deepcopy(model).to(device)
    reference = torch.optim.AdamW(plain.parameters(), lr=1e-3, weight_decay=0.01, fused=True)
    ours, optimizer = offload(model, config)
    seed = torch.cuda.manual_seed if device == "cuda" else torch.manual_seed
    with optimizer.session:
        for step in range(steps):
            seed(step)
            loss = loss_of(ours)
            seed(1000 + step)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            seed(step)
            expected = loss_of(plain)
            expected.backward()
            reference.step()
            reference.zero_grad()
            assert loss.item() == expected.item(), step
    return optimizer.session


RECOMPUTE_SMALL_BLOCKS = {"dtype": "fp32", "placement": {"activations": "recompute"}, "blocks": {"min_block_size": 1},
                          "optimizer": {"grad_clip": None}}


class LayerStack(nn.Module):
    """Layers called one after another (``call(layer, x)``, by default ``layer(x)``): the repeated layers
    ``runtime.core.blocks`` finds; the loss is the output's mean square."""

    def __init__(self, layers, call=None):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.call = call or (lambda layer, x: layer(x))

    def forward(self, x):
        for layer in self.layers:
            x = self.call(layer, x)
        return x.square().mean()


def keyword_dropout_model(width: int = 32) -> LayerStack:
    """Three keyword-called dropout layers (``KeywordDropoutLayer``)."""
    return LayerStack([KeywordDropoutLayer(width) for _ in range(3)], call=lambda layer, x: layer(hidden=x))


class _NormedLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear, self.norm = nn.Linear(64, 64), nn.BatchNorm1d(64)

    def forward(self, x):
        return self.norm(self.linear(x))


class _CallingLayer(nn.Module):
    """A layer class with its own __call__, as Hugging Face's GradientCheckpointingLayer has in some versions."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(16, 16)
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return super().__call__(*args, **kwargs)

    def forward(self, x, *, scale):
        return torch.tanh(self.linear(x)) * scale


def test_a_layer_class_with_its_own_call_is_recomputed_through_it():
    torch.manual_seed(0)
    model = LayerStack([_CallingLayer() for _ in range(3)], call=lambda layer, x: layer(x, scale=0.5))
    x = torch.randn(4, 16)
    session = train_beside_plain(model, RECOMPUTE_SMALL_BLOCKS, lambda m: m(x))
    assert session.controller.recomputed_acquires == 3 * 3
    assert [layer.calls for layer in model.layers] == [6, 6, 6]  # the forward's call and the recomputation's


def test_recompute_refuses_batch_norm_layers_and_a_model_that_checkpoints_itself():
    with pytest.raises(ValueError, match=r"placement\.activations: recompute cannot apply: .*BatchNorm1d.*"
                                         r"set placement\.activations: keep"):
        offload(LayerStack([_NormedLayer() for _ in range(2)]), {"dtype": "fp32", "placement": {"activations": "recompute"}})
    model = ExampleLM(SHAPE)
    for layer in model.layers:  # what Hugging Face's gradient_checkpointing_enable() sets on each layer
        layer.gradient_checkpointing = True
    with pytest.raises(ValueError, match="already checkpoints its layers"):
        offload(model, {"dtype": "fp32", "placement": {"activations": "recompute"}})


class _Timer:
    """ForwardTimer's interface without CUDA events: the measured steps' layers took ``seconds`` (each layer's
    least); counts the steps begun and dropped. ``fail_at_step``: next_step raises when that step begins."""

    def __init__(self, seconds: float, fail_at_step: int | None = None):
        self._seconds, self.steps, self.drops, self.removed = seconds, 0, 0, False
        self.fail_at_step = fail_at_step

    def next_step(self):
        self.steps += 1
        if self.steps == self.fail_at_step:
            raise RuntimeError("a CUDA event could not be read (a stand-in)")

    def drop_step(self):
        self.drops += 1

    def seconds(self):
        return self._seconds

    def remove(self):
        self.removed = True


class _Asked:
    """The placement auto placement answers at each measured step's reserve, in turn."""

    def __init__(self, *answers: Placement):
        self.answers, self.reserves = list(answers), []

    def __call__(self, reserve: int) -> Placement:
        self.reserves.append(reserve)
        return self.answers[len(self.reserves) - 1]


def _placement(update: float, stream: float, bound_s: float, after_backward: bool = True) -> Placement:
    return Placement(update, stream, 0, notes=("auto placement: chosen for the test",), activation_reserve_nbytes=GiB,
                     times=StepTimes(bound_s, bound_s / 2, bound_s / 2, after_backward=after_backward))


def _trial(session, recompute: Recompute, timer) -> RecomputeTrial:
    """The trial offload() builds (runtime.session._recompute_trial), with a stand-in timer."""
    return RecomputeTrial(recompute, timer, lambda: session.controller.recomputed_acquires > 0,
                          BufferWatch(recompute.modules))


def _listen(session, recompute: Recompute, timer, ask, *, adopt=None, reset_peak=lambda: None, report: bool = False,
            trial: RecomputeTrial | None = None) -> FirstStepPlacement:
    """A first-step listener as offload() attaches it, on the stand-ins the tests use (a 20 GiB budget, a 1 GiB
    plan, a 4 GiB measured peak), attached to the session's controller. ``adopt`` defaults to the session's own
    placement change; ``trial`` to ``_trial``'s."""
    noted = {"report": functools.partial(_note_in_plan, weakref.ref(session))} if report else {}
    listener = FirstStepPlacement(
        plan_gpu_nbytes=GiB, budget_nbytes=20 * GiB, ask=ask,
        adopt=adopt or functools.partial(_adopt_placement, weakref.ref(session)),
        peak=lambda: 4 * GiB, reset_peak=reset_peak, trial=trial or _trial(session, recompute, timer), **noted)
    session.controller.step_listeners.append(listener)
    return listener


def _clipping_session_on_the_cpu():
    """The example model offloaded with every update on the CPU and a clip that binds, beside its reference, with
    a Recompute for its layers and a stand-in timer: what a first-step listener's trial is tested on."""
    torch.manual_seed(0)
    model = ExampleLM(SHAPE)
    reference = ReferenceTrainer(model, dtype=torch.float32, grad_clip=0.05)
    model, optimizer = offload(model, {"dtype": "fp32", "placement": {"activations": "keep"},
                                       "optimizer": {"grad_clip": 0.05, "gpu_update_fraction": 0.0,
                                                     "gpu_stream_fraction": 0.0}})
    session = optimizer.session
    return model, optimizer, reference, session, Recompute(session.blocks), _Timer(0.05)


@pytest.mark.parametrize("recompute_pays", [True, False])
def test_the_second_measured_step_tries_recomputation_and_keeps_it_only_where_it_pays(caplog, recompute_pays):
    """The first step's placement leaves updates on the CPU, so the second step recomputes the layers (its updates
    still on the CPU); its placement is adopted with recomputation on when its modelled step plus the timed forward
    beats the first's, else the first's is adopted and the layers get their classes back. Exact throughout."""
    import logging

    model, optimizer, reference, session, recompute, timer = _clipping_session_on_the_cpu()
    session.on_close.append(recompute.undo)
    kept, recomputed = _placement(0.2, 0.3, 0.2), _placement(1.0, 0.0, 0.1 if recompute_pays else 0.18)
    ask = _Asked(kept, recomputed)
    listener = _listen(session, recompute, timer, ask, report=True)
    caplog.set_level(logging.INFO, logger="runtime.planning.measured_placement")
    batches = make_batches(5)
    with session:
        step_and_check(model, optimizer, reference, *batches[0])
        assert recompute.on and listener.chosen is None and not session.controller.gpu_updated
        step_and_check(model, optimizer, reference, *batches[1])
        assert session.controller.recomputed_acquires == SHAPE.num_layers  # the trial step recomputed
        assert timer.removed and timer.steps == 2
        assert listener.chosen is (recomputed if recompute_pays else kept)
        assert recompute.on is recompute_pays
        for x, y in batches[2:]:
            step_and_check(model, optimizer, reference, x, y)
        assert session.controller.recomputed_acquires == SHAPE.num_layers * (4 if recompute_pays else 1)
        assert_identical(session.master_state_dict(), reference)
    assert len(ask.reserves) == 2
    assert ("activations recomputed" if recompute_pays else "activations kept") in caplog.text
    # clipping: the terms follow the compute (3 x 0.05 s kept, 4 x 0.05 recomputed): 0.35 s kept against 0.30 / 0.38
    assert f"for a modelled {0.3 if recompute_pays else 0.38:.3f} s a step (the layers' forward timed at 0.050 s" in caplog.text
    # the verdict is among the plan's notes the session keeps (after the adopted placement's own)
    assert any("the layers' forward timed at" in note for note in session.plan.notes)
    assert not any(hasattr(type(layer), "_tierstore_recomputes") for layer in model.layers)


def test_no_trial_where_everything_fits_or_the_model_recomputes_itself():
    """A first-step placement that puts every update on the GPU needs no recomputation; nor does a model whose own
    checkpointing the controller saw recompute (no second measured step in either case)."""
    for everything_fits, checkpointing in ((True, False), (False, True)):
        torch.manual_seed(0)
        model = ExampleLM(SHAPE, activation_checkpointing=checkpointing)
        model, optimizer = offload(model, {"dtype": "fp32", "placement": {"activations": "keep"},
                                           "optimizer": {"gpu_update_fraction": 0.0, "gpu_stream_fraction": 0.0}})
        session = optimizer.session
        recompute, timer = Recompute(session.blocks), _Timer(0.05)
        first = _placement(1.0 if everything_fits else 0.2, 0.0, 0.2)
        ask = _Asked(first)
        listener = _listen(session, recompute, timer, ask)
        with session:
            for x, y in make_batches(2):
                model(x, y).backward()
                optimizer.step()
                optimizer.zero_grad()
            assert listener.chosen is first and not recompute.on and timer.removed and len(ask.reserves) == 1


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_a_hugging_face_llama_with_its_cache_on_and_a_padded_batch_recomputes_exactly(attention, caplog):
    """Llama's config has use_cache on: a training forward passes each layer a key/value cache, which a recomputed
    forward would append to again (keys twice as long: a shape error with a padding mask or eager attention). The
    recomputing call drops the cache as Hugging Face's own checkpointing does, and training is bit-identical to
    the plain model's."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      attn_implementation=attention)
    assert config.use_cache
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    tokens = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, :5] = 0  # left padding in the second row
    batch = {"input_ids": tokens[:, :-1], "attention_mask": mask, "labels": tokens[:, 1:]}
    session = train_beside_plain(model, {"dtype": "fp32", "placement": {"activations": "recompute"},
                                         "optimizer": {"grad_clip": None}}, lambda m: m(**batch).loss)
    assert session.controller.recomputed_acquires == 3 * 3
    assert "key/value cache" not in caplog.text  # use_cache was off for the training forwards


def test_a_copy_or_a_pickle_taken_while_recomputing_is_an_ordinary_model():
    import io
    import pickle

    torch.manual_seed(0)
    model = ExampleLM(SHAPE)
    recompute = Recompute(build_blocks(model, 1))
    recompute.turn_on()
    try:
        copied = copy.deepcopy(model)
        buffer = io.BytesIO()
        pickle.dump(model.layers[0], buffer)
        unpickled = pickle.loads(buffer.getvalue())
    finally:
        recompute.undo()
    assert not any(hasattr(type(layer), "_tierstore_recomputes") for layer in copied.layers)
    assert not hasattr(type(unpickled), "_tierstore_recomputes") and type(unpickled) is type(model.layers[0])
    recompute.turn_on()  # twice on, once off: never wrapped twice
    recompute.on = False
    recompute.turn_on()
    assert all(type(layer).__bases__ == (type(copied.layers[0]),) for layer in model.layers)
    recompute.undo()


def test_a_session_closed_mid_trial_takes_the_timers_hooks_off_and_the_layers_classes_back():
    """offload()'s own wiring, on the CPU where no step is measured: the first-step listener is given a trial only on a
    GPU, so the test builds one as offload does and closes the session between the two measured steps."""
    torch.manual_seed(0)
    model = ExampleLM(SHAPE)
    model, optimizer = offload(model, {"dtype": "fp32", "placement": {"activations": "keep"}})
    session = optimizer.session
    recompute, timer = Recompute(session.blocks), _Timer(0.05)
    session.on_close.append(recompute.undo)
    listener = _listen(session, recompute, timer, _Asked(_placement(0.2, 0.0, 0.2)))
    session.on_close.append(listener.close)
    x, y = make_batches(1)[0]
    model(x, y).backward()
    optimizer.step()
    assert recompute.on and not timer.removed  # the trial is under way
    session.close()
    assert timer.removed and not recompute.on and listener.done
    assert not any(hasattr(type(layer), "_tierstore_recomputes") for layer in model.layers)


def test_an_error_while_turning_recomputation_on_keeps_the_first_steps_placement(caplog, monkeypatch):
    torch.manual_seed(0)
    model = ExampleLM(SHAPE)
    reference = ReferenceTrainer(model, dtype=torch.float32)
    model, optimizer = offload(model, {"dtype": "fp32", "placement": {"activations": "keep"},
                                       "optimizer": {"grad_clip": None, "gpu_update_fraction": 0.0,
                                                     "gpu_stream_fraction": 0.0}})
    session = optimizer.session
    recompute, timer = Recompute(session.blocks), _Timer(0.05)

    def broken():
        raise RuntimeError("cannot swap the class")

    monkeypatch.setattr(recompute, "turn_on", broken)
    first = _placement(0.2, 0.0, 0.2)
    ask = _Asked(first, _placement(1.0, 0.0, 0.0))
    listener = _listen(session, recompute, timer, ask)
    with session:
        for x, y in make_batches(3):
            step_and_check(model, optimizer, reference, x, y)
        assert listener.done and listener.trial is None and timer.removed and len(ask.reserves) == 1
        assert listener.chosen is first and session.controller.gpu_updated  # the first step's placement stands
        assert "the layers could not be recomputed" in caplog.text
        assert_identical(session.master_state_dict(), reference)


class KeywordDropoutLayer(nn.Module):
    """A layer whose only tensor argument is a keyword, with dropout."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.linear, self.dropout = nn.Linear(width, width), nn.Dropout(0.5)

    def forward(self, *, hidden):
        return hidden + self.dropout(torch.tanh(self.linear(hidden)))


def test_recomputed_dropout_layers_called_with_keywords_train_like_the_plain_model():
    """The recomputation draws the forward's dropout masks (the random state is restored), also for a layer whose
    only tensor argument is a keyword; the backward's own draws (seeded elsewhere) do not leak in. The GPU test of
    the same checks the device's random state."""
    torch.manual_seed(0)
    model, x = keyword_dropout_model(), torch.randn(8, 32)
    session = train_beside_plain(model, RECOMPUTE_SMALL_BLOCKS, lambda m: m(x))
    assert session.controller.recomputed_acquires == 3 * 3


def test_a_gpt2_with_its_cache_on_recomputes_exactly(caplog):
    """GPT-2 hands its blocks the cache positionally; the model's own use_cache (on in its config) is turned off for
    training forwards while the layers are recomputed, as Hugging Face's checkpointing does, and training is
    bit-identical to the plain model's, with a padding mask and eager attention."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=128, n_positions=64, n_embd=64, n_layer=3, n_head=4,
                                     attn_implementation="eager", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    assert config.use_cache
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    tokens = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, :5] = 0
    batch = {"input_ids": tokens[:, :-1], "attention_mask": mask, "labels": tokens[:, 1:]}
    session = train_beside_plain(model, {"dtype": "fp32", "placement": {"activations": "recompute"},
                                         "optimizer": {"grad_clip": None}}, lambda m: m(**batch).loss)
    assert session.controller.recomputed_acquires == 3 * 3
    assert "key/value cache" not in caplog.text  # no layer was handed one: the model's forward made none
    assert not model._forward_pre_hooks_with_kwargs  # close() took the use_cache switch off


def test_a_cache_passed_to_a_layer_by_name_or_position_is_dropped_with_a_warning(caplog):
    import runtime.model.recompute as recompute_module

    Cache = type("Cache", (), {"__module__": "transformers.cache_utils"})
    DynamicCache = type("DynamicCache", (Cache,), {"__module__": "transformers.cache_utils"})
    layer, hidden, cache = nn.Linear(2, 2), torch.zeros(1), DynamicCache()
    args, kwargs = recompute_module._without_cache(layer, (hidden, cache), {"layer_past": (hidden,), "use_cache": True})
    assert args == (hidden, None) and kwargs == {"layer_past": None, "use_cache": True}
    assert "called with a key/value cache while recording a graph" in caplog.text
    untouched = ((hidden,), {"cache": None, "scale": 0.5})
    assert recompute_module._without_cache(layer, *untouched) == untouched
    layer._can_checkpoint_with_cache = True
    assert recompute_module._without_cache(layer, (hidden, cache), {}) == ((hidden, cache), {})


def test_undo_after_a_turn_on_that_failed_half_way_restores_every_layer(monkeypatch):
    import runtime.model.recompute as recompute_module

    torch.manual_seed(0)
    model = ExampleLM(SHAPE)
    original = type(model.layers[0])
    real, calls = recompute_module._recomputing_class, []

    def second_fails(cls):
        calls.append(cls)
        if len(calls) == 2:
            raise RuntimeError("no class for this one")
        return real(cls)

    monkeypatch.setattr(recompute_module, "_recomputing_class", second_fails)
    recompute = Recompute(build_blocks(model, 1))
    with pytest.raises(RuntimeError):
        recompute.turn_on()
    assert type(model.layers[0]) is not original  # the first was swapped before the failure
    recompute.undo()
    assert all(type(layer) is original for layer in model.layers)


class _CountingLayer(nn.Module):
    """A layer whose forward changes a buffer: recomputing it would count twice."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(16, 16)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        if self.training:
            self.calls += 1
        return torch.tanh(self.linear(x))


@pytest.mark.parametrize("why", ["buffers", "checkpointing enabled after offload"])
def test_no_trial_for_layers_that_change_their_buffers_or_start_checkpointing_themselves(caplog, why):
    import logging

    torch.manual_seed(0)
    model = LayerStack([_CountingLayer() for _ in range(3)]) if why == "buffers" else ExampleLM(SHAPE)
    model, optimizer = offload(model, {"dtype": "fp32", "placement": {"activations": "keep"},
                                       "blocks": {"min_block_size": 1},
                                       "optimizer": {"gpu_update_fraction": 0.0, "gpu_stream_fraction": 0.0}})
    session = optimizer.session
    recompute, timer = Recompute(session.blocks), _Timer(0.05)
    first = _placement(0.2, 0.0, 0.2)
    ask = _Asked(first)
    listener = _listen(session, recompute, timer, ask, trial=RecomputeTrial(
        recompute, timer, lambda: recompute_module.already_checkpointed(session.blocks, model),
        BufferWatch(recompute.modules)))
    if why != "buffers":
        for layer in model.layers:  # as the HF Trainer's gradient_checkpointing does, inside train()
            layer.gradient_checkpointing = True
    caplog.set_level(logging.INFO, logger="runtime.planning.measured_placement")
    x = torch.randn(4, 16) if why == "buffers" else None
    with session:
        for batch in (make_batches(2) if x is None else [(x,), (x,)]):
            model(*batch).backward()
            optimizer.step()
            optimizer.zero_grad()
        assert listener.chosen is first and not recompute.on and len(ask.reserves) == 1
    assert ("changed a buffer (_CountingLayer[0].calls)" if why == "buffers"
            else "checkpoints its layers itself") in caplog.text


def test_explicit_recompute_leaves_evaluation_and_self_checkpointing_layers_alone():
    """Recomputation is for training forwards: a forward in eval mode with gradients on (which may use a cache)
    runs as is, and so does a layer that checkpoints itself (Hugging Face's flag, set after offload())."""
    torch.manual_seed(0)
    model = ExampleLM(SHAPE)
    model, optimizer = offload(model, {"dtype": "fp32", "placement": {"activations": "recompute"}})
    x, y = make_batches(1)[0]
    with optimizer.session:
        controller = optimizer.session.controller
        model.eval()
        model(x, y).backward()
        assert controller.recomputed_acquires == 0
        optimizer.zero_grad()
        model.train()
        model(x, y).backward()
        assert controller.recomputed_acquires == SHAPE.num_layers
        optimizer.zero_grad()
        for layer in model.layers:
            layer.gradient_checkpointing = True
        model(x, y).backward()
        assert controller.recomputed_acquires == SHAPE.num_layers  # not again: the layer's own flag wins
        optimizer.zero_grad()


def test_a_dropped_step_is_not_measured_the_next_one_is(caplog):
    """zero_grad() before step() drops the step in progress: the first-step listener measures the next training
    step from its start (its peak reset there, the timer's spans of the dropped attempt forgotten), not the dropped
    attempt."""
    torch.manual_seed(0)
    model = ExampleLM(SHAPE)
    model, optimizer = offload(model, {"dtype": "fp32", "placement": {"activations": "keep"},
                                       "optimizer": {"gpu_update_fraction": 0.0, "gpu_stream_fraction": 0.0}})
    session = optimizer.session
    recompute, timer = Recompute(session.blocks), _Timer(0.05)
    resets = []
    listener = _listen(session, recompute, timer, _Asked(_placement(1.0, 0.0, 0.0)), reset_peak=lambda: resets.append(1))
    (x, y), (x2, y2) = make_batches(2)
    with session:
        model(x, y).backward()
        optimizer.zero_grad()  # dropped
        assert resets == [1] and timer.steps == 1 and timer.drops == 1 and not listener.started and listener.measured_steps == 0
        model(x2, y2).backward()
        optimizer.step()
        assert resets == [1, 1] and timer.steps == 2 and timer.drops == 1 and listener.measured_steps == 1 and listener.done


def test_a_trial_whose_timer_fails_as_its_step_begins_places_by_that_step_kept(caplog):
    """The timer raising as the second measured step begins ends the trial there (nothing recomputed); that step,
    run with its activations kept, is measured and its placement adopted (not every update left on the CPU); a
    drop between the measured steps (no step under way) leaves the first step's forwards timed. Exact."""
    model, optimizer, reference, session, recompute, _ = _clipping_session_on_the_cpu()
    timer = _Timer(0.05, fail_at_step=2)
    first, second = _placement(0.2, 0.0, 0.2), _placement(0.3, 0.0, 0.2)
    listener = _listen(session, recompute, timer, _Asked(first, second))
    caplog.set_level(logging.INFO, logger="runtime.planning.measured_placement")
    with session:
        batches = make_batches(4)
        step_and_check(model, optimizer, reference, *batches[0])
        assert recompute.on and listener.chosen is None
        listener(StepEvent("drop", 1, 0.0))  # between the measured steps
        assert timer.drops == 0
        for x, y in batches[1:]:
            step_and_check(model, optimizer, reference, x, y)
        assert listener.chosen is second and not recompute.on and timer.removed
        assert session.controller.recomputed_acquires == 0 and session.controller.gpu_updated
        assert_identical(session.master_state_dict(), reference)
    assert "the recompute trial ended before its step" in caplog.text and "no recompute trial" in caplog.text


def test_a_recomputed_placement_that_cannot_be_adopted_falls_back_to_the_first_steps(caplog):
    model, optimizer, reference, session, recompute, timer = _clipping_session_on_the_cpu()
    kept, recomputed = _placement(0.2, 0.0, 0.2), _placement(1.0, 0.0, 0.0)
    adopt = functools.partial(_adopt_placement, weakref.ref(session))

    def adopt_all_but_everything(placement):
        if placement is recomputed:
            raise CapacityError("gpu", 4 * GiB, 15 * GiB, 16 * GiB, "master and moments of every block")
        adopt(placement)

    listener = _listen(session, recompute, timer, _Asked(kept, recomputed), adopt=adopt_all_but_everything)
    caplog.set_level(logging.INFO, logger="runtime.planning.measured_placement")
    with session:
        for x, y in make_batches(4):
            step_and_check(model, optimizer, reference, x, y)
        assert listener.chosen is kept and not recompute.on and session.controller.gpu_updated
        assert_identical(session.master_state_dict(), reference)
    assert "could not be adopted" in caplog.text and "so the first step's is, activations kept" in caplog.text


def test_a_first_forward_that_raised_is_not_measured_nor_is_a_trial_in_eval_mode():
    """The first measured forward raising (a loop that retries after an out-of-memory error) starts the
    measurement again at the next forward; a loop that trains in eval mode gets no trial (nothing is recomputed
    outside train mode)."""
    torch.manual_seed(0)
    model = ExampleLM(SHAPE)
    model, optimizer = offload(model, {"dtype": "fp32", "placement": {"activations": "keep"},
                                       "optimizer": {"gpu_update_fraction": 0.0, "gpu_stream_fraction": 0.0}})
    session = optimizer.session
    recompute, timer = Recompute(session.blocks), _Timer(0.05)
    resets, first = [], _placement(0.2, 0.0, 0.2)
    listener = _listen(session, recompute, timer, _Asked(first), reset_peak=lambda: resets.append(1))
    (x, y), (x2, y2) = make_batches(2)
    def out_of_memory(*args):
        raise torch.OutOfMemoryError("CUDA out of memory (a stand-in)")

    # inside layer 1's forward (after the runtime's own pre-hook acquired its block), as an allocation would fail
    failing = model.layers[1].register_forward_pre_hook(out_of_memory)
    with session:
        model.eval()  # trains in eval mode (a "grad-eval" step)
        with pytest.raises(torch.OutOfMemoryError):
            model(x, y)
        failing.remove()
        model(x2, y2).backward()  # the raised forward is seen here: "drop", then this step is measured anew
        optimizer.step()
        assert resets == [1, 1] and timer.steps == 2 and timer.drops == 1 and listener.measured_steps == 1
        assert listener.chosen is first and not recompute.on and timer.removed  # eval mode: no trial


def test_a_buffer_replaced_twice_is_seen_changed():
    layer = _CountingLayer()
    watch = BufferWatch([layer])
    watch.mark()
    for _ in range(2):  # replaced, not changed in place: a freed tensor's id may come back
        layer.calls = layer.calls + 1
    assert watch.changed() == "_CountingLayer[0].calls"
    watch.mark()
    assert watch.changed() is None


def test_the_forward_time_counts_each_layers_least_over_the_measured_steps():
    """A layer's span in the second measured step grows while the first step's CPU updates run beside it; each layer
    counts its least time over the steps, and a layer a step did not run (a dropped attempt's, say) is not
    counted there."""
    from runtime.model.recompute import least_per_layer

    first, second = {"a": 0.030, "b": 0.050}, {"a": 0.040, "b": 0.020, "c": 0.010}
    assert least_per_layer([first, second]) == pytest.approx(0.030 + 0.020 + 0.010)
    assert least_per_layer([second]) == pytest.approx(0.070)
    assert least_per_layer([{}, first]) == pytest.approx(0.080) and least_per_layer([]) == 0
