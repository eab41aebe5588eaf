"""
The KV cache for generating text: each new token runs through the model alone, its query attending
to the keys and values of the positions before it, kept per layer, instead of the whole sequence
running again for every token. GPT.forward_cached takes one KVCache per layer;
picotron_like.sample uses it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class KVCache:
    """One layer's keys and values of the positions a sequence has so far, for generating text: the
    next token then runs through the model alone, its query attending to the keys kept here,
    instead of the whole sequence running again for every token (n tokens cost n positions of
    work, not n^2 / 2). Memory: 2 * n_kv_heads * head_dim * max_len elements per layer and
    sequence, allocated at the first append in the keys' own dtype, device and head count (a
    tensor-parallel rank's share of the heads too)."""

    def __init__(self, max_len: int):
        self.max_len, self.length = max_len, 0
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keep the new positions' k, v [b, kv_heads, s, d]; return those of every position so far."""
        if self.keys is None:
            self.keys = k.new_zeros(*k.shape[:2], self.max_len, k.shape[3])
            self.values = torch.zeros_like(self.keys)
        end = self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KVCache holds {self.max_len} positions; {end} were given")
        self.keys[:, :, self.length:end], self.values[:, :, self.length:end] = k, v
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """causal_attention for the last s = q.shape[2] of the P positions in k, v: query i sits at
    position P - s + i and sees the positions up to its own. SDPA's is_causal aligns the mask to
    the top left (query i sees keys 0..i), right only when s = P, so the mask is spelled out."""
    new, total = q.shape[2], k.shape[2]
    visible = torch.arange(total, device=q.device) <= torch.arange(total - new, total, device=q.device)[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=k.shape[1] != q.shape[1])

