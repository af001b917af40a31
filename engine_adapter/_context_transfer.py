"""Moving a parked session's KV context between nodes in one process: ``ContextData``, a whole context as
bytes, out of one ``EngineCore`` and into another (the replay's migrations and the tests use it).

Built on the same handles as the streamed gRPC move (``_context_export``, ``_context_import``), so there is
one implementation of the lease, the checks, the reservation and the commit: here the whole context is one
chunk.  Why apart from ``_engine``: the stepping loop and hints never touch this path;
``EngineCore.export_context``/``import_context`` call in here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ._context_blocks import ContextHeader, join_blocks
from ._context_export import begin_export
from ._context_import import begin_import, check_header
from ._engine_errors import InvalidArgument

if TYPE_CHECKING:
    from ._engine import EngineCore

__all__ = ["ContextData", "export_context", "import_context"]


@dataclass
class ContextData:
    """A session's KV context as bytes, whole (on the wire it travels as a ``ContextHeader`` and chunks)."""

    session_id: str
    program_id: str
    token_ids: list[int]
    block_size: int
    model_fingerprint: str
    dtype: str
    shape: tuple[int, ...]
    kv_data: bytes

    def header(self, pin_ttl_s: float = 0.0) -> ContextHeader:
        num_blocks = -(-len(self.token_ids) // self.block_size) if self.block_size > 0 else 0
        return ContextHeader(
            session_id=self.session_id,
            program_id=self.program_id,
            token_ids=list(self.token_ids),
            block_size=self.block_size,
            model_fingerprint=self.model_fingerprint,
            dtype=self.dtype,
            shape=tuple(self.shape),
            num_blocks=num_blocks,
            pin_ttl_s=pin_ttl_s,
        )


def export_context(core: EngineCore, session_id: str, release_after: bool = False) -> ContextData:
    """The session's context, whole; ``release_after``: free it here once read (a move, not a copy)."""
    export = begin_export(core, session_id)  # the whole context in one chunk
    try:
        parts = []
        while (chunk := export.read_chunk()) is not None:
            parts.append(chunk)
    except BaseException:
        export.close()
        raise
    export.close(drop=release_after)
    h = export.header
    return ContextData(
        session_id=h.session_id,
        program_id=h.program_id,
        token_ids=h.token_ids,
        block_size=h.block_size,
        model_fingerprint=h.model_fingerprint,
        dtype=h.dtype,
        shape=h.shape,
        kv_data=join_blocks(core.executor.kv_shape, parts),
    )


def import_context(core: EngineCore, blob: ContextData) -> tuple[int, int]:
    """Take a whole context: its tokens and blocks.  Every check runs before anything here changes."""
    header = blob.header()
    check_header(core, header)
    expected = header.num_blocks * core.executor.layout.block_nbytes
    if len(blob.kv_data) != expected:
        raise InvalidArgument(
            f"kv_data holds {len(blob.kv_data)} bytes; {len(blob.token_ids)} tokens need {expected} bytes"
        )
    with begin_import(core, header) as imp:
        if header.num_blocks:
            imp.write_chunk(blob.kv_data, header.num_blocks)
        num_tokens, num_blocks, _ = imp.commit()
    return num_tokens, num_blocks
