"""The transformer blocks and attention masks the tiny models share (`dynabatch.pipeline.models.tiny`'s GPT and
T5, `dynabatch.pipeline.models.vlm`'s ViT and decoder): boolean masks from segment ids (one sample per row,
several per packed row, a packed row's ``cu_seqlens``), multi-head attention, the GELU feed-forward, the
pre-LayerNorm self-attention block, the causal GPT block and the summed next-token loss head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .contract import IGNORE_INDEX


def _eye(n: int, device) -> torch.Tensor:
    return torch.eye(n, dtype=torch.bool, device=device)


def packed_sequence_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Sequence id (0, 1, ...) of every packed token from ``cu_seqlens`` [n + 1]."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return torch.repeat_interleave(torch.arange(len(lengths), device=cu_seqlens.device), lengths, output_size=total)


def segment_ids(mask: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Sample number of every token of a [rows, L] batch (1, 2, ... within each row; 0 on padding).

    Without ``position_ids`` every row holds one sample (the attention mask as int64); with them a
    new sample starts wherever a real token has position 0 (packed rows)."""
    real = mask.bool()
    if position_ids is None:
        return real.long()
    return torch.cumsum(real & (position_ids == 0), dim=-1) * real


def _same_sample(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """[rows, 1, Lq, Lk]: query and key belong to the same sample and the key is not padding."""
    return (q[:, None, :, None] == k[:, None, None, :]) & (k[:, None, None, :] > 0)


def padded_self_mask(segments: torch.Tensor, causal: bool) -> torch.Tensor:
    """Boolean [rows, 1, L, L] mask (True = may attend) from [rows, L] `segment_ids` (a 0/1 padding
    mask is the one-sample-per-row case): a token sees the real tokens of its own sample. The
    diagonal is always allowed so a fully padded query row never softmaxes over nothing (NaN)."""
    L = segments.shape[1]
    seg = segments.long()
    allowed = _same_sample(seg, seg)
    if causal:
        allowed = allowed & torch.ones(L, L, dtype=torch.bool, device=seg.device).tril()
    return allowed | _eye(L, seg.device)


def cross_mask(query_segments: torch.Tensor, key_segments: torch.Tensor) -> torch.Tensor:
    """Boolean [rows, 1, T, L] cross-attention mask: a decoder token sees its own sample's encoder
    tokens. A query with no such key (padding) sees every key, so softmax never gets an empty row."""
    allowed = _same_sample(query_segments.long(), key_segments.long())
    return allowed | ~allowed.any(-1, keepdim=True)


def packed_self_mask(cu_seqlens: torch.Tensor, total: int, causal: bool) -> torch.Tensor:
    """Block-diagonal boolean [1, 1, N, N] mask of packed sequences (causal inside each block)."""
    seg = packed_sequence_ids(cu_seqlens, total)
    allowed = seg[:, None] == seg[None, :]
    if causal:
        allowed = allowed & torch.ones(total, total, dtype=torch.bool, device=seg.device).tril()
    return allowed[None, None]


class Attention(nn.Module):
    """Multi-head attention (self or cross) with a boolean mask."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden {hidden} is not divisible by heads {heads}")
        self.heads = heads
        self.q = nn.Linear(hidden, hidden)
        self.kv = nn.Linear(hidden, 2 * hidden)
        self.out = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, mem: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        r, n, h = x.shape
        m = mem.shape[1]
        q = self.q(x).view(r, n, self.heads, -1).transpose(1, 2)
        k, v = self.kv(mem).view(r, m, 2, self.heads, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        return self.out(y.transpose(1, 2).reshape(r, n, h))


class MLP(nn.Module):
    """Two-layer GELU feed-forward block."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.up = nn.Linear(hidden, ffn)
        self.down = nn.Linear(ffn, hidden)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class SelfAttentionBlock(nn.Module):
    """Pre-LayerNorm self-attention + feed-forward block (shared by the GPT and T5 encoder blocks)."""

    def __init__(self, hidden: int, heads: int, ffn: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads)
        self.ln2 = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden, ffn)

    def _block(self, h: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        x = self.ln1(h)
        h = h + self.attn(x, x, allowed)
        return h + self.mlp(self.ln2(h))


class GPTBlock(SelfAttentionBlock):
    """Pre-LayerNorm causal transformer block; passes masks through untouched."""

    def forward(self, state: tuple) -> tuple:
        h = state[0]
        if len(state) == 3:  # packed: (h, position_ids, cu_seqlens)
            allowed = packed_self_mask(state[2], h.shape[1], causal=True)
        else:
            allowed = padded_self_mask(state[1], causal=True)
        return (self._block(h, allowed), *state[1:])


class GPTHead(nn.Module):
    """Final LayerNorm, LM head and summed next-token cross-entropy.

    Labels follow Hugging Face's causal-LM convention: ``labels`` are aligned with ``input_ids`` and
    the model shifts them (position t predicts labels[t + 1]); -100 is ignored. For packed inputs a
    prediction across a sequence boundary (next position id 0) is ignored as well.
    """

    def __init__(self, hidden: int, vocab: int):
        super().__init__()
        self.ln = nn.LayerNorm(hidden)
        self.lm = nn.Linear(hidden, vocab)

    def forward(self, state: tuple, batch: dict):
        logits = self.lm(self.ln(state[0]))[:, :-1]
        target = batch["labels"][:, 1:].long()
        if len(state) == 3:
            target = target.masked_fill(state[1][:, 1:] == 0, IGNORE_INDEX)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1),
                               ignore_index=IGNORE_INDEX, reduction="sum")
        return loss, (target != IGNORE_INDEX).sum()


__all__ = ["Attention", "GPTBlock", "GPTHead", "MLP", "SelfAttentionBlock", "cross_mask", "packed_self_mask",
           "packed_sequence_ids", "padded_self_mask", "segment_ids"]
