"""``tierstore train --model DIR --data FILE``: fine-tune a local Hugging Face causal LM on a local text file.

Owns: checking DIR (``config.json``, safetensors weights, a tokenizer), building the model on the meta device and
filling it block by block from the safetensors files as ``offload`` copies it into the store (``SafetensorsInit``;
the whole model never sits in host memory at once), the tokenizer, the ``TrainJob`` (HF's own loss through
``model(input_ids=..., labels=...)``, gradient checkpointing on) and ``--output`` (``session.save_pretrained`` and
the tokenizer). Leaves out: the loop, checkpoints and the config (``runtime.cli.train``), reading and packing FILE
(``runtime.cli.text_data``). Nothing is downloaded: every HF call passes ``local_files_only=True``.
"""

from __future__ import annotations

import json
import logging
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from runtime.cli.job import TrainJob
from runtime.cli.text_data import PackedTokens, check_data_file, pack_tokens, read_documents
from runtime.config.loader import TierstoreConfig
from runtime.core.text import counted

log = logging.getLogger(__name__)

INSTALL = "pip install -e '.[hf]'"
SINGLE_WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
OUTPUT_WEIGHTS = ("*.safetensors", WEIGHTS_INDEX, "pytorch_model*.bin", "pytorch_model.bin.index.json")


def require_transformers() -> Any:
    """The ``transformers`` module, or a ValueError naming the install command (the ``hf`` extra)."""
    try:
        import accelerate  # noqa: F401  (init_empty_weights: the model is built on the meta device)
        import safetensors  # noqa: F401
        import transformers
    except ImportError as exc:
        raise ValueError(f"tierstore train --model needs transformers, accelerate and safetensors ({exc.name} is "
                         f"missing): {INSTALL}") from None
    return transformers


def check_model_dir(directory: Path) -> None:
    """Refuse DIR when it is not a local HF model directory, naming what is missing and how to make it."""
    made_by = "an HF model directory (config.json, safetensors weights, a tokenizer), as save_pretrained writes it"
    if not directory.is_dir():
        raise FileNotFoundError(f"--model {directory}: no such directory; give {made_by}")
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"--model {directory}: no config.json there; give {made_by} "
                                "(model.save_pretrained(DIR) writes config.json)")
    if not weight_files(directory):
        other = sorted(p.name for p in directory.glob("pytorch_model*.bin"))
        hint = (f" ({', '.join(other)} is PyTorch pickle: load it with from_pretrained and save it again with "
                "save_pretrained(DIR), which writes safetensors)") if other else ""
        raise FileNotFoundError(f"--model {directory}: no safetensors weights there ({SINGLE_WEIGHTS} or "
                                f"{WEIGHTS_INDEX}, as model.save_pretrained(DIR) writes them){hint}")
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(f"--model {directory}: no tokenizer there ({', '.join(TOKENIZER_FILES)}): save the "
                                "model's tokenizer to the same directory (tokenizer.save_pretrained(DIR))")


def weight_files(directory: Path) -> dict[str, Path]:
    """Each tensor name in DIR's safetensors weights and the file holding it (empty: none there)."""
    index = directory / WEIGHTS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{index}: not a safetensors index (its weight_map unreadable: {exc!r}); save the model "
                             "again with save_pretrained(DIR)") from None
        return {name: directory / file for name, file in weight_map.items()}
    single = directory / SINGLE_WEIGHTS
    if not single.is_file():
        return {}
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as file:
        return dict.fromkeys(file.keys(), single)


class SafetensorsInit:
    """``offload``'s ``init``: fills a parameter in place from DIR's safetensors files (cast to its dtype), one at a
    time as its block is copied into the store. ``name_in_file`` maps a parameter's name to the file's."""

    def __init__(self, files: dict[str, Path], name_in_file: dict[str, str]):
        self.files = files
        self.name_in_file = name_in_file
        self._open: dict[Path, Any] = {}

    def __call__(self, name: str, tensor: torch.Tensor) -> None:
        """Fill ``tensor``, the parameter (or buffer) called ``name``, from the file."""
        key = self.name_in_file[name]
        value = self._file(self.files[key]).get_tensor(key)
        if value.shape != tensor.shape:
            raise ValueError(f"{self.files[key]}: {key} has shape {tuple(value.shape)}, the model built from "
                             f"config.json wants {tuple(tensor.shape)} for {name}: the weights and config.json "
                             "disagree")
        tensor.copy_(value)

    def _file(self, path: Path) -> Any:
        if path not in self._open:
            from safetensors import safe_open

            self._open[path] = safe_open(str(path), framework="pt")
        return self._open[path]

    def close(self) -> None:
        """Let go of the files (every block is filled)."""
        self._open.clear()


def match_names(model: nn.Module, keys: set[str]) -> dict[str, str] | None:
    """The file's name of each of the model's parameters and persistent buffers: the same name, or the name
    without the model's ``base_model_prefix`` (a checkpoint of the bare model); None when one has neither."""
    prefix = getattr(model, "base_model_prefix", "")
    wanted = [name for name, _ in model.named_parameters()] + _persistent_buffers(model)
    found: dict[str, str] = {}
    for name in wanted:
        bare = name.removeprefix(f"{prefix}.") if prefix else name
        key = name if name in keys else bare if bare in keys else None
        if key is None:
            log.info("%s is not in the weights under that name: the model is loaded whole by from_pretrained", name)
            return None
        found[name] = key
    return found


def _persistent_buffers(model: nn.Module) -> list[str]:
    parameters = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    return [name for name in model.state_dict() if name not in parameters]


def load_model(directory: Path) -> tuple[Any, SafetensorsInit | None]:
    """DIR's causal LM (an HF ``PreTrainedModel``) in fp32, the masters' dtype, with gradient checkpointing on, and the
    ``init`` that fills it.

    Built on the meta device from config.json and filled block by block by the returned ``init``, when the weights'
    names are the model's. Otherwise (a checkpoint whose names HF converts as it loads) the whole model is loaded
    on the CPU by ``from_pretrained`` first, and ``init`` is None: only from_pretrained knows those conversions."""
    transformers = require_transformers()
    from accelerate import init_empty_weights

    config = transformers.AutoConfig.from_pretrained(str(directory), local_files_only=True)
    files = weight_files(directory)
    with init_empty_weights(include_buffers=False):  # rotary tables are buffers computed in __init__: keep them real
        model = transformers.AutoModelForCausalLM.from_config(config)
    # init_empty_weights wraps each parameter as it is set, so a tie made inside (lm_head.weight = the embedding's)
    # came out as two parameters; tied again here, they are one (and the file holds it once).
    model.tie_weights()
    names = match_names(model, set(files))
    init: SafetensorsInit | None = None
    if names is None:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), local_files_only=True)
    else:
        init = SafetensorsInit(files, names)
        with torch.no_grad():
            for name in _persistent_buffers(model):  # small, and not offloaded: read now
                init(name, model.get_buffer(name))
    model = model.float()  # fp32 parameters: the masters start from the file's values exactly
    with warnings.catch_warnings():  # newer transformers renamed it; this name works from 4.35 on
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train(), init


def load_tokenizer(directory: Path) -> Any:
    """DIR's tokenizer (``AutoTokenizer``, local files only)."""
    transformers = require_transformers()
    try:
        return transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except Exception as exc:  # transformers raises OSError, ValueError, TypeError or KeyError for a broken tokenizer
        raise ValueError(f"--model {directory}: its tokenizer does not load ({type(exc).__name__}: {exc}); save the "
                         "model's tokenizer there with tokenizer.save_pretrained(DIR)") from exc


def tokenize(data: Path, tokenizer: Any, vocab_size: int) -> torch.Tensor:
    """FILE's documents tokenized with the model's tokenizer, the end-of-sequence token between them."""
    eos = tokenizer.eos_token_id
    if eos is None:
        log.warning("the tokenizer has no eos_token: documents are joined with nothing between them")

    def encode(texts: list[str]) -> list[list[int]]:
        return [list(ids) for ids in tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]]

    tokens = pack_tokens(read_documents(data), encode, eos)
    if tokens.numel() == 0:
        raise ValueError(f"--data {data}: no text in it; give a file with the text to train on")
    if int(tokens.max()) >= vocab_size:
        raise ValueError(f"the tokenizer gives token id {int(tokens.max())}, past the model's vocab_size {vocab_size} "
                         "(config.json): the tokenizer is not this model's")
    return tokens


def check_output(output: Path, model_dir: Path, overwrite: bool) -> None:
    """Refuse ``--output`` where weights already are (the model's own directory, another model), unless
    ``overwrite``: then the old weight files go just before the new ones are written (``clear_weights``), since
    from_pretrained reads a stale ``model.safetensors`` before a new index."""
    if output.resolve() == model_dir.resolve():
        raise ValueError(f"--output {output} is the --model directory: write the fine-tuned model to another one")
    if output.exists() and not output.is_dir():
        raise NotADirectoryError(f"--output {output}: not a directory; give a new or empty directory")
    found = sorted({path.name for pattern in OUTPUT_WEIGHTS for path in output.glob(pattern)}) if output.is_dir() else []
    if found and not overwrite:
        raise ValueError(f"--output {output} already holds a model ({', '.join(found[:3])}): give a new directory, "
                         "or add --overwrite to replace it")


def clear_weights(output: Path) -> None:
    """Remove the weight files of a model already in ``output`` (``--overwrite``)."""
    for pattern in OUTPUT_WEIGHTS:
        for path in output.glob(pattern):
            if path.is_file():
                log.info("--overwrite: removing %s", path)
                path.unlink()


def check_hf_inputs(args: Any) -> None:
    """The quick checks of ``--model``, ``--data`` and ``--output``, made before anything is built or written."""
    require_transformers()
    check_model_dir(args.model)
    if args.data is None:
        raise ValueError("tierstore train --model DIR needs --data FILE (a local text or JSONL file to train on)")
    check_data_file(args.data)
    if args.output is not None:
        check_output(args.output, args.model, args.overwrite)


def hf_job(args: Any, cfg: TierstoreConfig) -> TrainJob:
    """The run ``tierstore train --model DIR --data FILE`` asks for (``check_hf_inputs`` passed): FILE tokenized and
    packed to ``train.seq_len``, DIR's model ready to offload, and ``--output`` written at the end."""
    directory: Path = args.model
    tokenizer = load_tokenizer(directory)
    model, init = load_model(directory)
    vocab_size = model.get_input_embeddings().num_embeddings
    tokens = tokenize(args.data, tokenizer, vocab_size)
    data = PackedTokens(tokens, cfg.train.seq_len, cfg.train.batch_size, seed=cfg.seed)
    print(f"data: {args.data}: {counted(tokens.numel(), 'token')}, {counted(data.num_sequences, 'sequence')} of "
          f"{cfg.train.seq_len}; model: {directory} ({type(model).__name__}, gradient checkpointing on)",
          file=sys.stderr)
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and cfg.train.seq_len > limit:
        log.warning("--seq %d is longer than the model's max_position_embeddings %d (config.json)",
                    cfg.train.seq_len, limit)
    use_cache = getattr(model.config, "use_cache", None)
    model.config.use_cache = False  # no KV cache in training (HF turns it off under checkpointing anyway)

    def loss(module: nn.Module, batch: torch.Tensor, device: torch.device) -> torch.Tensor:
        ids = batch.to(device, non_blocking=True)
        return module(input_ids=ids, labels=ids).loss

    def finish(session: Any) -> None:
        if args.output is None:
            return
        ranks = session.ranks
        writes = ranks is None or ranks.rank == 0  # several processes: every rank reads, rank 0 writes the files
        if args.overwrite and writes:
            clear_weights(args.output)
        model.config.use_cache = use_cache  # the saved config is for inference, as the model's own was
        session.save_pretrained(args.output)  # (collective: every rank returns once rank 0 wrote the weights)
        if writes:
            tokenizer.save_pretrained(str(args.output))
            print(f"model and tokenizer written to {args.output}; load them with "
                  f"AutoModelForCausalLM.from_pretrained({str(args.output)!r})", file=sys.stderr)

    return TrainJob(model, data, loss, init=init, after_offload=init.close if init is not None else None,
                    finish=finish)
