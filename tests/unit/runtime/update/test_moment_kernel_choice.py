"""``optimizer.moment_kernel``: which kernel the CPU's bf16 and int8 updates run, built once per process; ``compiled`` refuses
the run (naming the key and what is missing) where the kernel cannot build, ``auto`` falls back to torch ops with
one warning, ``torch`` never builds. Quick: the builds here are made to fail or are never reached (the slow
test_moment_kernel_training builds the real one)."""

from __future__ import annotations

import logging

import pytest

from runtime import offload
from runtime.bundled.example_model import ExampleLM
from runtime.config.loader import ConfigError
from runtime.update import moment_kernel
from runtime.update.moment_kernel import Int8Kernel, int8_kernel_for
from tests.integration.test_parity import SHAPE


@pytest.fixture(autouse=True)
def fresh_build_cache():
    """Each test builds (or fails to) afresh, and leaves no failed build behind for the tests after it."""
    for cached in (moment_kernel._built_once, moment_kernel._warn_fallback):
        cached.cache_clear()
    yield
    for cached in (moment_kernel._built_once, moment_kernel._warn_fallback):
        cached.cache_clear()


@pytest.fixture
def failing_build(monkeypatch):
    """A build that fails as a broken toolchain would, after the tools were found."""
    calls = []

    def fail(self):
        calls.append(1)
        raise RuntimeError("Error building extension 'tierstore_moments_int8'")

    monkeypatch.setattr(moment_kernel, "missing_build_tools", lambda: [])
    monkeypatch.setattr(Int8Kernel, "__init__", fail)
    return calls


@pytest.mark.parametrize(("choice", "moment_dtype", "cpu_updates"),
                         [("torch", "int8", True), ("torch", "bf16", True), ("compiled", "fp32", True),
                          ("auto", "fp32", True), ("compiled", "int8", False), ("auto", "bf16", False)])
def test_nothing_is_built_where_no_compact_update_runs_on_the_cpu(failing_build, choice, moment_dtype, cpu_updates):
    assert int8_kernel_for(choice, moment_dtype, cpu_updates=cpu_updates) is None
    assert not failing_build  # the build was not even tried


def test_compiled_refuses_naming_the_key_and_the_build_error(failing_build):
    with pytest.raises(ConfigError) as raised:
        int8_kernel_for("compiled", "int8")
    assert raised.value.yaml_path == "optimizer.moment_kernel" and raised.value.kind == "environment"
    assert "the build failed" in str(raised.value) and "tierstore_moments_int8" in str(raised.value)
    assert "write auto" in str(raised.value)


def test_compiled_refuses_naming_the_missing_compiler_and_ninja(monkeypatch):
    import torch.utils.cpp_extension

    monkeypatch.setenv("CXX", "no-such-compiler-here")
    monkeypatch.setattr(torch.utils.cpp_extension, "is_ninja_available", lambda: False)
    monkeypatch.setattr(Int8Kernel, "__init__", lambda self: pytest.fail("built without the tools"))
    with pytest.raises(ConfigError, match="optimizer.moment_kernel") as raised:
        int8_kernel_for("compiled", "int8")
    assert "C++ compiler ('no-such-compiler-here'" in str(raised.value) and "ninja" in str(raised.value)


def test_auto_falls_back_to_torch_ops_with_one_warning_and_one_build(failing_build, caplog):
    with caplog.at_level(logging.WARNING, logger="runtime.update.moment_kernel"):
        assert int8_kernel_for("auto", "int8") is None
        assert int8_kernel_for("auto", "int8") is None  # the session asks again after the rate probe
    warnings = [r for r in caplog.records if "optimizer.moment_kernel" in r.getMessage()]
    assert len(warnings) == 1 and "use torch ops" in warnings[0].getMessage()
    assert len(failing_build) == 1  # built (tried) once per process


def test_a_kernel_is_built_once_per_process(monkeypatch):
    built = []
    monkeypatch.setattr(moment_kernel, "missing_build_tools", lambda: [])
    monkeypatch.setattr(Int8Kernel, "__init__", lambda self: built.append(self))
    first = int8_kernel_for("auto", "int8")
    assert first is not None and int8_kernel_for("compiled", "int8") is first and len(built) == 1
    # bf16 moments run the same extension (its adamw_bf16): the same kernel, no second build
    assert int8_kernel_for("auto", "bf16") is first and int8_kernel_for("compiled", "bf16") is first
    assert len(built) == 1


def test_a_kernel_whose_bf16_check_failed_serves_int8_only(monkeypatch):
    """A build whose contraction check failed (it warned then: test_moments_kernel_bf16): bf16 runs torch ops under
    auto and compiled alike, int8 keeps the kernel."""
    built = []
    monkeypatch.setattr(moment_kernel, "missing_build_tools", lambda: [])

    def mismatched(self):
        self.bf16_exact = False
        built.append(self)

    monkeypatch.setattr(Int8Kernel, "__init__", mismatched)
    assert int8_kernel_for("auto", "bf16") is None and int8_kernel_for("compiled", "bf16") is None
    assert int8_kernel_for("auto", "int8") is built[0] and len(built) == 1


def test_compiled_with_bf16_refuses_naming_bf16(failing_build):
    with pytest.raises(ConfigError, match="compiled: the bf16 AdamW kernel cannot be built") as raised:
        int8_kernel_for("compiled", "bf16")
    assert raised.value.yaml_path == "optimizer.moment_kernel" and len(failing_build) == 1


def test_offload_refuses_compiled_before_it_pins_anything(failing_build, monkeypatch):
    from runtime import session as session_module

    opened = []
    monkeypatch.setattr(session_module, "_open_store", lambda *args: opened.append(args))
    model = ExampleLM(SHAPE)
    config = {"dtype": "fp32", "device": "cpu", "optimizer": {"moment_dtype": "int8", "moment_kernel": "compiled"}}
    with pytest.raises(ConfigError, match="optimizer.moment_kernel: compiled: the int8 AdamW kernel cannot be built"):
        offload(model, config)
    assert not opened
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_the_worker_runs_the_kernel_offload_built(monkeypatch):
    """offload() hands the kernel it built to the update thread's scratch (with torch: none)."""
    sentinel = object.__new__(Int8Kernel)  # never called: no step is taken
    monkeypatch.setattr(moment_kernel, "_built_once", lambda: (sentinel, ""))
    for moment_dtype, choice, expected in (("int8", "auto", sentinel), ("int8", "torch", None),
                                           ("bf16", "compiled", sentinel), ("fp32", "auto", None)):
        config = {"dtype": "fp32", "device": "cpu",
                  "optimizer": {"moment_dtype": moment_dtype, "moment_kernel": choice}}
        _model, optimizer = offload(ExampleLM(SHAPE), config)
        with optimizer.session as session:
            assert session.controller.options.int8_kernel is expected
            assert session.controller.worker._moment_scratch.int8_kernel is expected
            assert session.controller.device_updates.moment_scratch.int8_kernel is expected  # CPU tensors here
