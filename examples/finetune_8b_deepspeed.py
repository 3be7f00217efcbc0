"""The DeepSpeed baseline of the workstation scenario (issue 15): ``examples/finetune_8b.py``'s model, data, loss,
batch and limits under DeepSpeed ZeRO-3 with parameters and optimizer offloaded.

Same work as the tierstore script: HF ``LlamaForCausalLM`` of the given shape (default Llama-3-8B), built under
``deepspeed.zero.Init`` (parameters partitioned into pinned CPU memory as they are made; random init), bf16,
fp32 master weights and AdamW (lr, weight decay 0.01, betas and eps as tierstore's defaults), activation
checkpointing, the loss taken a piece of the sequence at a time (``PiecewiseLossLM``), gradient accumulation to
``--global-batch`` sequences, clipping 1.0, the process's GPU memory capped at ``--gpu-cap``. The weights keep
torch's default initialisation (``zero.Init`` partitions each module as it is built, before HF's init would run
on it), not the tierstore script's seeded normal one: the work and the memory are the same, the losses are not
comparable.

Placement: ``--offload cpu`` (parameters and optimizer in pinned host memory: ZeRO-Offload/Infinity's fastest
form) or ``--offload nvme`` (optimizer state on NVMe under ``--nvme-dir`` with tuned aio: 8 MiB blocks, queue
depth 8, 8 threads, 8 buffers; the pipelined swapper stays off, DeepSpeed 0.19.8's fails
``assert new_alloc_buffers is not None``). DeepSpeed has no host budget of its own, so the limit is enforced
from outside: a watchdog stops the run, naming the phase, when the process's resident memory passes
``--rss-limit`` (default 107 GiB: the peak RSS of the tierstore run under its 100 GiB budget on the H100 box,
2026-11-26). The run ends with a line saying whether it trained, and why not.

    python examples/finetune_8b_deepspeed.py --steps 2                      # Llama-3-8B (needs the GPU machine)
    python examples/finetune_8b_deepspeed.py --layers 20 --steps 2          # a shape DeepSpeed fits in the limit

Needs the ``deepspeed`` extra and a CUDA device; exit status 0 when it trained with finite loss, 3 when the
watchdog stopped it.
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import sys
import threading
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from finetune_8b import add_scenario_args, check_scenario_args, for_training, llama_config  # noqa: E402  (the scenario's own definitions)

from runtime.bundled.data import ByteBatches, stdlib_text_bytes  # noqa: E402
from runtime.config.units import approx_size, parse_size  # noqa: E402

WATCHDOG_EXIT = 3


class RssWatchdog:
    """Polls the process's resident memory; past ``limit_nbytes`` it calls ``on_exceeded(rss, phase)`` once (the
    script's: print and exit). ``phase`` is what the run was doing, set by the training code."""

    def __init__(self, limit_nbytes: int, on_exceeded: Callable[[int, str], None], interval_s: float = 0.2,
                 rss: Callable[[], int] | None = None):
        import psutil

        self.limit_nbytes = limit_nbytes
        self.phase = "starting"
        self.peak_nbytes = 0
        self._rss = rss or (lambda: psutil.Process().memory_info().rss)
        self._on_exceeded = on_exceeded
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-watchdog", daemon=True)

    def start(self) -> RssWatchdog:
        """Start polling in a daemon thread."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop polling (the thread ends within one interval)."""
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            rss = self._rss()
            self.peak_nbytes = max(self.peak_nbytes, rss)
            if rss > self.limit_nbytes:
                self._on_exceeded(rss, self.phase)
                return


def ds_config(args: argparse.Namespace, accumulation: int) -> dict:
    """ZeRO-3 with parameters on the CPU and the optimizer on the CPU or NVMe; large buckets (the GPU has room
    for them under the cap) so the fetches and reductions move big pieces."""
    offload_optimizer: dict = {"device": "cpu", "pin_memory": True}
    config: dict = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": accumulation,
                    "bf16": {"enabled": True}, "gradient_clipping": 1.0, "steps_per_print": 10**9,
                    "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.01,
                                                              "betas": [0.9, 0.999], "eps": 1e-8}}}
    if args.offload == "nvme":
        offload_optimizer = {"device": "nvme", "nvme_path": args.nvme_dir, "pin_memory": True, "buffer_count": 8,
                             "pipeline_read": False, "pipeline_write": False}
        config["aio"] = {"block_size": 8 << 20, "queue_depth": 8, "thread_count": 8, "single_submit": False,
                         "overlap_events": True}
    config["zero_optimization"] = {
        "stage": 3, "offload_param": {"device": "cpu", "pin_memory": True}, "offload_optimizer": offload_optimizer,
        "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": int(2e8),
        "stage3_prefetch_bucket_size": int(2e8), "stage3_param_persistence_threshold": int(1e6),
        "stage3_max_live_parameters": int(1e9), "stage3_max_reuse_distance": int(1e9),
        # The optimizer steps a sub-group at a time; on NVMe each of the 8 swap buffers holds one, so 1e9
        # would pin 8 x 4 GB of buffers: 1e8 keeps them at 3.2 GB.
        "sub_group_size": int(1e8 if args.offload == "nvme" else 1e9)}
    return config


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line: the tierstore script's shape and work flags, DeepSpeed's placement and the RSS limit."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_scenario_args(parser)
    parser.add_argument("--rss-limit", default="107GiB", help="stop when the process's resident memory passes this")
    parser.add_argument("--offload", choices=("cpu", "nvme"), default="cpu")
    parser.add_argument("--nvme-dir", default="/var/tmp/ds-8b", help="optimizer swap directory (--offload nvme)")
    args = parser.parse_args(argv)
    check_scenario_args(parser, args)
    args.rss_limit = parse_size(args.rss_limit)
    return args


def _single_process_env() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)}.items():
        os.environ.setdefault(key, value)


def main(argv: list[str] | None = None) -> int:
    """Build, initialize and train under the watchdog; 0 when the loss stayed finite."""
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("DeepSpeed's offload baseline needs a CUDA device", file=sys.stderr)
        return 2
    torch.cuda.set_per_process_memory_fraction(min(1.0, args.gpu_cap / torch.cuda.get_device_properties(0).total_memory))
    _single_process_env()
    import deepspeed
    from transformers import LlamaForCausalLM

    def exceeded(rss: int, phase: str) -> None:
        print(f"\nDeepSpeed ZeRO-3 (offload {args.offload}) does not run under the limit: resident memory "
              f"{approx_size(rss)} passed --rss-limit {approx_size(args.rss_limit)} while {phase}", file=sys.stderr,
              flush=True)
        os._exit(WATCHDOG_EXIT)

    watchdog = RssWatchdog(args.rss_limit, exceeded).start()
    accumulation = args.global_batch // args.micro_batch
    config = ds_config(args, accumulation)
    start = time.perf_counter()
    watchdog.phase = "building the model under deepspeed.zero.Init"
    with deepspeed.zero.Init(config_dict_or_path=config, remote_device="cpu", pin_memory=True):
        model = for_training(LlamaForCausalLM(llama_config(args)), args)
    num_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    print(f"model: {num_params:,} parameters; DeepSpeed ZeRO-3, parameters on cpu, optimizer on {args.offload}; "
          f"sequence {args.seq}, {args.global_batch} sequences per step in micro-batches of {args.micro_batch}; "
          f"GPU cap {approx_size(args.gpu_cap)}, RSS limit {approx_size(args.rss_limit)}", file=sys.stderr)
    watchdog.phase = "deepspeed.initialize (fp32 master and optimizer state)"
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    print(f"setup {time.perf_counter() - start:.1f} s, RSS {approx_size(watchdog.peak_nbytes)}", file=sys.stderr)
    data = ByteBatches(stdlib_text_bytes(1 << 24), batch_size=args.micro_batch, seq_len=args.seq, seed=0)
    losses: list[float] = []
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        total = torch.zeros((), device="cuda")
        for micro in range(1, accumulation + 1):
            watchdog.phase = f"step {step}, micro-batch {micro}"
            tokens, _ = data.next()
            tokens = tokens.cuda()
            loss = engine(tokens) if args.loss_piece else engine(input_ids=tokens, labels=tokens).loss
            engine.backward(loss)
            engine.step()  # DeepSpeed updates at the accumulation boundary only
            total += loss.detach()
            print(f"\rstep {step}/{args.steps}: micro-batch {micro}/{accumulation}", end="", file=sys.stderr, flush=True)
        losses.append(total.item() / accumulation)
        seconds = time.perf_counter() - t0
        tokens_per_s = args.global_batch * args.seq / seconds
        print(f"\rstep {step}/{args.steps}: loss {losses[-1]:.4f}, {seconds:.1f} s, {tokens_per_s:,.0f} tokens/s, "
              f"{6 * num_params * tokens_per_s / 1e12:.1f} model TFLOP/s, peak GPU "
              f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB, peak RSS "
              f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.1f} GiB, grad norm "
              f"{engine.get_global_grad_norm()}", file=sys.stderr, flush=True)
    watchdog.stop()
    ok = all(torch.isfinite(torch.tensor(losses)))
    print(f"DeepSpeed trained {args.steps} steps: loss {losses[0]:.4f} -> {losses[-1]:.4f} "
          f"({'finite' if ok else 'NOT finite'})", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
