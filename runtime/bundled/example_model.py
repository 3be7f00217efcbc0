"""The bundled example model: a small Llama-shaped decoder (RMSNorm, rotary attention, SwiGLU).

Built from sizes alone (no download); the same class, scaled up, is the benchmark model of docs/design.md
(hidden 2048, 24 layers, ffn 5504, vocab 32000).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class ModelShape:
    """Sizes of the decoder."""

    vocab_size: int = 256
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    ffn_size: int = 688
    max_seq_len: int = 1024
    tie_embeddings: bool = False

    @property
    def num_params(self) -> int:
        """Trainable parameters."""
        h, f, v = self.hidden_size, self.ffn_size, self.vocab_size
        per_layer = 4 * h * h + 3 * h * f + 2 * h
        return v * h * (1 if self.tie_embeddings else 2) + self.num_layers * per_layer + h


PRESETS: dict[str, ModelShape] = {
    "tiny": ModelShape(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, ffn_size=128, max_seq_len=256),
    "small": ModelShape(),
    "1.35b": ModelShape(vocab_size=32000, hidden_size=2048, num_layers=24, num_heads=16, ffn_size=5504, max_seq_len=2048),
}


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale."""

    def __init__(self, size: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


def rotary_tables(seq_len: int, head_dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of rotary position embedding, fp32."""
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of x's last dimension by position."""
    x1, x2 = x.float()[..., 0::2], x.float()[..., 1::2]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return out.to(x.dtype)


class DecoderLayer(nn.Module):
    """Pre-norm attention + SwiGLU feed-forward."""

    def __init__(self, shape: ModelShape):
        super().__init__()
        h = shape.hidden_size
        self.num_heads = shape.num_heads
        self.attn_norm = RMSNorm(h)
        self.qkv = nn.Linear(h, 3 * h, bias=False)
        self.out = nn.Linear(h, h, bias=False)
        self.mlp_norm = RMSNorm(h)
        self.gate_up = nn.Linear(h, 2 * shape.ffn_size, bias=False)
        self.down = nn.Linear(shape.ffn_size, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, t, 3, self.num_heads, h // self.num_heads).unbind(2)
        q, k = apply_rotary(q, cos[:t, None], sin[:t, None]), apply_rotary(k, cos[:t, None], sin[:t, None])
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.out(attn.transpose(1, 2).reshape(b, t, h))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class ExampleLM(nn.Module):
    """A decoder-only language model. ``forward(tokens, targets)`` returns the mean cross-entropy (fp32)."""

    def __init__(self, shape: ModelShape, activation_checkpointing: bool = False):
        super().__init__()
        self.shape = shape
        self.activation_checkpointing = activation_checkpointing
        self.embed = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(shape) for _ in range(shape.num_layers))
        self.norm = RMSNorm(shape.hidden_size)
        self.head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
        if shape.tie_embeddings:
            self.head.weight = self.embed.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Small normal init (std 0.02), ones for norms."""
        for p in self.parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        head_dim = self.shape.hidden_size // self.shape.num_heads
        cos, sin = rotary_tables(tokens.shape[1], head_dim, tokens.device)
        x = self.embed(tokens)
        for layer in self.layers:
            if self.activation_checkpointing and torch.is_grad_enabled():
                x = checkpoint(layer, x, cos, sin, use_reentrant=False)
            else:
                x = layer(x, cos, sin)
        logits = self.head(self.norm(x)).float()
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))
