"""Deterministic prompt tokens for a trace: equal where the trace says contexts are equal, unique elsewhere.

A trace holds token counts, an engine needs token ids, and a prefix cache hits only on equal ids.  So:

* a shared prefix key (``Turn.shared_prefix``) always expands to the same ids, in every session and program,
  so a system prompt shared by agents is one cached prefix on a node;
* Mooncake ``hash_ids`` expand block by block from the id alone, so equal ids give equal blocks;
* every other input token is drawn from a stream keyed by (seed, program, session, turn), so it is the same
  in every replay of the trace and different from every other session's.

A session's next prompt is its previous prompt, plus the output the engine actually generated, plus the new
input: exactly what an agent loop resends, so the session's own KV is a prefix of its next call.
"""

from __future__ import annotations

import functools
import hashlib

import numpy as np

from replay._trace import Turn

__all__ = ["PromptBuilder"]


def _key(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


class PromptBuilder:
    """Token ids for turns, over ``vocab_size`` ids (what the modeled executor accepts)."""

    def __init__(self, vocab_size: int, seed: int) -> None:
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
        self.vocab_size = vocab_size
        self.seed = seed

    def _stream(self, name: str, n: int) -> list[int]:
        rng = np.random.default_rng(_key(f"{self.seed}\0{name}"))
        return rng.integers(0, self.vocab_size, n).tolist() if n > 0 else []

    @functools.lru_cache(maxsize=4096)  # noqa: B019 - one builder per replay; keys are prefix names
    def shared(self, key: str, n: int) -> tuple[int, ...]:
        """The ids of shared prefix ``key`` (independent of the seed: a system prompt is a system prompt)."""
        rng = np.random.default_rng(_key(f"prefix\0{key}"))
        return tuple(rng.integers(0, self.vocab_size, n).tolist())

    def new_input(self, turn: Turn, where: str) -> list[int]:
        """The ``turn.input_tokens`` ids a turn appends; ``where`` names program, session and turn."""
        if turn.hash_ids:
            out: list[int] = []
            for h in turn.hash_ids:
                out.extend(self.shared(f"hash\0{h}", turn.block_size))
            if len(out) < turn.input_tokens:
                out.extend(self._stream(where, turn.input_tokens - len(out)))
            return out[: turn.input_tokens]
        prefix = list(self.shared(turn.shared_prefix, turn.shared_prefix_tokens)) if turn.shared_prefix else []
        return prefix + self._stream(where, turn.input_tokens - len(prefix))
