"""The ``tierstore`` command: train, plan, profile, bench. The only module that prints (results for a person)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from dataclasses import asdict
from pathlib import Path

log = logging.getLogger(__name__)


def _size(text: str) -> int:
    from runtime.config.units import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_size(text: str) -> int:
    nbytes = _size(text)
    if nbytes <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a size above zero (e.g. 64MiB)")
    return nbytes


def _transfer_size(text: str) -> int:
    nbytes = _positive_size(text)
    if nbytes % 4096:  # the store's swap files move whole 4 KiB pages (O_DIRECT)
        raise argparse.ArgumentTypeError(f"{text!r}: a transfer is a whole number of 4 KiB pages (e.g. 4KiB, 64MiB)")
    return nbytes


def _at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: give 1 or more")
    return value


def _path(text: str) -> Path:
    if not text:  # Path("") is the current directory: a run would write its checkpoints or profile there
        raise argparse.ArgumentTypeError("an empty path; give a directory (`.` for the current one)")
    return Path(text)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = argparse.ArgumentParser(prog="tierstore", description="Offload training across GPU, pinned host memory and NVMe.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train the bundled example model, or a local HF model (--model DIR --data FILE), "
                                         "with offload")
    train.add_argument("--config", type=_path, metavar="FILE",
                       help="YAML config laid over the documented defaults (docs/config.md); default: those defaults "
                            "with all three tiers in use (the bundled example), or alone (--model)")
    train.add_argument("--model", type=_path, metavar="DIR",
                       help="fine-tune the HF causal LM in DIR (config.json, safetensors weights and the tokenizer, as "
                            "save_pretrained writes them; nothing is downloaded; needs pip install -e '.[hf]'), with "
                            "gradient checkpointing on and HF's own loss")
    train.add_argument("--data", type=_path, metavar="FILE",
                       help="with --model: the text to train on, a plain text file or JSONL (.jsonl: one object a line "
                            "with a 'text' or 'content' field), tokenized with DIR's tokenizer and packed to --seq")
    train.add_argument("--output", type=_path, metavar="DIR",
                       help="with --model: save the trained model and tokenizer to DIR at the end (from_pretrained "
                            "loads it)")
    train.add_argument("--steps", type=int, metavar="N", help="optimizer steps (overrides train.steps)")
    train.add_argument("--seq", type=_at_least_one, metavar="N", help="tokens per sequence (overrides train.seq_len)")
    train.add_argument("--micro-batch", type=_at_least_one, metavar="N",
                       help="sequences per micro-batch (overrides train.batch_size)")
    train.add_argument("--accumulation", type=_at_least_one, metavar="N",
                       help="micro-batches per optimizer step (overrides optimizer.accumulation_steps)")
    train.add_argument("--lr", type=float, help="learning rate (overrides optimizer.lr)")
    train.add_argument("--profile", type=_path, metavar="DIR", help="write a swap-traffic profile to DIR")
    train.add_argument("--checkpoint-dir", type=_path, metavar="DIR", help="save checkpoints under DIR")
    train.add_argument("--save-every", type=int, metavar="N", help="save a checkpoint every N steps")
    train.add_argument("--resume", action="store_true", help="resume from the latest checkpoint in --checkpoint-dir")
    train.add_argument("--nproc", type=_at_least_one, metavar="N",
                       help="train as N processes of this host (one per GPU; without CUDA, N processes over gloo), with "
                            "DDP's result: each micro-batch (--micro-batch, a multiple of N) is split between them and "
                            "each block's training state lives in one of them (docs/design.md, several GPUs)")
    train.add_argument("--overwrite", action="store_true",
                       help="let this run replace and prune checkpoints already in --checkpoint-dir (without it, "
                            "a directory holding another run's checkpoints is refused), and replace a model already "
                            "in --output")

    from runtime.cli.plan import add_arguments as add_plan_arguments

    plan = sub.add_parser("plan", help="where each kind of state goes and whether it fits; with --model, any HF causal "
                                       "LM and a predicted step time",
                          description="The memory plan of --config's example model, or of --model M with a predicted "
                                      "step time and tokens/s; refuses a plan that does not fit, saying what to change.")
    add_plan_arguments(plan, _size, _path, _at_least_one)

    profile = sub.add_parser("profile", help="report of a saved profile")
    profile.add_argument("dir", type=_path)
    profile.add_argument("--plot", action="store_true", help="also draw DIR/plot.png from the saved summary (needs matplotlib)")

    bench = sub.add_parser("bench", help="benchmarks (store bandwidth; training against baselines)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    store = bench_sub.add_parser("store", help="store bandwidth on each path vs the raw ceiling, same run")
    store.add_argument("--nvme-dir", help="directory for the NVMe paths ('tmp' for a temporary one; omit to skip)")
    store.add_argument("--total", type=_positive_size, default=1 << 30, help="bytes per path (default 1GiB)")
    store.add_argument("--transfer", type=_transfer_size, default=64 << 20,
                       help="bytes per transfer, whole 4 KiB pages (default 64MiB)")
    store.add_argument("--repeats", type=_at_least_one, default=3, help="timed repeats per path; the best is kept")
    store.add_argument("--io-threads", type=_at_least_one, default=4, help="swap files read and written at once")
    store.add_argument("--json", type=_path, help="also write the results as JSON here")
    store.add_argument("--disk-sweep", action="store_true",
                       help="instead, the disk's read / write GB/s over IOs in flight (1, 2, 4, 8, 16) and IO sizes (8, 64MiB) in "
                            "--nvme-dir, to choose tiers.nvme.io_threads and tiers.nvme.block_size (--total bytes a "
                            "point, at least two IOs a thread; --repeats; --json)")

    btrain = bench_sub.add_parser("train", help="training step time against each row's bound and the baselines")
    _bench_train_arguments(btrain)
    return parser


def _bench_train_arguments(btrain: argparse.ArgumentParser) -> None:
    """``tierstore bench train``'s options: rows, the model's shape (``--preset`` then explicit sizes), output."""
    from runtime.bench.train_model import MICRO_BATCH, MODEL_KINDS, SEQ_LEN

    btrain.add_argument("--rows", default="all",
                        help="comma-separated rows to run, each a base row (torch, host, gpu-weights, nvme, nvme-auto, "
                             "host-accum8, torch-accum8, ds-zero2-cpu, ds-zero3-cpu, ds-zero3-nvme) with suffixes: "
                             "-clip and -ckpt on any row; tierstore rows also -fNN -sNN -aN -tNN -keep -auto -cap -noseg "
                             "-nopace -rc -norc -bf16m -int8m "
                             "(runtime/bench/train_rows.py); default: every base row")
    btrain.add_argument("--steps", type=int, default=6, help="optimizer steps per row; the first third is warm-up (at least the "
                                                  "steps auto placement measured, two with a recompute trial)")
    btrain.add_argument("--nvme-dir", help="directory for the NVMe rows' swap files and the disk ceiling "
                                           "(default: a temporary one, and T_nvme is not measured)")
    btrain.add_argument("--json", type=_path, help="also write rows, rates and bounds as JSON here")
    btrain.add_argument("--gpu-cap", type=_size, metavar="SIZE",
                        help="GPU memory of the -cap rows (e.g. 24GiB: what a run would do on a card that size); "
                             "default: the peak the first ds-zero2-cpu row without -ckpt reserved in the same call")
    shape = btrain.add_argument_group("model shape", "defaults from --preset; every row trains the same model")
    shape.add_argument("--preset", default="1.35b", help="starting shape (tiny, small, 1.35b; default 1.35b)")
    shape.add_argument("--model", choices=MODEL_KINDS, default="example",
                       help="example: the bundled ExampleLM; hf-llama: transformers' LlamaForCausalLM built from the "
                            "shape (random init, SDPA attention, nothing downloaded)")
    shape.add_argument("--hidden", type=int, help="hidden size")
    shape.add_argument("--layers", type=int, help="decoder layers")
    shape.add_argument("--heads", type=int, help="attention heads")
    shape.add_argument("--kv-heads", type=int, help="key/value heads (grouped-query attention; default --heads; "
                                                    "fewer needs --model hf-llama)")
    shape.add_argument("--ffn", type=int, help="feed-forward (intermediate) size")
    shape.add_argument("--vocab", type=int, help="vocabulary size")
    shape.add_argument("--tied", action=argparse.BooleanOptionalAction, help="tie the output head to the embedding")
    shape.add_argument("--seq", type=int, help=f"sequence length (default {SEQ_LEN})")
    shape.add_argument("--micro-batch", type=int, help=f"sequences per micro-batch (default {MICRO_BATCH})")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``tierstore`` console script."""
    args = build_parser().parse_args(argv)
    if args.command == "train" and (args.nproc or 1) > 1 and "RANK" not in os.environ:
        from runtime.cli.launch import launch  # the launcher itself: each rank it starts runs the lines below

        return launch(sys.argv[1:] if argv is None else argv, args.nproc)
    handler = logging.StreamHandler()
    handler.setFormatter((logging.Formatter if args.verbose else _NoTracebacks)("%(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, handlers=[handler])
    from runtime.core.signals import Terminated, handle_signals

    try:
        if args.command == "bench" and args.bench_command == "store":
            leave = handle_signals()  # SIGTERM raises Terminated: the bench's swap files go on the way out
            try:
                return _bench_store(args)
            finally:
                leave()
        if args.command == "bench" and args.bench_command == "train":
            from runtime.bench.train_bench import main as bench_train_main

            return bench_train_main(args)
        if args.command == "train":
            from runtime.cli.train import main as train_main

            # For the whole command, not only offload()'s session: a SIGTERM while the checkpoint root is held
            # before offload() or after close() ends as one inside (the root's lock removed, status 143).
            leave = handle_signals()
            try:
                return train_main(args)
            finally:
                leave()
        if args.command == "plan":
            return _plan(args)
        if args.command == "profile":
            from runtime.profiler import main as profile_main

            return profile_main(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Terminated as exc:  # SIGTERM: runtime.core.signals turned it into an exception so cleanup ran
        if args.command == "train":
            print(f"tierstore: {exc}: the step in progress was abandoned and the swap files removed; checkpoints "
                  "already saved are complete (--resume goes on from the latest)", file=sys.stderr)
        else:
            print(f"tierstore: {exc}: stopped, its swap files removed", file=sys.stderr)
        return int(exc.code)  # type: ignore[arg-type]
    except Exception as exc:  # a person reads this: one line, then the details at debug level
        from runtime.core.user_errors import user_message

        message = user_message(exc)
        if message is None:  # a bug: the traceback is what a report needs
            raise
        log.debug("details", exc_info=True)
        print(f"tierstore: error: {message}", file=sys.stderr)
        return 2
    return 1


class _NoTracebacks(logging.Formatter):
    """Log lines without tracebacks (they come with --verbose): a run that stops says why once, in one message."""

    def formatException(self, ei: object) -> str:  # noqa: N802 (logging's name)
        return ""


def _plan(args: argparse.Namespace) -> int:
    """``tierstore plan``: ``runtime.cli.plan``."""
    from runtime.cli.plan import main as plan_main

    return plan_main(args)


def _bench_store(args: argparse.Namespace) -> int:
    import torch

    if args.disk_sweep:
        from runtime.bench.disk_sweep import disk_sweep, format_disk_sweep

        if args.nvme_dir in (None, "tmp"):
            raise ValueError("--disk-sweep measures the disk of --nvme-dir: give the directory the swap files will use")
        points = disk_sweep(args.nvme_dir, total_nbytes=args.total, repeats=args.repeats)
        print(format_disk_sweep(points, args.nvme_dir))
        if args.json:
            args.json.write_text(json.dumps({"directory": args.nvme_dir, "disk_sweep": [asdict(p) for p in points]},
                                            indent=2))
        return 0

    from runtime.bench.store_bench import SingleStream, format_store_table, run_store_bench

    single: list[SingleStream] = []
    results = run_store_bench(args.nvme_dir, args.total, args.transfer, args.repeats, args.io_threads, single_stream=single)
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (no CUDA)"
    print(format_store_table(results, name, single[0] if single else None))
    if args.json:
        data: dict[str, object] = {"device": name, "results": [r.as_dict() for r in results]}
        if single:
            data["single_stream"] = single[0].as_dict()  # a reference, not a ceiling: outside "results"
        args.json.write_text(json.dumps(data, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
