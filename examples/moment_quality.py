"""Training quality of compact Adam moments on real text (issue 43): the same HF Llama, data, seed and
hyper-parameters under tierstore with each ``optimizer.moment_dtype``, beside plain PyTorch AdamW and the two
GPU-side 8-bit AdamWs users run (bitsandbytes, torchao).

Every row starts from the same weights (built once from ``--seed``, copied into each row), draws the same batches
(``ByteBatches`` of the bundled standard-library text, seeded) and follows the same schedule: AdamW, ``--lr`` after a
linear warm-up of ``--warmup`` steps then constant (a ``LambdaLR`` on every row's optimizer, as ``tierstore train``
builds its own), the same betas, eps and weight decay (on every parameter), global-norm clipping ``--clip``. The last
``--held-out`` share of the corpus is never trained on: the held-out loss is the mean over ``--eval-batches`` fixed
batches drawn from it, every ``--eval-every`` steps and at the end. The loss is the mean cross-entropy of the next
byte (vocabulary 256), computed in fp32 from the logits.

Rows (``--rows``, a comma list):
  ts-fp32, ts-bf16, ts-int8   tierstore ``offload`` with ``dtype: bf16`` and that ``optimizer.moment_dtype``; on a
                              GPU everything resident there (``placement.weights: gpu``, ``gpu_update_fraction: 1.0``:
                              the device runs the same ``adamw_update_block`` as the CPU), the moments checked once a
                              run to be stored compactly on the device (on a CPU, its memory); ``--host``: the
                              default host placement with every update on the CPU (a shorter run on a CPU).
  torch-fp32                  the plain model in fp32 under ``torch.autocast(bfloat16)``, ``torch.optim.AdamW``.
  bnb-8bit                    the same with ``bitsandbytes.optim.AdamW8bit``.
  torchao-8bit                the same with ``torchao.optim.AdamW8bit``.
A row whose package is missing or which fails records the error and the others still run (exit status 1).

    python examples/moment_quality.py --json out/quality.json --plot out/quality.png        # all rows, 1,000 steps
    python examples/moment_quality.py --rows ts-int8 --json out/quality.json                 # add a row to the file
    python examples/moment_quality.py --plot-only --json out/quality.json --plot q.png       # redraw

Needs transformers; matplotlib for ``--plot`` (optional).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import math
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from runtime import offload
from runtime.bundled.data import ByteBatches, stdlib_text_bytes
from runtime.update.moments import moment_nbytes
from tierstore import TierName

log = logging.getLogger("moment_quality")

TIERSTORE_ROWS = {"ts-fp32": "fp32", "ts-bf16": "bf16", "ts-int8": "int8"}
PLAIN_ROWS = ("torch-fp32", "bnb-8bit", "torchao-8bit")
ROWS = (*TIERSTORE_ROWS, *PLAIN_ROWS)
VOCAB = 256  # the corpus is bytes
SMOOTH_STEPS = 20  # the plot's running mean of the training loss

Batch = tuple[torch.Tensor, torch.Tensor]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (every flag has its help)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma list of rows to run, of: {', '.join(ROWS)}")
    parser.add_argument("--steps", type=int, default=1000, help="optimizer steps per row (default 1000)")
    parser.add_argument("--hidden", type=int, default=1536, help="hidden size (default 1536: ~0.5B parameters)")
    parser.add_argument("--layers", type=int, default=20, help="decoder layers (default 20)")
    parser.add_argument("--heads", type=int, default=12, help="attention heads (default 12)")
    parser.add_argument("--kv-heads", type=int, default=4, help="key/value heads (default 4)")
    parser.add_argument("--ffn", type=int, default=4096, help="MLP intermediate size (default 4096)")
    parser.add_argument("--seq", type=int, default=512, help="sequence length in bytes (default 512)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    parser.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (default 3e-4)")
    parser.add_argument("--warmup", type=int, default=50, help="steps of linear warm-up, then constant (default 50)")
    parser.add_argument("--beta1", type=float, default=0.9, help="Adam beta1 (default 0.9)")
    parser.add_argument("--beta2", type=float, default=0.95, help="Adam beta2 (default 0.95)")
    parser.add_argument("--eps", type=float, default=1e-8, help="Adam eps (default 1e-8)")
    parser.add_argument("--weight-decay", type=float, default=0.1, help="decoupled weight decay (default 0.1)")
    parser.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip on every row (default 1.0)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial weights and of the batches (default 0)")
    parser.add_argument("--eval-every", type=int, default=100, help="held-out evaluation every N steps (default 100)")
    parser.add_argument("--eval-batches", type=int, default=16, help="fixed held-out batches per evaluation (default 16)")
    parser.add_argument("--held-out", type=float, default=0.05,
                        help="share of the corpus at its end kept out of training for evaluation (default 0.05)")
    parser.add_argument("--corpus-bytes", type=int, default=32 << 20,
                        help="bytes of the bundled standard-library text to use (default 32 MiB)")
    parser.add_argument("--host", action="store_true",
                        help="tierstore rows with the default host placement and every update on the CPU "
                             "(gpu_update_fraction and gpu_stream_fraction 0) instead of all on the compute device")
    parser.add_argument("--moment-kernel", default="auto", choices=("auto", "torch", "compiled"),
                        help="tierstore's optimizer.moment_kernel on the int8 row: how the CPU updates int8 moments (with --host; "
                             "updates on the device always use torch ops) (default auto)")
    parser.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"),
                        help="compute device (default auto: cuda if available)")
    parser.add_argument("--json", default=None, help="results file; rows are merged into an existing one")
    parser.add_argument("--plot", default=None, help="draw the loss curves from --json into this image (matplotlib)")
    parser.add_argument("--plot-only", action="store_true", help="no training: redraw --plot from --json")
    args = parser.parse_args(argv)
    args.row_list = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in args.row_list if r not in ROWS]
    if unknown or not args.row_list:
        parser.error(f"unknown row(s) {', '.join(unknown) or '(none given)'}; valid rows: {', '.join(ROWS)}")
    if args.plot_only and not (args.json and args.plot):
        parser.error("--plot-only needs --json (the results) and --plot (the image)")
    if not 0.0 < args.held_out < 1.0:
        parser.error(f"--held-out {args.held_out}: a share strictly between 0 and 1")
    return args


@dataclass
class Setup:
    """What every row shares: the device, the initial weights, the corpus split and the held-out batches."""

    device: torch.device
    initial: dict[str, torch.Tensor]
    num_params: int
    train_text: bytes
    eval_batches: list[Batch]


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    """An HF ``LlamaForCausalLM`` of the command line's shape, fp32 on the CPU (no download, random init)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=args.hidden, intermediate_size=args.ffn,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=max(args.seq, 128),
                         tie_word_embeddings=False, use_cache=False,
                         attn_implementation="sdpa")  # type: ignore[call-arg]  # 5.x's typed __init__ omits it
    return LlamaForCausalLM(config)


def make_setup(args: argparse.Namespace) -> Setup:
    """The shared starting point: weights seeded once (each row loads a copy), the corpus split once."""
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(args.seed)
    model = build_model(args)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    num_params = sum(p.numel() for p in model.parameters())
    corpus = stdlib_text_bytes(args.corpus_bytes)
    cut = int(len(corpus) * (1.0 - args.held_out))
    held = ByteBatches(corpus[cut:], args.batch, args.seq, seed=args.seed + 1)
    eval_batches = [held.next() for _ in range(args.eval_batches)]
    log.info("model: %s parameters; corpus %d bytes, %d trained on, %d held out", f"{num_params:,}", len(corpus), cut,
             len(corpus) - cut)
    return Setup(device, initial, num_params, corpus[:cut], eval_batches)


def fresh_model(args: argparse.Namespace, setup: Setup) -> torch.nn.Module:
    """The model with the shared initial weights, fp32 on the CPU."""
    model = build_model(args)
    model.load_state_dict(setup.initial)
    return model


def next_byte_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the next byte, in fp32 from the logits (the same on every row)."""
    logits = model(input_ids=x).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


def warmup_factor(warmup: int) -> Callable[[int], float]:
    """The schedule of every row: linear warm-up over ``warmup`` steps, then constant (``tierstore train``'s
    ``lr_scheduler`` with ``lr_schedule: constant``)."""
    return lambda step: (step + 1) / warmup if step < warmup else 1.0


@dataclass
class Row:
    """One row's model and optimizer, how to run its forward, and what to check once trained."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    autocast: bool  # plain rows: fp32 weights under bf16 autocast; tierstore computes in bf16 itself
    clip: Callable[[], None]  # the row's gradient clip before step() (tierstore clips at the commit itself)
    check: Callable[[], dict[str, Any]]  # after training: facts to record (and raise if something is wrong)
    session: Any = None  # tierstore rows: the offload session, closed when the row ends


def adamw_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The hyper-parameters every plain row's AdamW gets."""
    return {"lr": args.lr, "betas": (args.beta1, args.beta2), "eps": args.eps, "weight_decay": args.weight_decay}


def plain_optimizer(name: str, params: list[torch.nn.Parameter], args: argparse.Namespace) -> torch.optim.Optimizer:
    """The plain row's optimizer; the 8-bit packages are imported here, so a missing one fails only its row."""
    if name == "bnb-8bit":
        import bitsandbytes  # type: ignore[import-not-found,import-untyped,unused-ignore]

        return bitsandbytes.optim.AdamW8bit(params, **adamw_kwargs(args))
    if name == "torchao-8bit":
        from torchao.optim import AdamW8bit  # type: ignore[import-not-found,import-untyped,unused-ignore]

        return AdamW8bit(params, **adamw_kwargs(args))
    return torch.optim.AdamW(params, **adamw_kwargs(args))


def plain_row(name: str, args: argparse.Namespace, setup: Setup) -> Row:
    """A plain PyTorch row: the fp32 model on the device, its optimizer, clip_grad_norm_ before each step."""
    model = fresh_model(args, setup).to(setup.device)
    params = list(model.parameters())
    optimizer = plain_optimizer(name, params, args)

    def clip() -> None:
        torch.nn.utils.clip_grad_norm_(params, args.clip)

    return Row(model, optimizer, True, clip, dict)


def tierstore_config(moment_dtype: str, args: argparse.Namespace, setup: Setup) -> dict[str, Any]:
    """tierstore's config for a row: bf16 compute, the row's moment_dtype, all on the GPU unless ``--host``."""
    optimizer: dict[str, Any] = {"lr": args.lr, "betas": [args.beta1, args.beta2], "eps": args.eps,
                                 "weight_decay": args.weight_decay, "grad_clip": args.clip,
                                 "moment_dtype": moment_dtype}
    if moment_dtype != "fp32":  # (the key is refused beside fp32, which has no compiled kernel)
        optimizer["moment_kernel"] = args.moment_kernel
    config: dict[str, Any] = {"device": setup.device.type, "dtype": "bf16", "seed": args.seed, "optimizer": optimizer}
    if resident(args, setup):
        config["placement"] = {"weights": "gpu"}
        optimizer.update(gpu_update_fraction=1.0, gpu_stream_fraction=0.0)
    else:
        optimizer.update(gpu_update_fraction=0.0, gpu_stream_fraction=0.0)
    return config


def resident(args: argparse.Namespace, setup: Setup) -> bool:
    """Whether the tierstore rows keep everything on the compute device (else the host placement, AdamW on the CPU).
    On the CPU both run: the device's update path runs there too (its tier is then the CPU's memory)."""
    return not args.host


def tierstore_row(moment_dtype: str, args: argparse.Namespace, setup: Setup) -> Row:
    """A tierstore row: ``offload`` of the fresh model; the check reads the store's records of the moments."""
    model, optimizer = offload(fresh_model(args, setup), tierstore_config(moment_dtype, args, setup))
    session = optimizer.session  # type: ignore[attr-defined]  # (offload sets it)
    on_gpu = resident(args, setup)

    def check() -> dict[str, Any]:
        """The moments are stored in the row's format (the record's bytes), on the GPU when resident."""
        blocks = session.blocks
        homes: set[TierName] = set()
        for block in blocks:
            expected = moment_nbytes(moment_dtype, [s.numel for s in block.slots])
            for kind in ("exp_avg", "exp_avg_sq"):
                record = session.store.record(block.key(kind))
                if record.meta.nbytes != expected:
                    raise AssertionError(f"block {block.index} {kind}: {record.meta.nbytes} bytes stored, "
                                         f"{expected} expected for {moment_dtype} moments")
                homes.add(record.home)
        updated = len(session.controller.gpu_updated)
        names = sorted(str(home.value) for home in homes)
        if on_gpu and (updated != len(blocks) or homes != {TierName.GPU}):
            raise AssertionError(f"not resident: {updated} of {len(blocks)} blocks updated on the GPU, moments in {names}")
        return {"moment_homes": names, "gpu_updated_blocks": updated, "blocks": len(blocks)}

    return Row(model, optimizer, False, lambda: None, check, session)


def evaluate(row: Row, setup: Setup) -> float:
    """Mean loss over the fixed held-out batches (no gradient)."""
    row.model.eval()
    total = 0.0
    with torch.no_grad(), autocast(row, setup):
        for x, y in setup.eval_batches:
            total += next_byte_loss(row.model, x.to(setup.device), y.to(setup.device)).item()
    row.model.train()
    return total / len(setup.eval_batches)


def autocast(row: Row, setup: Setup) -> contextlib.AbstractContextManager[Any]:
    """bf16 autocast for the plain rows, nothing for tierstore's (it computes in bf16 already)."""
    if row.autocast:
        return torch.autocast(setup.device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def train_row(name: str, args: argparse.Namespace, setup: Setup) -> dict[str, Any]:
    """Train one row from the shared start; its record (the error text in ``error`` if it failed)."""
    record: dict[str, Any] = {
        "name": name, "steps": args.steps, "num_params": setup.num_params, "device": setup.device.type,
        "shape": {"hidden": args.hidden, "layers": args.layers, "heads": args.heads, "kv_heads": args.kv_heads,
                  "ffn": args.ffn, "vocab": VOCAB, "seq": args.seq, "batch": args.batch},
        "hypers": {"lr": args.lr, "warmup": args.warmup, "betas": [args.beta1, args.beta2], "eps": args.eps,
                   "weight_decay": args.weight_decay, "clip": args.clip, "seed": args.seed},
        "placement": ("device" if resident(args, setup) else "host") if name in TIERSTORE_ROWS else "plain",
        "train_loss": [], "eval": [], "final_eval_loss": None, "seconds_per_step": None, "peak_gpu_bytes": None,
        "error": None}
    gc.collect()  # the previous row's model and optimizer state go before this row's peak is measured
    if setup.device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    try:
        with _row(name, args, setup) as row:
            _train(row, args, setup, record)
            record.update(row.check())
    except Exception as exc:  # a row's failure (a missing package, an OOM) is its record; the others still run
        log.exception("row %s failed", name)
        record["error"] = f"{type(exc).__name__}: {exc}"
    if setup.device.type == "cuda":
        record["peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
    return record


@contextlib.contextmanager
def _row(name: str, args: argparse.Namespace, setup: Setup) -> Iterator[Row]:
    """The row built, and its session closed afterwards (tierstore rows)."""
    if name in TIERSTORE_ROWS:
        row = tierstore_row(TIERSTORE_ROWS[name], args, setup)
        with row.session:
            yield row
    else:
        yield plain_row(name, args, setup)


def _train(row: Row, args: argparse.Namespace, setup: Setup, record: dict[str, Any]) -> None:
    """``args.steps`` steps with the per-step train loss, periodic held-out loss and the time per step."""
    scheduler = torch.optim.lr_scheduler.LambdaLR(row.optimizer, warmup_factor(args.warmup))
    batches = ByteBatches(setup.train_text, args.batch, args.seq, seed=args.seed)
    step_s: list[float] = []
    record["eval"].append([0, evaluate(row, setup)])  # the shared start: the same on every row
    for step in range(1, args.steps + 1):
        x, y = batches.next()
        start = time.perf_counter()
        with autocast(row, setup):
            loss = next_byte_loss(row.model, x.to(setup.device), y.to(setup.device))
        loss.backward()
        row.clip()
        row.optimizer.step()
        row.optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        value = loss.item()  # (waits for the step's compute: the time below is the step's)
        step_s.append(time.perf_counter() - start)
        if not math.isfinite(value):
            raise FloatingPointError(f"training loss {value} at step {step}")
        record["train_loss"].append(value)
        if step % args.eval_every == 0 or step == args.steps:
            record["eval"].append([step, evaluate(row, setup)])
            log.info("%s step %d: train %.4f, held-out %.4f, %.3f s/step", record["name"], step, value,
                     record["eval"][-1][1], sum(step_s[1:]) / max(1, len(step_s) - 1))
    record["final_eval_loss"] = record["eval"][-1][1]
    # The first step is left out: it builds kernels and caches (tierstore's measures the machine too).
    record["first_step_s"] = step_s[0]
    record["seconds_per_step"] = sum(step_s[1:]) / (len(step_s) - 1) if len(step_s) > 1 else step_s[0]


def merge_json(path: Path, records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Rows of an existing results file, with this run's rows put in (replacing ones of the same name)."""
    rows: dict[str, dict[str, Any]] = {}
    if path.exists():
        rows = json.loads(path.read_text()).get("rows", {})
    rows.update({r["name"]: r for r in records})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"rows": rows}, indent=1))
    return rows


def table(rows: dict[str, dict[str, Any]]) -> str:
    """Row, final held-out loss, its ratio to ts-fp32 and to torch-fp32, s/step, peak GPU memory, error."""
    def ratio(record: dict[str, Any], base: str) -> str:
        ref = rows.get(base, {}).get("final_eval_loss")
        ours = record.get("final_eval_loss")
        return f"{ours / ref:.4f}" if ours is not None and ref else "-"

    lines = [f"{'row':<14}{'held-out loss':>14}{'/ ts-fp32':>11}{'/ torch-fp32':>14}{'s/step':>9}{'peak GPU':>11}  error"]
    for name in sorted(rows, key=lambda n: ROWS.index(n) if n in ROWS else len(ROWS)):
        r = rows[name]
        loss = r.get("final_eval_loss")
        peak = r.get("peak_gpu_bytes")
        lines.append(f"{name:<14}{'-' if loss is None else f'{loss:.4f}':>14}{ratio(r, 'ts-fp32'):>11}"
                     f"{ratio(r, 'torch-fp32'):>14}"
                     f"{'-' if r.get('seconds_per_step') is None else format(r['seconds_per_step'], '.3f'):>9}"
                     f"{'-' if peak is None else f'{peak / 2**30:.1f} GiB':>11}  {r.get('error') or ''}")
    return "\n".join(lines)


def plot(rows: dict[str, dict[str, Any]], path: str) -> bool:
    """The loss curves: training loss (a running mean of SMOOTH_STEPS steps), the held-out points, and those as a
    ratio to ts-fp32's; one colour a row. False, with a message, where matplotlib is not installed."""
    try:
        import matplotlib  # type: ignore[import-not-found,import-untyped,unused-ignore]

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # type: ignore[import-not-found,import-untyped,unused-ignore]
    except ImportError:
        print(f"--plot {path}: matplotlib is not installed (pip install matplotlib); the JSON has the curves",
              file=sys.stderr)
        return False
    fig, (train_ax, eval_ax, ratio_ax) = plt.subplots(1, 3, figsize=(18, 5))
    base = rows.get("ts-fp32", {}).get("eval") or []
    for name, r in rows.items():
        losses = r.get("train_loss") or []
        if not losses:
            continue
        smooth = [sum(losses[max(0, i - SMOOTH_STEPS + 1):i + 1]) / (i + 1 - max(0, i - SMOOTH_STEPS + 1))
                  for i in range(len(losses))]
        (line,) = train_ax.plot(range(1, len(losses) + 1), smooth, label=name, linewidth=1.2)
        points = r.get("eval") or []
        eval_ax.plot([p[0] for p in points], [p[1] for p in points], "o-", color=line.get_color(), label=name,
                     markersize=3)
        ratios = [(p[0], p[1] / b[1]) for p, b in zip(points, base, strict=False) if p[0] == b[0]]
        ratio_ax.plot([p[0] for p in ratios], [p[1] for p in ratios], "o-", color=line.get_color(), label=name,
                      markersize=3)
    first = next(iter(rows.values()))
    shape = first.get("shape", {})
    num_params = first.get("num_params", 0)
    size = f"{num_params / 1e9:.2f}B" if num_params >= 1e9 else f"{num_params / 1e6:.1f}M"
    title = (f"{size}-parameter Llama (hidden {shape.get('hidden')}, "
             f"{shape.get('layers')} layers), seq {shape.get('seq')} x batch {shape.get('batch')}")
    train_ax.set(title=f"train loss ({SMOOTH_STEPS}-step mean)", xlabel="step", ylabel="loss (nats/byte)")
    eval_ax.set(title="held-out loss", xlabel="step", ylabel="loss (nats/byte)")
    ratio_ax.set(title="held-out loss / ts-fp32's", xlabel="step", ylabel="ratio")
    for ax in (train_ax, eval_ax, ratio_ax):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    """Run the rows (or only redraw); 0 when every row of this run trained (and a plot asked for was drawn)."""
    args = parse_args(argv)
    # tierstore's own INFO (each row's plan) would bury the rows' progress; its warnings stay
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    log.setLevel(logging.INFO)
    if args.plot_only:
        rows = json.loads(Path(args.json).read_text())["rows"]
        print(table(rows))
        return 0 if plot(rows, args.plot) else 1
    setup = make_setup(args)
    records = []
    for name in args.row_list:
        log.info("row %s: %d steps on %s", name, args.steps, setup.device)
        records.append(train_row(name, args, setup))
        if args.json:  # after each row: a run cut short (a time limit) keeps the rows it finished
            merge_json(Path(args.json), records[-1:])
    rows = merge_json(Path(args.json), []) if args.json else {r["name"]: r for r in records}
    print(table(rows))
    failed = [r["name"] for r in records if r["error"]]
    if args.plot:
        plot(rows, args.plot)
    if failed:
        print(f"rows that failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
