"""runtime.cli.text_data: documents read from text and JSONL, packed with EOS between them, and batches in a shuffled
order that a checkpoint's (position, generator state) resumes exactly."""

from __future__ import annotations

import json

import pytest
import torch

from runtime.cli import text_data
from runtime.cli.text_data import PackedTokens, pack_tokens, read_documents


def test_a_text_file_is_one_document_and_a_jsonl_file_one_a_line(tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("first line\nsecond line\n")
    assert list(read_documents(text)) == [("first line\nsecond line\n", True)]
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text(json.dumps({"text": "one", "id": 1}) + "\n\n" + json.dumps({"content": "two"}) + "\n")
    assert list(read_documents(jsonl)) == [("one", True), ("two", True)]


def test_a_large_text_file_comes_in_pieces_cut_after_a_newline_and_stays_one_document(tmp_path, monkeypatch):
    monkeypatch.setattr(text_data, "TEXT_CHUNK_NBYTES", 10)
    text = tmp_path / "a.txt"
    text.write_text("0123456\n0123456\nend")
    assert list(read_documents(text)) == [("0123456\n0123456\n", False), ("end", True)]
    tokens = pack_tokens(read_documents(text), lambda texts: [[len(t)] for t in texts], eos_id=0)
    assert tokens.tolist() == [16, 3, 0]  # one end-of-sequence token: after the file


def test_documents_are_joined_with_the_eos_token():
    def encode(texts):
        return [[ord(ch) for ch in text] for text in texts]

    tokens = pack_tokens(iter([("ab", True), ("c", True)]), encode, eos_id=0)
    assert tokens.tolist() == [97, 98, 0, 99, 0]
    assert pack_tokens(iter([("ab", True)]), encode, eos_id=None).tolist() == [97, 98]
    many = [str(i % 10) for i in range(1000)]  # more documents than one call to the tokenizer takes
    assert pack_tokens(((d, True) for d in many), encode, eos_id=0).tolist() == [x for d in many for x in (ord(d), 0)]
    assert pack_tokens(iter([]), encode, eos_id=0).numel() == 0


def test_every_sequence_comes_once_an_epoch_in_a_new_order_each_epoch():
    data = PackedTokens(torch.arange(10 * 4), seq_len=4, batch_size=5, seed=0)
    epochs = [torch.cat([data.next(), data.next()])[:, 0].div(4).long().tolist() for _ in range(3)]
    assert all(sorted(epoch) == list(range(10)) for epoch in epochs)
    assert epochs[0] != epochs[1] != epochs[2]


@pytest.mark.parametrize("stop", [1, 2, 3, 5])  # mid-epoch, at an epoch's end, in a batch that crosses one
def test_a_stream_restored_from_position_and_generator_state_goes_on_as_the_uninterrupted_one(stop):
    whole = PackedTokens(torch.arange(7 * 3), seq_len=3, batch_size=3, seed=4)
    expected = [whole.next() for _ in range(8)]
    first = PackedTokens(torch.arange(7 * 3), seq_len=3, batch_size=3, seed=4)
    for _ in range(stop):
        first.next()
    resumed = PackedTokens(torch.arange(7 * 3), seq_len=3, batch_size=3, seed=99)  # what a checkpoint's load does:
    resumed.generator.set_state(first.generator.get_state())
    resumed.position = first.position
    for batch in expected[stop:]:
        assert torch.equal(resumed.next(), batch)


def test_tokens_past_the_last_whole_sequence_are_left_out_and_too_few_are_refused():
    assert PackedTokens(torch.arange(10), seq_len=4, batch_size=1).num_sequences == 2
    with pytest.raises(ValueError, match=r"the data holds 3 tokens, fewer than one sequence of --seq 4"):
        PackedTokens(torch.arange(3), seq_len=4, batch_size=1)
