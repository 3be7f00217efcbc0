"""Ctrl-C (SIGINT) and SIGTERM arriving while tierstore's own code runs in the main thread ([Note: deferred
interrupts] in runtime.core.signals): the interrupt reaches the user's loop when tierstore's call returns, and the
step it cut is dropped exactly, as an exception the loop catches is. The signal is sent from inside the store
(a listener on its transfer events, run by the copy's own code in the main thread on the CPU): before, it landed
there, was stored in the copy's handle as the copy's failure, and the optimizer worker died with it ('the
optimizer worker failed: KeyboardInterrupt()' at every later step; found by a fuzz of such interrupts)."""

from __future__ import annotations

import signal
import threading

import pytest
import torch

from runtime import offload
from runtime.core.signals import Terminated
from tests.integration.test_parity import make_batches
from tests.integration.test_user_contract import assert_same, config, fresh_model, plain_model


class SignalAtCopy:
    """Sends a signal to this process from inside the store's nth device-to-host copy after ``arm(nth)``, made in
    the main thread (its transfer event is published by the copy's own code)."""

    def __init__(self, session, signum: int):
        self.signum = signum
        self.countdown: int | None = None
        self.sent = 0
        session.store.bus.subscribe(self)

    def arm(self, nth: int) -> None:
        self.countdown = nth

    def __call__(self, event: object) -> None:
        if self.countdown is None or getattr(event, "kind", "") != "d2h" \
                or threading.current_thread() is not threading.main_thread():
            return
        self.countdown -= 1
        if self.countdown == 0:
            self.countdown = None
            self.sent += 1
            signal.raise_signal(self.signum)


@pytest.mark.parametrize("optimizer, clip", [({"user_grad_clip": True}, 0.05), ({"grad_clip": 0.05}, None),
                                             ({"user_grad_clip": True, "accumulation_steps": 2}, None)],
                         ids=["user-clip", "tierstore-clip", "accumulation"])
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
@pytest.mark.usefixtures("default_sigint")
def test_an_interrupt_inside_a_copy_reaches_the_loop_and_the_step_is_dropped_exactly(tmp_path, optimizer, clip, signum):
    previous = signal.getsignal(signal.SIGTERM)
    plain, plain_opt = plain_model()
    cfg = config(tmp_path, **optimizer)
    cfg["placement"] = {"master": "host", "moments": "host"}
    model, opt = offload(fresh_model(), cfg)
    assert type(signal.getsignal(signum)).__name__ == "_SignalHandler"  # else the signal below ends pytest
    accumulation = optimizer.get("accumulation_steps", 1)
    batches = make_batches(4 * accumulation)
    sender = SignalAtCopy(opt.session, signum)
    interrupted = 0
    try:
        with opt.session:
            for step in range(4):
                window = batches[step * accumulation:(step + 1) * accumulation]
                if step == 1:
                    sender.arm(3)  # the third copy off the device of this step: in its backward
                committed = opt.session.controller.optimizer_step
                try:
                    for batch in window:
                        model(*batch).backward()
                    if clip is not None:
                        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                    opt.step()
                except (KeyboardInterrupt, Terminated):
                    interrupted += 1
                    # Held to the end of tierstore's call, it may come out of a step() that committed, as a
                    # Ctrl-C right after step() returns would: whole or not at all, and the count says which.
                    if opt.session.controller.optimizer_step == committed:
                        opt.zero_grad()
                        continue  # the plain loop skips this step too
                opt.zero_grad()
                for batch in window:
                    plain(*batch).backward()
                if clip is not None or "grad_clip" in optimizer:
                    torch.nn.utils.clip_grad_norm_(plain.parameters(), clip or optimizer["grad_clip"])
                plain_opt.step()
                plain_opt.zero_grad()
            assert sender.sent == 1 and interrupted == 1
            assert_same(model.state_dict(), plain.state_dict())
    finally:
        signal.signal(signal.SIGTERM, previous)
