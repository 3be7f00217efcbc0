"""Named model shapes ``tierstore plan --model`` knows without a download: public config values of well-known HF
causal LMs, written here as small dicts.

Owns: the shapes and their HF config keys (``hf_config``). Leaves out: building the model (the CLI does it with
transformers, on the meta device) and anything else a checkpoint's ``config.json`` holds that does not change the
parameter count or the step's work (dropout, initialiser ranges, token ids).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class NamedShape:
    """The shape of a published causal LM: what its parameter count and a step's work depend on."""

    model_type: str  # HF's model_type: llama, qwen2, mistral
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied: bool
    rope_theta: float
    max_positions: int

    def hf_config(self) -> dict[str, Any]:
        """The keys of the HF config (``AutoConfig.for_model(model_type, **keys)``)."""
        return {"hidden_size": self.hidden, "num_hidden_layers": self.layers, "num_attention_heads": self.heads,
                "num_key_value_heads": self.kv_heads, "intermediate_size": self.ffn, "vocab_size": self.vocab,
                "tie_word_embeddings": self.tied, "rope_theta": self.rope_theta,
                "max_position_embeddings": self.max_positions, "use_cache": False}


SHAPES: dict[str, NamedShape] = {
    "llama-3.2-1b": NamedShape("llama", 2048, 16, 32, 8, 8192, 128256, True, 500000.0, 131072),
    "llama-3.2-3b": NamedShape("llama", 3072, 28, 24, 8, 8192, 128256, True, 500000.0, 131072),
    "llama-3-8b": NamedShape("llama", 4096, 32, 32, 8, 14336, 128256, False, 500000.0, 8192),
    "llama-3-70b": NamedShape("llama", 8192, 80, 64, 8, 28672, 128256, False, 500000.0, 8192),
    "qwen2.5-7b": NamedShape("qwen2", 3584, 28, 28, 4, 18944, 152064, False, 1000000.0, 32768),
    "qwen2.5-14b": NamedShape("qwen2", 5120, 48, 40, 8, 13824, 152064, False, 1000000.0, 32768),
    "qwen2.5-32b": NamedShape("qwen2", 5120, 64, 40, 8, 27648, 152064, False, 1000000.0, 32768),
    "mistral-7b": NamedShape("mistral", 4096, 32, 32, 8, 14336, 32768, False, 1000000.0, 32768),  # v0.3
}


def named_shape(name: str) -> NamedShape:
    """The shape called ``name`` (case-insensitive); a KeyError listing the known names otherwise."""
    try:
        return SHAPES[name.lower()]
    except KeyError:
        raise KeyError(f"{name!r} is neither a directory holding config.json nor a known shape; known shapes: "
                       f"{', '.join(SHAPES)}") from None
