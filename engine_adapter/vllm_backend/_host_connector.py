"""A host KV tier for vLLM, through vLLM's KV-connector extension point (``--kv-transfer-config``).

Why: with a device pool that holds a third of the live agent contexts, at most a third of the tool
pauses can be bridged by keeping a context on the device; every other turn re-prefills its whole
history. A host tier turns those re-prefills into copies. vLLM's own CPU offloading connector needs
CUDA streams, so on a CPU build there is none; this one works on any device (on a GPU the copies are
device<->host ``index_copy_`` calls, synchronous, ordered with compute on the default stream).

Two ways to fill it (``kv_connector_extra_config.host_save``):

- ``evict`` (the default; ``HINTFLOW_HOST_SAVE`` in the server's environment when the config names
  none): a block is copied to the host when vLLM's block pool evicts it from the device (hands it out
  again), in the step that reuses it, before that step writes it. The host holds what the device lost:
  a tier of half the device pool adds half a pool of contexts. A block loaded back to the device leaves
  its host copy first in line for eviction (``HostIndex.release_loads``): kept in LRU order, those spare
  copies took slots from lost contexts (hintflow's hits on the agent benchmark, tier of half the pool:
  55-57% with them, 58-59% without).
- ``write-through``: every block is copied as it fills (below). The host then holds mostly what the
  device holds too: both drop least recently used contexts first, so a tier smaller than the device
  gives back almost nothing (0.0% external hits for vLLM's own scheduler on the agent benchmark with a
  tier of half the device pool). vLLM gives connectors no eviction hook; the ``evict`` mode wraps the
  block pool's ``_maybe_evict_cached_block`` (checked at start-up with the other internals).

How (write-through as blocks fill, load on admission)::

    every step ── build_connector_meta ─► each scheduled request's full blocks computed in earlier steps
                                          (stable: nothing writes them again) and not yet on the host get
                                          a slot (HostIndex, LRU) and a save in HostTierMetadata
    turn ends ── request_finished ─► the few blocks filled since (usually none) get theirs; only then
                                      vLLM keeps the request's blocks until that copy is done
    each step ── worker start_load_kv ─► saves first (a freed block may be the target of a load), then
                                          loads; requests whose last blocks were copied are reported
                                          finished-sending and vLLM frees (or hintflow's scheduler pins)
                                          their blocks
    new turn ── get_num_new_matched_tokens ─► the run of its next blocks the host holds, as external
                                               hit tokens (vLLM allocates device blocks for them) and
                update_state_after_alloc pairs those slots with the allocated device blocks

Enable it with ``--kv-transfer-config '{"kv_connector": "HintflowHostTier", "kv_connector_module_path":
"engine_adapter.vllm_backend._host_connector", "kv_role": "kv_both", "kv_connector_extra_config":
{"host_capacity_tokens": N}}'`` (``hintflow engine serve --backend vllm --host-capacity-tokens N`` writes
it). It works under vLLM's own scheduler (LRU write-through, no hints) and under hintflow's, which tells
it which turns are a program's last (nothing to save) and which sessions ended released (``end_session``:
their host blocks go first in line for eviction).

It relies on vLLM internals beyond the connector API (``_compat.HOST_TIER_REQUIRED``: the request's
``block_hashes`` and ``num_in_flight_tokens``, the base class's ``_kv_cache_manager``,
``_kv_transfer_config`` and ``_kv_cache_config``, ...); they are checked when the connector is
constructed, under hintflow's scheduler or vLLM's own, and a vLLM that lacks one fails at start-up
naming it. One step's saves never write a host slot twice (``HostIndex.reserve(pending=True)``: a slot
stays locked until the step's metadata is built), and a saved chain is evicted tail first.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from ._compat import HOST_TIER_COMPONENT, HOST_TIER_REQUIRED, check_vllm_internals
from ._context_moves import block_dim
from ._host_index import CONNECTOR_MODULE, HOLD_SHARE, HOST_SAVE_MODES, HostIndex, host_tier_config
from ._step_trace import step_trace

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

__all__ = ["CONNECTOR_MODULE", "HintflowHostTier", "HostTierMetadata", "host_tier_config"]

log = logging.getLogger("vllm.hintflow.host_tier")  # under vLLM's logger: its handlers print INFO

@dataclass
class HostTierMetadata(KVConnectorMetadata):
    """One step's copies, in the order the worker runs them: saves, then loads."""

    saves: list[tuple[int, int]] = field(default_factory=list)  # (device block, host slot)
    loads: list[tuple[int, int]] = field(default_factory=list)  # (host slot, device block)
    saved_req_ids: list[str] = field(default_factory=list)


class HintflowHostTier(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        # before anything of vLLM's is touched: a vLLM without the internals used here fails naming them
        check_vllm_internals(HOST_TIER_REQUIRED, component=HOST_TIER_COMPONENT)
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        capacity = extra.get("host_capacity_tokens")
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(
                "HintflowHostTier needs kv_connector_extra_config.host_capacity_tokens, a positive integer;"
                f" got {capacity!r}"
            )
        if not vllm_config.cache_config.enable_prefix_caching:
            raise ValueError(
                "HintflowHostTier needs vLLM's prefix caching (blocks are found on the host by their prefix"
                " hashes): drop --no-enable-prefix-caching"
            )
        host_save = extra.get("host_save") or os.environ.get("HINTFLOW_HOST_SAVE", "evict")
        if host_save not in HOST_SAVE_MODES:
            raise ValueError(
                f"HintflowHostTier: kv_connector_extra_config.host_save must be one of {', '.join(HOST_SAVE_MODES)};"
                f" got {host_save!r}"
            )
        self.save_on_evict = host_save == "evict"
        self.block_size = int(vllm_config.cache_config.block_size)
        self.num_slots = max(1, capacity // self.block_size)
        # scheduler side
        self.index = HostIndex(self.num_slots)
        self._matched: dict[str, tuple[int, list[int]]] = {}  # req id -> (first block, slots)
        self._tracked: dict[str, list[Any]] = {}  # running req id -> [request, blocks already checked]
        self._saves: list[tuple[int, int]] = []
        self._loads: list[tuple[int, int]] = []
        self._load_locks: list[int] = []
        self._saving_req_ids: list[str] = []
        self._in_flight_req_ids: set[str] = set()
        self.num_delayed_frees = 0  # finished requests whose blocks waited a step for a copy
        self._loaded_now: dict[str, int] = {}
        self.step_loaded_tokens: dict[str, int] = {}  # request id -> tokens loaded, for the last built step
        # set by hintflow's scheduler: which turns are worth saving (not a program's last), and the session a
        # request belongs to (its saved blocks are demoted when the session ends released)
        self.save_filter: Callable[[Request], bool] | None = None
        self.session_key: Callable[[Request], str | None] | None = None
        self._session_hashes: dict[str, list[Any]] = {}
        # evict mode: (device block, hash) the block pool evicted since the last step's metadata, and the
        # hashes not worth a host slot (a program's last turn, a released program's), oldest first
        self._evicted: list[tuple[int, Any]] = []
        self._no_save: dict[Any, None] = {}
        self._next_log_s = 0.0
        self._holds: dict[str, list[int]] = {}  # waiting req id -> host slots held for it (hold_for_waiting)
        self.num_held_slots = 0
        # worker side
        self._host: dict[str, torch.Tensor] = {}
        self._device: dict[str, torch.Tensor] = {}
        self._block_dim: dict[str, int] = {}
        self._finished_saving: set[str] = set()
        if role == KVConnectorRole.SCHEDULER:
            log.info("hintflow host tier: %d slots of %d tokens", self.num_slots, self.block_size)

    # ---- scheduler side --------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        start = num_computed_tokens // self.block_size
        # the last prompt token is always computed (its logits start the output)
        max_blocks = (request.num_tokens - 1) // self.block_size - start
        slots = self.index.match(request.block_hashes, start, max_blocks)
        if not slots:
            self._matched.pop(request.request_id, None)
            return 0, False
        self._matched[request.request_id] = (start, slots)
        return len(slots) * self.block_size, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        # vLLM calls this for every request it admits (or re-admits after a preemption): track it for saves
        if not self.save_on_evict and (self.save_filter is None or self.save_filter(request)):
            self._tracked[request.request_id] = [request, 0]
        matched = self._matched.pop(request.request_id, None)
        if num_external_tokens <= 0 or matched is None:
            return
        start, slots = matched
        slots = slots[: num_external_tokens // self.block_size]
        device_ids = blocks.get_block_ids()[0][start : start + len(slots)]
        if len(device_ids) != len(slots):
            raise RuntimeError(
                f"host tier: request {request.request_id} got {len(device_ids)} device blocks for"
                f" {len(slots)} host blocks"
            )
        self.index.lock(slots)
        self.index.touch_chain(request.block_hashes[: start + len(slots)])
        self._load_locks.extend(slots)
        self._loads.extend(zip(slots, device_ids, strict=True))
        self.index.stats.num_loaded_blocks += len(slots)
        self._loaded_now[request.request_id] = len(slots) * self.block_size

    def hold_for_waiting(self, request_id: str, block_hashes: Any, start: int, max_blocks: int) -> int:
        """A waiting turn's context on the host, the run of blocks ``start:`` after its device part: lock those
        slots until the turn is admitted or ends (``release_hold``), so the saves of what the device evicts
        meanwhile do not take them. At most :data:`HOLD_SHARE` of the tier is held so (saves need the rest).
        The number of blocks held."""
        room = int(HOLD_SHARE * self.num_slots) - self.num_held_slots
        if room <= 0 or request_id in self._holds:
            return 0
        slots = self.index.match(block_hashes, start, min(max_blocks, room))
        if slots:
            self.index.lock(slots)
            self._holds[request_id] = slots
            self.num_held_slots += len(slots)
        return len(slots)

    def release_hold(self, request_id: str) -> None:
        """The turn was admitted (its load, if any, locked the slots it reads) or ended: let its hold go."""
        slots = self._holds.pop(request_id, None)
        if slots:
            self.index.unlock(slots)
            self.num_held_slots -= len(slots)

    def _save_blocks(self, request: Request, block_ids: list[int], start: int, end: int) -> tuple[int, int]:
        """Plan saves of blocks ``start:end`` not yet on the host; (blocks checked, saves planned).

        Each slot is reserved pending (locked until this step's metadata is built), so no later save of
        the same step can evict it and write it again; the request's chain is then marked used head last,
        so the host loses its tail first."""
        n, checked = 0, end
        for i in range(start, end):
            h = request.block_hashes[i]
            if h in self.index:
                continue
            slot = self.index.reserve(h, pending=True)
            if slot is None:  # every slot is read or written this step: try the rest another step
                checked = i
                break
            self._saves.append((block_ids[i], slot))
            n += 1
        self.index.touch_chain(request.block_hashes[:checked])
        return checked, n

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        entry = self._tracked.pop(request.request_id, None)
        num_full = min(len(request.block_hashes), request.num_computed_tokens // self.block_size, len(block_ids))
        if self.save_filter is not None and not self.save_filter(request):
            self._skip_saves(request.block_hashes[:num_full])
            return False, None
        key = self.session_key(request) if self.session_key is not None else None
        if key is not None:
            self._session_hashes[key] = list(request.block_hashes[:num_full])
        if self.save_on_evict:  # saved when the device lets go of them, if it does
            return False, None
        start = min(entry[1], num_full) if entry is not None else 0
        # blocks saved while it ran become the most recently used with the rest (_save_blocks)
        _, planned = self._save_blocks(request, block_ids, start, num_full)
        if not planned:
            return False, None
        self._saving_req_ids.append(request.request_id)
        self._in_flight_req_ids.add(request.request_id)
        self.num_delayed_frees += 1
        return True, None  # vLLM keeps the blocks until the worker reports the copy done

    def _plan_running_saves(self, scheduler_output: Any) -> None:
        """Saves of the scheduled requests' stable full blocks: computed in an earlier step (tokens of
        steps still in flight under async scheduling excluded), so nothing writes them again."""
        if not self._tracked:
            return
        if self._kv_cache_manager is None:  # vLLM binds it after building the scheduler (bind_kv_cache_manager)
            raise RuntimeError(
                "hintflow host tier: vLLM did not bind its KV cache manager to the connector"
                " (KVConnectorBase_V1.bind_kv_cache_manager); running requests' blocks cannot be saved"
            )
        for req_id in scheduler_output.num_scheduled_tokens:
            entry = self._tracked.get(req_id)
            if entry is None:
                continue
            request, checked = entry
            stable = request.num_computed_tokens - int(request.num_in_flight_tokens)
            end = min(len(request.block_hashes), stable // self.block_size)
            if end <= checked:
                continue
            block_ids = self._kv_cache_manager.get_block_ids(req_id)[0]
            entry[1], _ = self._save_blocks(request, block_ids, checked, min(end, len(block_ids)))

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self.save_on_evict:
            self._watch_evictions(kv_cache_manager.block_pool)

    def _watch_evictions(self, pool: Any) -> None:
        """Record every cached block the pool evicts (``get_new_blocks`` handing it out again, or
        ``evict_blocks``): its content is intact until the step that reuses it runs, and that step's
        saves run first (``start_load_kv``)."""
        from vllm.v1.core.kv_cache_utils import get_block_hash

        evict = pool._maybe_evict_cached_block

        def evicting(block: Any) -> bool:
            key = block.block_hash
            if key is not None:
                self._evicted.append((block.block_id, get_block_hash(key)))
            return bool(evict(block))

        pool._maybe_evict_cached_block = evicting

    def _plan_evicted_saves(self) -> None:
        """Saves of the blocks the device evicted since the last step's metadata (evict mode)."""
        evicted, self._evicted = self._evicted, []
        stats = self.index.stats
        stats.num_device_evicted_blocks += len(evicted)
        for block_id, h in evicted:
            if h in self._no_save:
                stats.num_unsaved_evictions += 1
                continue
            if h in self.index:  # loaded back earlier and still there: no copy needed
                self.index.touch(h)
                continue
            slot = self.index.reserve(h, pending=True)
            if slot is None:  # every slot is read or written this step: the block is lost
                stats.num_unsaved_evictions += 1
                continue
            self._saves.append((block_id, slot))

    def forget_evictions(self, block_ids: set[int]) -> None:
        """These evicted blocks are overwritten before the next step (a context import): no save of them."""
        self._evicted = [(b, h) for b, h in self._evicted if b not in block_ids]

    def _skip_saves(self, block_hashes: Any) -> None:
        """These blocks are not worth a host slot when the device evicts them (bounded: oldest forgotten)."""
        for h in block_hashes:
            self._no_save.pop(h, None)
            self._no_save[h] = None
        while len(self._no_save) > 4 * self.num_slots:
            del self._no_save[next(iter(self._no_save))]

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        if self.save_on_evict:
            self._plan_evicted_saves()
            if self._saves:
                # The worker runs a step's copies after its forward unless the step has synchronous loads;
                # these blocks are written by this very forward, so their copies must go first.
                scheduler_output.has_sync_kv_loads = True
        else:
            self._plan_running_saves(scheduler_output)
        meta = HostTierMetadata(saves=self._saves, loads=self._loads, saved_req_ids=self._saving_req_ids)
        trace = step_trace("vllm")  # (hintflow's scheduler opened it first where it runs: one file)
        if trace is not None:  # with the step's copies, which vLLM attaches to the output after this returns
            trace.record(scheduler_output, meta)
        # a later step's copies run after this step's, so the slots can be reused from now on; on eviction
        # saves the loaded blocks' copies go first in line (the device holds them again), as write-through's
        # stay in LRU order (there the host mirrors the device by design)
        if self.save_on_evict:
            self.index.release_loads(self._load_locks)
        else:
            self.index.unlock(self._load_locks)
        self.index.ship()
        self._saves, self._loads, self._saving_req_ids, self._load_locks = [], [], [], []
        # a match is asked for and used within one schedule(): one that found no room is asked again
        self._matched.clear()
        self.step_loaded_tokens, self._loaded_now = self._loaded_now, {}
        now = time.monotonic()
        if now >= self._next_log_s:  # under vLLM's own scheduler nothing else reports the tier
            self._next_log_s = now + 10.0
            log.info(self.index.stats.line(self.index.num_used_slots, self.num_slots))
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        for req_id in connector_output.finished_sending or ():
            self._in_flight_req_ids.discard(req_id)

    def has_pending_block_frees(self) -> bool:
        # blocks held for a copy come back next step: wait for them rather than preempt
        return bool(self._in_flight_req_ids)

    def session_host_tokens(self, session_id: str) -> int:
        """Tokens of the session's last saved turn that are still on the host (its ``CacheState`` entry)."""
        hashes = self._session_hashes.get(session_id, ())
        return sum(1 for h in hashes if h in self.index) * self.block_size

    def end_session(self, session_id: str, released: bool) -> int:
        """The scheduler forgot this session: if its program was released, its blocks go first (0 blocks
        demoted otherwise: a session forgotten for silence may still come back)."""
        hashes = self._session_hashes.pop(session_id, None)
        if not (released and hashes):
            return 0
        self._skip_saves(hashes)
        return self.index.demote(hashes)

    # ---- worker side -----------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        num_blocks = int(self._kv_cache_config.num_blocks)
        for name, kv in kv_caches.items():
            dim = block_dim(kv.shape, num_blocks, f"host tier, layer {name}")
            shape = list(kv.shape)
            shape[dim] = self.num_slots
            pin = kv.device.type == "cuda"
            self._host[name] = torch.empty(shape, dtype=kv.dtype, device="cpu", pin_memory=pin)
            self._device[name] = kv
            self._block_dim[name] = dim
        nbytes = sum(t.numel() * t.element_size() for t in self._host.values())
        log.info("hintflow host tier: %d layers, %.1f MiB of host buffer", len(self._host), nbytes / 2**20)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, HostTierMetadata)
        if meta.saves:
            dev, host = (torch.tensor(c, dtype=torch.long) for c in zip(*meta.saves, strict=True))
            for name, kv in self._device.items():
                dim = self._block_dim[name]
                self._host[name].index_copy_(dim, host, kv.index_select(dim, dev.to(kv.device)).cpu())
        if meta.loads:
            host, dev = (torch.tensor(c, dtype=torch.long) for c in zip(*meta.loads, strict=True))
            for name, kv in self._device.items():
                dim = self._block_dim[name]
                kv.index_copy_(dim, dev.to(kv.device), self._host[name].index_select(dim, host).to(kv.device))
        self._finished_saving.update(meta.saved_req_ids)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done, self._finished_saving = self._finished_saving, set()
        return (done or None), None
