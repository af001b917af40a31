"""Which SDPA route runs a long causal prefill fast (32 query heads, 8 KV heads, head_dim 128, bf16 on a GPU).

GQA through ``enable_gqa`` or through repeated KV heads, each with 3-D inputs (``[heads, n, d]``, as the torch
executor passed them when this first ran) and 4-D ones (``[1, heads, n, d]``).  On an H200 (2026-11-30) both
3-D routes took 55 ms for the 8k prefill: SDPA's math kernel; it fuses only 4-D inputs.  Usage:
``python3 scripts/sdpa_probe.py [cpu]``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right


def timed(fn: Callable[[], torch.Tensor], dev: str, rounds: int = 3) -> float:
    fn()
    if dev == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(rounds):
        fn()
    if dev == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / rounds


def probe(n: int, c: int, dev: str, dtype: torch.dtype) -> str:
    q = torch.randn(32, n, 128, device=dev, dtype=dtype)
    k = torch.randn(8, c, 128, device=dev, dtype=dtype)
    v = torch.randn_like(k)
    kw: dict[str, Any] = {"is_causal": True} if n == c else {"attn_mask": causal_lower_right(n, c)}
    kr, vr = k.repeat_interleave(4, 0), v.repeat_interleave(4, 0)
    sdpa = F.scaled_dot_product_attention
    routes = {
        "3-D enable_gqa": lambda: sdpa(q, k, v, enable_gqa=True, **kw),
        "3-D repeated": lambda: sdpa(q, kr, vr, **kw),
        "4-D enable_gqa": lambda: sdpa(q[None], k[None], v[None], enable_gqa=True, **kw),
        "4-D repeated": lambda: sdpa(q[None], kr[None], vr[None], **kw),
    }
    return ", ".join(f"{name} {timed(fn, dev) * 1e3:.1f} ms" for name, fn in routes.items())


def main() -> None:
    dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    shapes = ((8192, 8192), (4096, 12288)) if dev == "cuda" else ((2048, 2048), (1024, 3072))
    for n, c in shapes:
        print(f"sdpa n={n} c={c} on {dev}: {probe(n, c, dev, dtype)}", flush=True)


if __name__ == "__main__":
    main()
