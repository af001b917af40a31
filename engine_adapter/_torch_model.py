"""The torch executor's model: a small Llama-like decoder (RMSNorm, RoPE, GQA attention, SwiGLU) with seeded
random weights, and the attention kernels it runs over gathered KV.

The decoder does not know about paging: ``Decoder.forward`` hands each layer's queries, keys and values to
an ``attend`` callback, which the executor (``_torch_executor``) implements over its block tables and the
reference path implements as a plain causal attention, so both share every other op.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right

__all__ = [
    "DTYPES",
    "MODEL_VERSION",
    "AttendFn",
    "Decoder",
    "TorchModelConfig",
    "attention",
    "decode_attention",
]

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}
# Bump when the architecture or weight init changes: old KV bytes would no longer match the weights.
MODEL_VERSION = "hintflow-torch-llama-v1"

AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class TorchModelConfig:
    """Everything that determines the weights and the KV layout (and hence the fingerprint)."""

    vocab_size: int = 512
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    max_model_len: int = 4096
    block_size: int = 16
    dtype: str = "float32"
    seed: int = 0
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError("hidden_size must divide by num_heads, and num_heads by num_kv_heads")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even for rotary embeddings")
        if (
            min(self.vocab_size, self.num_layers, self.intermediate_size, self.max_model_len, self.block_size)
            < 1
        ):
            raise ValueError("sizes must be positive")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm in float32 so low-precision dtypes don't lose the normalisation."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offset: int | None) -> torch.Tensor:
    """GQA attention of q ``[n, H, d]`` over k/v ``[c, KVH, d]``.

    Paged path (``q_offset`` given, ``c == q_offset + n``): query i sits at position ``q_offset + i`` and
    sees keys ``<=`` that position, i.e. a causal mask aligned to the bottom-right corner, which SDPA's
    fused kernels (FlashAttention) run without materializing it.  Reference path (``q_offset=None``):
    SDPA's top-left causal mask over the whole sequence, with no paging in between.

    SDPA takes its fused kernels only for 4-D inputs: 3-D ones ran the math kernel, which materializes
    the n x c scores (on an H200, 55 ms per layer for an 8k prefill; on this repo's 2-core CPU 9x slower
    than the fused one).  The KV heads are repeated rather than passed with ``enable_gqa``, which not
    every fused kernel takes; the copy is O(c), the attention O(n c).
    """
    rep = q.shape[1] // k.shape[1]
    qt = q.transpose(0, 1)[None]
    kt = k.transpose(0, 1).repeat_interleave(rep, dim=0)[None]
    vt = v.transpose(0, 1).repeat_interleave(rep, dim=0)[None]
    n, c = q.shape[0], k.shape[0]
    if q_offset is None or n == c:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
    elif n == 1:  # one query at the last position sees every key
        out = F.scaled_dot_product_attention(qt, kt, vt)
    else:
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=causal_lower_right(n, c))
    return out[0].transpose(0, 1)


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor | None
) -> torch.Tensor:
    """One query per sequence, B sequences at once: q ``[B, H, d]`` over k/v ``[B, C, KVH, d]`` padded to
    the longest context, ``valid`` ``[B, 1, 1, C]`` marking real keys (``None``: all contexts are C long).

    Each KV head's ``H / KVH`` query heads ride as that head's query rows (the layout ``repeat_interleave``
    gives), so the KV is read once per step, not once per query head or per sequence.
    """
    b, h, d = q.shape
    kvh = k.shape[2]
    qg = q.reshape(b, kvh, h // kvh, d)
    out = F.scaled_dot_product_attention(qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=valid)
    return out.reshape(b, h, d)


class Decoder(nn.Module):
    """Embedding, [RMSNorm, RoPE GQA attention, RMSNorm, SwiGLU] x L, final norm, lm head.

    Attention is delegated to a callback so the paged path and the reference path share every other op.
    """

    def __init__(self, cfg: TorchModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        gen = torch.Generator().manual_seed(cfg.seed)
        h, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size

        def param(*shape: int, std: float) -> nn.Parameter:
            return nn.Parameter(torch.randn(*shape, generator=gen) * std, requires_grad=False)

        def ones(n: int) -> nn.Parameter:
            return nn.Parameter(torch.ones(n), requires_grad=False)

        qkv_out = (cfg.num_heads + 2 * cfg.num_kv_heads) * hd
        self.embed = param(cfg.vocab_size, h, std=1.0)
        self.layers = nn.ModuleList(
            nn.ParameterDict(
                {
                    "attn_norm": ones(h),
                    "wqkv": param(h, qkv_out, std=h**-0.5),
                    "wo": param(cfg.num_heads * hd, h, std=(cfg.num_heads * hd) ** -0.5),
                    "mlp_norm": ones(h),
                    "w_gate_up": param(h, 2 * inter, std=h**-0.5),
                    "w_down": param(inter, h, std=inter**-0.5),
                }
            )
            for _ in range(cfg.num_layers)
        )
        self.final_norm = ones(h)
        self.lm_head = param(h, cfg.vocab_size, std=h**-0.5)
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        angles = torch.outer(torch.arange(cfg.max_model_len, dtype=torch.float64), inv_freq)
        self._angles = torch.cat((angles, angles), dim=-1)
        self.rope_cos, self.rope_sin = self._angles.cos(), self._angles.sin()
        self.tokens_embedded = 0  # instrumentation: proves cached prefixes are not recomputed

    def place(self, device: torch.device, dtype: torch.dtype) -> Decoder:
        """Move weights; RoPE tables stay at >= float32 so low-precision models keep exact positions."""
        self.to(device, dtype)
        table_dtype = torch.promote_types(dtype, torch.float32)
        self.rope_cos = self._angles.cos().to(device, table_dtype)
        self.rope_sin = self._angles.sin().to(device, table_dtype)
        return self

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        xf = x.to(cos.dtype)
        x1, x2 = xf.chunk(2, dim=-1)
        return (xf * cos + torch.cat((-x2, x1), dim=-1) * sin).to(x.dtype)

    def forward(
        self, ids: torch.Tensor, pos: torch.Tensor, attend: AttendFn, rows: torch.Tensor
    ) -> torch.Tensor:
        """Run packed tokens ``ids`` at positions ``pos``; return float32 logits of the given rows."""
        cfg, n = self.cfg, ids.shape[0]
        heads, kvh, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        nq, nkv = heads * hd, kvh * hd
        self.tokens_embedded += n
        # Per-op dispatch, not FLOPs, is what a small batch costs in eager PyTorch (a decode step of an 8B
        # shape on an H200 spends ~30 ms launching ops): the RoPE tables are indexed once per forward, and
        # queries and keys rotate in one call.
        cos, sin = self.rope_cos[pos].unsqueeze(1), self.rope_sin[pos].unsqueeze(1)
        x = self.embed[ids]
        for i, layer in enumerate(cast("list[nn.ParameterDict]", self.layers)):
            qkv = _rms_norm(x, layer["attn_norm"]) @ layer["wqkv"]
            qk = self._rope(qkv[:, : nq + nkv].reshape(n, heads + kvh, hd), cos, sin)
            q, k = qk[:, :heads], qk[:, heads:]
            v = qkv[:, nq + nkv :].reshape(n, kvh, hd)
            x = x + attend(i, q, k, v).reshape(n, nq) @ layer["wo"]
            gate, up = (_rms_norm(x, layer["mlp_norm"]) @ layer["w_gate_up"]).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ layer["w_down"]
        return (_rms_norm(x[rows], self.final_norm) @ self.lm_head).float()
