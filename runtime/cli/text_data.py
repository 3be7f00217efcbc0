"""A user's text for ``tierstore train --model DIR --data FILE``: documents read, tokenized, packed, shuffled.

Owns: reading FILE (plain text, or JSON Lines with a ``text`` or ``content`` field), joining the tokenized
documents with the end-of-sequence token between them, cutting the stream into sequences of ``seq_len`` tokens,
and ``PackedTokens``: micro-batches of those sequences in an order shuffled from a torch generator, resumable exactly
(``runtime.checkpoint.state.ResumableData``). Leaves out: the tokenizer itself (the caller passes its ``encode``),
the model and the loss. A plain sequence of ``seq_len`` tokens is a causal LM's input and its labels (the model
shifts them), so nothing here makes targets.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from runtime.core.text import counted

log = logging.getLogger(__name__)

JSONL_SUFFIXES = (".jsonl", ".ndjson")
TEXT_FIELDS = ("text", "content")  # a JSONL record's document: the first of these it has
TEXT_CHUNK_NBYTES = 1 << 20  # a plain text file is tokenized a piece of about this size at a time

ENCODE_BATCH = 256  # documents given to the tokenizer at once

EncodeBatch = Callable[[list[str]], list[list[int]]]


def check_data_file(path: Path) -> None:
    """Refuse a ``--data`` path that is no file, saying what to give."""
    if not path.is_file():
        raise FileNotFoundError(f"--data {path}: no such file; give a local text file or a JSONL file "
                                f"(one object a line with a {' or '.join(map(repr, TEXT_FIELDS))} field)")


def read_documents(path: Path) -> Iterator[tuple[str, bool]]:
    """FILE's documents in order, as (text, whether a document ends there): a ``.jsonl`` / ``.ndjson`` file holds
    one JSON object a line whose ``text`` (or ``content``) field is a document (blank lines skipped); any other file
    is plain UTF-8 text, one document.

    A plain text file comes in pieces of about ``TEXT_CHUNK_NBYTES`` cut after a newline, so a large file is never
    tokenized in one call; it stays one document (only its last piece ends it)."""
    check_data_file(path)
    if path.suffix.lower() in JSONL_SUFFIXES:
        yield from ((document, True) for document in _jsonl_documents(path))
        return
    with open(path, encoding="utf-8", errors="replace") as file:
        piece: list[str] = []
        size = 0
        started = False
        for line in file:
            piece.append(line)
            size += len(line)
            if size >= TEXT_CHUNK_NBYTES:
                yield "".join(piece), False
                piece, size, started = [], 0, True
        if piece or started:  # an empty file holds no document
            yield "".join(piece), True


def _jsonl_documents(path: Path) -> Iterator[str]:
    with open(path, encoding="utf-8") as file:
        for number, line in enumerate(file, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not a JSON object ({exc.msg}); a {path.suffix} file holds one "
                                 "JSON object a line (rename it to .txt to train on it as plain text)") from None
            field = next((name for name in TEXT_FIELDS if isinstance(record, dict) and name in record), None)
            if field is None or not isinstance(record[field], str):
                found = ", ".join(map(repr, record)) if isinstance(record, dict) else type(record).__name__
                raise ValueError(f"{path}:{number}: no text field: each line needs a string "
                                 f"{' or '.join(map(repr, TEXT_FIELDS))} field (this one has {found or 'none'})")
            yield record[field]


def pack_tokens(documents: Iterator[tuple[str, bool]], encode: EncodeBatch, eos_id: int | None) -> torch.Tensor:
    """The documents' tokens end to end, ``eos_id`` after each one (None: nothing between them), as int32 (half the
    memory of int64 for a large corpus; ``PackedTokens`` hands out int64). ``encode`` takes documents
    ``ENCODE_BATCH`` at a time: a fast tokenizer encodes a list in parallel."""
    pieces: list[torch.Tensor] = []
    batch: list[tuple[str, bool]] = []

    def flush() -> None:
        if not batch:
            return
        for ids, (_, ends) in zip(encode([text for text, _ in batch]), batch, strict=True):
            pieces.append(torch.tensor(ids + ([eos_id] if ends and eos_id is not None else []), dtype=torch.int32))
        batch.clear()

    for document in documents:
        batch.append(document)
        if len(batch) >= ENCODE_BATCH:
            flush()
    flush()
    return torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.int32)


class PackedTokens:
    """Micro-batches ``[batch_size, seq_len]`` of a token stream cut into sequences, shuffled an epoch at a time.

    The order of each epoch is a permutation drawn from ``generator``, whose state always is the one the current
    epoch's permutation comes from (it moves on when an epoch ends). So ``position`` (batches drawn) and the
    generator's state are the whole stream's state: a checkpoint restores both and the batches go on as they would
    have (``runtime.checkpoint.state.ResumableData``). Tokens past the last whole sequence are left out."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, batch_size: int, seed: int = 0):
        num_sequences = tokens.numel() // seq_len
        if num_sequences < 1:
            raise ValueError(f"the data holds {counted(tokens.numel(), 'token')}, fewer than one sequence of --seq "
                             f"{seq_len}: give more text, or a smaller --seq (train.seq_len)")
        self.sequences = tokens[: num_sequences * seq_len].reshape(num_sequences, seq_len)
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.generator = torch.Generator().manual_seed(seed)
        self.position = 0
        self._order: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (state drawn from, order, state after)

    @property
    def num_sequences(self) -> int:
        """Sequences in one epoch."""
        return int(self.sequences.shape[0])

    def next(self) -> torch.Tensor:
        """The next micro-batch: token ids ``[batch_size, seq_len]``, int64 on the CPU."""
        rows = []
        for index in range(self.position * self.batch_size, (self.position + 1) * self.batch_size):
            offset = index % self.num_sequences
            rows.append(self.sequences[self._epoch_order()[offset]])
            if offset == self.num_sequences - 1:  # the epoch is over: the next one is drawn from the state after it
                self.generator.set_state(self._after())
        self.position += 1
        return torch.stack(rows).long()

    def _epoch_order(self) -> torch.Tensor:
        # Read from the generator's state, not cached by epoch: a checkpoint's load sets the state from outside.
        state = self.generator.get_state()
        if self._order is None or not torch.equal(self._order[0], state):
            draw = torch.Generator()
            draw.set_state(state)
            order = torch.randperm(self.num_sequences, generator=draw)
            self._order = (state, order, draw.get_state())
        return self._order[1]

    def _after(self) -> torch.Tensor:
        self._epoch_order()
        assert self._order is not None
        return self._order[2]
