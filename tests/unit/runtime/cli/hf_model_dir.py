"""A tiny local HF model directory for ``tierstore train --model`` tests, made offline: a LlamaForCausalLM built
from a config, saved with ``save_pretrained``, and a byte-level BPE tokenizer trained here with ``tokenizers``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

# A few KB of text: the tokenizer is trained on it and the model on it.
TEXT = "\n".join(
    f"Line {i}: the quick brown fox jumps over the lazy dog, and the dog sleeps in the sun while the fox runs "
    f"{'north' if i % 3 == 0 else 'south' if i % 3 == 1 else 'home'} again." for i in range(120)) + "\n"
EOS = "<|end|>"


def make_model_dir(directory: Path, *, tied: bool = False, seed: int = 0) -> Path:
    """A LlamaForCausalLM of two small layers and its tokenizer, saved to ``directory``."""
    pytest.importorskip("transformers")  # the [test] extra has it; a bare install skips these tests
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(TEXT.splitlines(), trainers.BpeTrainer(
        vocab_size=320, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS)
    config = LlamaConfig(vocab_size=len(fast), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=tied, eos_token_id=fast.eos_token_id)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(directory)
    fast.save_pretrained(directory)
    return directory


def write_jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    """``texts`` as JSON Lines, one ``{field: text}`` object a line."""
    path.write_text("".join(json.dumps({field: text}) + "\n" for text in texts))
    return path
