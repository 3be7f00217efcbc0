"""``tierstore plan --model``: local HF configs and named shapes on the CPU, fits and refusals, the flags' help,
the stated rates, and the GPU check script's CPU path."""

from __future__ import annotations

import re
import runpy
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")  # the hf extra; CI installs it

from runtime.cli.main import build_parser  # noqa: E402
from runtime.cli.main import main as cli_main  # noqa: E402

ROOT = Path(__file__).resolve().parents[4]
STATED = ["--pcie", "20", "--cpu-adam", "2", "--disk", "4", "--gpu-tflops", "100"]


def save_config(directory: Path, kind: str) -> Path:
    """A tiny HF config of ``kind`` saved with ``save_pretrained`` (nothing downloaded)."""
    import transformers

    shape = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "intermediate_size": 128, "vocab_size": 512, "max_position_embeddings": 256}
    config = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
              "mistral": transformers.MistralConfig}[kind](**shape)
    config.save_pretrained(directory / kind)
    return directory / kind


def figures(out: str) -> tuple[float, float]:
    """The predicted step seconds and tokens/s of the output."""
    found = re.search(r"predicted step ([\d.]+) s, ([\d,]+) tokens/s", out)
    assert found, out
    return float(found.group(1)), float(found.group(2).replace(",", ""))


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_plan_a_local_hf_config(tmp_path, capsys, kind):
    directory = save_config(tmp_path, kind)
    assert cli_main(["plan", "--model", str(directory), "--seq", "128", "--micro-batch", "2", "--accumulation", "4",
                     "--gpu-memory", "8GiB", "--host-memory", "16GiB", *STATED]) == 0
    out = capsys.readouterr().out
    assert f"({kind}):" in out and "sequence 128, micro-batch 2, accumulation 4 (1,024 tokens a step)" in out
    assert "memory plan:" in out and "master (fp32)" in out and "the plan fits" in out
    assert "for these stated rates, not measured" in out
    step_s, tokens_per_s = figures(out)
    assert tokens_per_s == pytest.approx(1024 / step_s, rel=0.02)


@pytest.mark.parametrize("name", ["llama-3-8b", "qwen2.5-7b"])
def test_plan_a_named_shape(capsys, name):
    assert cli_main(["plan", "--model", name, "--seq", "4096", "--accumulation", "8", "--gpu-memory", "24GiB",
                     "--host-memory", "256GiB", *STATED]) == 0
    out = capsys.readouterr().out
    params = {"llama-3-8b": "8,030,261,248", "qwen2.5-7b": "7,615,616,512"}[name]  # the published counts
    assert f"{params} parameters" in out and "the plan fits" in out
    step_s, _ = figures(out)
    assert step_s > 1


def test_too_little_host_memory_is_refused_with_this_commands_flags(capsys):
    assert cli_main(["plan", "--model", "llama-3-8b", "--gpu-memory", "24GiB", "--host-memory", "32GiB", *STATED]) == 1
    out = capsys.readouterr().out
    assert "does not fit" in out and "predicted step" not in out
    assert "tiers.host.budget (--host-memory)" in out and "--nvme PATH --nvme-size SIZE" in out


def test_activations_beyond_the_gpu_memory_are_refused(capsys):
    assert cli_main(["plan", "--model", "llama-3-8b", "--seq", "4096", "--micro-batch", "2", "--gpu-memory", "8GiB",
                     "--host-memory", "256GiB", *STATED]) == 1
    out = capsys.readouterr().out
    assert "does not fit: gpu:" in out and "of activations" in out and "lower --micro-batch or --seq" in out
    assert cli_main(["plan", "--model", "llama-3-8b", "--seq", "1024", "--gpu-memory", "10GiB",
                     "--host-memory", "256GiB", *STATED]) == 0  # fewer tokens a micro-batch and a larger card


def test_spilling_to_a_stated_disk_makes_it_fit(tmp_path, capsys):
    swap = tmp_path / "swap"
    swap.mkdir(mode=0o700)
    assert cli_main(["plan", "--model", "llama-3-8b", "--gpu-memory", "24GiB", "--host-memory", "96GiB",
                     "--nvme", str(swap), "--nvme-size", "1TiB", *STATED]) == 0
    out = capsys.readouterr().out
    assert "the plan fits" in out and "spilled blocks)" in out and "T_nvme" in out
    with_faster_disk = cli_main(["plan", "--model", "llama-3-8b", "--gpu-memory", "24GiB", "--host-memory", "96GiB",
                                 "--nvme", str(swap), "--nvme-size", "1TiB", *STATED[:4], "--disk", "40",
                                 *STATED[6:]])
    assert with_faster_disk == 0
    assert figures(capsys.readouterr().out)[0] < figures(out)[0]


def test_unknown_name_lists_the_shapes(capsys):
    assert cli_main(["plan", "--model", "llama-9"]) == 2
    err = capsys.readouterr().err
    assert "neither a directory holding config.json nor a known shape" in err and "qwen2.5-32b" in err


def test_without_transformers_the_error_names_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers now raises ImportError
    assert cli_main(["plan", "--model", "llama-3-8b"]) == 2
    assert "pip install -e '.[hf]'" in capsys.readouterr().err


def test_help_describes_every_flag():
    plan = next(a for a in build_parser()._subparsers._group_actions[0].choices.items() if a[0] == "plan")[1]
    flags = [a for a in plan._actions if a.option_strings and "--help" not in a.option_strings]
    assert {f.option_strings[0] for f in flags} >= {"--config", "--model", "--gpu-memory", "--host-memory", "--nvme",
                                                    "--nvme-size", "--seq", "--micro-batch", "--accumulation", "--pcie",
                                                    "--cpu-adam", "--disk", "--gpu-tflops"}
    assert all(f.help and len(f.help) > 20 for f in flags), [f.option_strings for f in flags if not f.help]


def test_plan_config_still_plans_the_example_model(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text("device: cpu\ndtype: fp32\n")
    assert cli_main(["plan", "--config", str(config)]) == 0
    assert "the plan fits this machine" in capsys.readouterr().out


def test_model_flags_without_model_are_refused(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text("device: cpu\ndtype: fp32\n")
    assert cli_main(["plan", "--config", str(config), "--gpu-memory", "8GiB", "--seq", "64"]) == 2
    assert "--gpu-memory, --seq go with --model M" in capsys.readouterr().err


def test_check_script_cpu_path(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["plan_check.py", "--tiny", "--steps", "1", "--tolerance", "1000"])
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(ROOT / "examples" / "plan_check.py"), run_name="__main__")
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert re.search(r"tiny\s+[\d.]+\s+[\d.]+\s+[\d.]+", out), out


def test_on_a_gpu_machine_unstated_rates_are_measured_and_stated_ones_win(monkeypatch):
    """step_rates with a GPU here: the probes' figures where a rate is not stated, the flag's where it is."""
    import torch

    import runtime.bench.train_bound as train_bound
    import runtime.cli.plan as plan
    import runtime.update.rates as rates_module
    from runtime.config.loader import load_config
    from runtime.planning.auto_placement import Rates

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(rates_module, "measure_rates",
                        lambda device, **_: Rates(adam_params_per_s=3e9, h2d_bytes_per_s=50e9, d2h_bytes_per_s=48e9))
    monkeypatch.setattr(plan, "matmul_flops_per_s", lambda device: 700e12)
    monkeypatch.setattr(train_bound, "measure_gpu_adam_s_per_param", lambda numel, device: 1e-11)
    args = build_parser().parse_args(["plan", "--model", "llama-3-8b", "--pcie", "20"])
    got = plan.step_rates(args, load_config({}), gpu_here=True)
    assert (got.h2d_bytes_per_s, got.d2h_bytes_per_s) == (20e9, 20e9)  # stated
    assert got.cpu_adam_params_per_s == 3e9 and got.matmul_flops_per_s == 700e12  # measured
    assert got.gpu_adam_params_per_s == pytest.approx(1e11)
    assert set(got.measured) == {"cpu_adam", "gpu"}
    assert got.disk_read_bytes_per_s == plan.DEFAULT_DISK_GBPS * 1e9  # no --nvme: nothing to measure


def test_a_chunked_loss_lets_the_8b_scenario_fit_the_24_gib_card(capsys):
    """The 8B scenario (micro-batch 4 x 4096 tokens, 24 GiB): with HF's loss its 128k-vocabulary logits do not fit
    and the refusal names --loss-piece; planned with a chunked loss (Liger's, use_chunked_loss) it fits, as it
    trains (docs/benchmarks.md)."""
    work = ["plan", "--model", "llama-3-8b", "--seq", "4096", "--micro-batch", "4", "--accumulation", "16",
            "--gpu-memory", "24GiB", "--host-memory", "256GiB", *STATED]
    assert cli_main(work) == 1
    out = capsys.readouterr().out
    assert "does not fit: gpu:" in out and "--loss-piece 1024" in out
    assert cli_main([*work, "--loss-piece", "1024"]) == 0
    assert "the plan fits" in capsys.readouterr().out


def test_a_node_of_several_gpus_is_planned_rank_by_rank(capsys):
    """--nproc 2: each rank plans the blocks it owns with half the node's host memory; the node's totals are printed.
    Every rank's .grad holds the whole model's gradients where they accumulate on the device, so accumulate_on auto
    is decided from the whole model (an 8B's bf16 gradients, 16 GB, are more than a quarter of 24 GiB: host sums)."""
    code = cli_main(["plan", "--model", "llama-3-8b", "--seq", "4096", "--micro-batch", "1", "--accumulation", "8",
                     "--gpu-memory", "24GiB", "--host-memory", "256GiB", "--nproc", "2", "--loss-piece", "1024", *STATED])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "node: 2 GPUs, one rank each" in out and "no step time is predicted for several GPUs" in out
    assert "optimizer.accumulate_on: host" in out or "gradient sum buffers" in out, out
    # a quarter of the node's RAM is not enough for the rank that owns the most: refused, naming the rank
    code = cli_main(["plan", "--model", "llama-3-8b", "--seq", "4096", "--micro-batch", "1", "--accumulation", "8",
                     "--gpu-memory", "24GiB", "--host-memory", "64GiB", "--nproc", "4", "--loss-piece", "1024", *STATED])
    out = capsys.readouterr().out
    assert code == 1 and re.search(r"rank \d of 4", out), out
