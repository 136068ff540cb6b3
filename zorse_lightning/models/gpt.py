"""A small GPT written as any Lightning user would write it (nothing zorse-specific).

Token and position embeddings, a ``nn.ModuleList`` of pre-LayerNorm transformer
blocks, a final LayerNorm and a head whose weight is the token embedding (tied,
as in GPT-2). The strategy must train it unchanged, pipelined or not.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from zorse_lightning.models.next_token import NextTokenModel


class CausalSelfAttention(nn.Module):
    """Multi-head causal attention with separate query, key and value projections, reading its heads from the
    width of what they return: split column-wise over a tensor-parallel group (:data:`GPT.tp_plan`), each rank
    computes its own heads whole. (Until 2026-11-28 one fused ``qkv`` projection, whose column-wise split would
    have mixed queries with keys; checkpoints with ``qkv`` still load, see :meth:`_load_from_state_dict`.)"""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"width={width} must be a multiple of heads={heads}")
        self.heads = heads
        self.head_width = width // heads
        self.q = nn.Linear(width, width)
        self.k = nn.Linear(width, width)
        self.v = nn.Linear(width, width)
        self.proj = nn.Linear(width, width)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, _ = x.shape
        q, k, v = (p(x).view(batch, time, -1, self.head_width).transpose(1, 2) for p in (self.q, self.k, self.v))
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
        return self.proj(y.transpose(1, 2).reshape(batch, time, -1))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        """A state dict of the fused ``qkv`` projection loads as its query, key and value thirds."""
        for kind in ("weight", "bias"):
            fused = state_dict.pop(f"{prefix}qkv.{kind}", None)
            if fused is not None:
                for name, part in zip("qkv", fused.chunk(3, dim=0)):
                    state_dict[f"{prefix}{name}.{kind}"] = part
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class Block(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads, dropout)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(NextTokenModel):
    tp_plan = {
        "blocks.*.attn.q": "colwise", "blocks.*.attn.k": "colwise", "blocks.*.attn.v": "colwise",
        "blocks.*.attn.proj": "rowwise", "blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise",
    }
    """How a block splits over a tensor-parallel group (:mod:`zorse_lightning.module.tensor_parallel`), in
    Hugging Face's notation: each rank computes some heads and some of the MLP's width whole, and the two
    row-wise projections sum the group's parts (two all-reduces a block forward, two backward)."""

    def __init__(
        self,
        vocab_size: int = 256,
        seq_len: int = 64,
        width: int = 128,
        layers: int = 4,
        heads: int = 4,
        dropout: float = 0.0,
        learning_rate: float = 3e-4,
        weight_decay: float = 0.1,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.tok_emb = nn.Embedding(vocab_size, width)
        self.pos_emb = nn.Embedding(seq_len, width)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(width, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        for name, param in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                # GPT-2: scale residual projections by depth so activations do not grow with it.
                nn.init.normal_(param, std=0.02 / math.sqrt(2 * layers))

    def initialize_submodule(self, name: str, module: nn.Module) -> None:
        """The same rules for one submodule, as a model built on the meta device is initialised (one stream
        per submodule: see ``zorse_lightning.module.materialize``); the values differ from an eager build's."""
        self._init_weights(module)
        if isinstance(module, nn.Linear) and (name.endswith("proj") or name.endswith("mlp.2")):
            nn.init.normal_(module.weight, std=0.02 / math.sqrt(2 * self.hparams.layers))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        return torch.optim.AdamW(
            [{"params": decay, "weight_decay": self.hparams.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=self.hparams.learning_rate,
        )
