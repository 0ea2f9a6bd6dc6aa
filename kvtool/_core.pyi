"""kvtool's C++ host runtime: KV cache manager and scheduler."""

from collections.abc import Sequence
import enum
from typing import Annotated

import numpy
from numpy.typing import NDArray


class PoolKind(enum.Enum):
    """
    Where a block lives: PRIMARY (GPU/CPU pool), SECONDARY (host tier), or the third tier: DISK (files of this engine) or REMOTE (a store shared by engines).
    """

    PRIMARY = 0

    SECONDARY = 1

    DISK = 2

    REMOTE = 3

class KvCacheEventKind(enum.Enum):
    """What happened to a cached block."""

    STORED = 0

    REMOVED = 1

    OFFLOADED = 2

    ONBOARDED = 3

class RetentionRange:
    """
    Retention of a token range: blocks whose first token lies in [token_start, token_end) get `priority` (0..100); duration_ms after such a block was last released it reverts to the default priority 35. Give a sequence's ranges sorted and not overlapping.
    """

    def __init__(self, token_start: int, token_end: int | None, priority: int, duration_ms: int | None = None) -> None:
        """
        token_end None: to the end of the sequence; duration_ms None: the priority never reverts.
        """

    @property
    def token_start(self) -> int: ...

    @property
    def token_end(self) -> int | None:
        """None: to the end of the sequence."""

    @property
    def priority(self) -> int: ...

    @property
    def duration_ms(self) -> int | None:
        """None: the priority never reverts."""

    def __repr__(self) -> str: ...

class CacheConfig:
    """
    Sizes (in blocks) and switches of the KV cache. Validated by KVCacheManager.
    """

    def __init__(self, *, tokens_per_block: int = 32, num_primary_blocks: int = 0, num_secondary_blocks: int = 0, enable_block_reuse: bool = True, enable_partial_reuse: bool = True, secondary_offload_min_priority: int = 35, max_attention_window: int = 0, event_buffer_max_size: int = 0, num_tier3_blocks: int = 0, tier3_pool: PoolKind = PoolKind.DISK, plan_digest: bytes = ...) -> None: ...

    @property
    def tokens_per_block(self) -> int:
        """Tokens per block, a power of 2."""

    @tokens_per_block.setter
    def tokens_per_block(self, arg: int, /) -> None: ...

    @property
    def num_primary_blocks(self) -> int:
        """Blocks of the primary pool (> 0)."""

    @num_primary_blocks.setter
    def num_primary_blocks(self, arg: int, /) -> None: ...

    @property
    def num_secondary_blocks(self) -> int:
        """Blocks of the host tier; 0 disables offloading."""

    @num_secondary_blocks.setter
    def num_secondary_blocks(self, arg: int, /) -> None: ...

    @property
    def enable_block_reuse(self) -> bool: ...

    @enable_block_reuse.setter
    def enable_block_reuse(self, arg: bool, /) -> None: ...

    @property
    def enable_partial_reuse(self) -> bool: ...

    @enable_partial_reuse.setter
    def enable_partial_reuse(self, arg: bool, /) -> None: ...

    @property
    def secondary_offload_min_priority(self) -> int:
        """
        Evicted primary blocks of at least this priority are offloaded, others dropped.
        """

    @secondary_offload_min_priority.setter
    def secondary_offload_min_priority(self, arg: int, /) -> None: ...

    @property
    def max_attention_window(self) -> int:
        """Sliding window in tokens; 0 attends to the whole sequence."""

    @max_attention_window.setter
    def max_attention_window(self, arg: int, /) -> None: ...

    @property
    def event_buffer_max_size(self) -> int:
        """KV cache events kept (oldest dropped); 0 records none."""

    @event_buffer_max_size.setter
    def event_buffer_max_size(self, arg: int, /) -> None: ...

    @property
    def num_tier3_blocks(self) -> int:
        """
        Blocks of the third tier (disk slots or remote index entries); 0: none. Needs a host tier.
        """

    @num_tier3_blocks.setter
    def num_tier3_blocks(self, arg: int, /) -> None: ...

    @property
    def tier3_pool(self) -> PoolKind:
        """PoolKind.DISK (private files) or PoolKind.REMOTE (shared store)."""

    @tier3_pool.setter
    def tier3_pool(self, arg: PoolKind, /) -> None: ...

    @property
    def plan_digest(self) -> bytes:
        """
        32-byte identity of the KV (model, dtype, shapes) in every third-tier key; required for REMOTE.
        """

    @plan_digest.setter
    def plan_digest(self, arg: bytes, /) -> None: ...

    def validate(self) -> None:
        """Raises ValueError naming a bad field."""

    def __repr__(self) -> str: ...

class CopyOp:
    """One block copy the runtime runs before the next forward."""

    @property
    def src_pool(self) -> PoolKind: ...

    @property
    def src_block_id(self) -> int: ...

    @property
    def dst_pool(self) -> PoolKind: ...

    @property
    def dst_block_id(self) -> int: ...

    @property
    def num_tokens(self) -> int:
        """Tokens from the start of the block."""

    def __repr__(self) -> str: ...

class CopyOpArrays:
    """
    Copy operations as a struct of 1-D numpy arrays; index i of each array is operation i, in the order the operations must run. Pools are PoolKind values (0 primary, 1 secondary).
    """

    @property
    def src_pool(self) -> Annotated[NDArray[numpy.uint8], dict(shape=(None,), writable=False)]:
        """uint8 [num_ops]"""

    @property
    def src_block_ids(self) -> Annotated[NDArray[numpy.int32], dict(shape=(None,), writable=False)]:
        """int32 [num_ops]"""

    @property
    def dst_pool(self) -> Annotated[NDArray[numpy.uint8], dict(shape=(None,), writable=False)]:
        """uint8 [num_ops]"""

    @property
    def dst_block_ids(self) -> Annotated[NDArray[numpy.int32], dict(shape=(None,), writable=False)]:
        """int32 [num_ops]"""

    @property
    def num_tokens(self) -> Annotated[NDArray[numpy.int32], dict(shape=(None,), writable=False)]:
        """int32 [num_ops]: tokens from the start of each block"""

    @property
    def tier3_keys(self) -> list:
        """
        list[bytes]: the 32-byte key of each operation into or out of the third tier (DISK / REMOTE), in operation order.
        """

    def __len__(self) -> int: ...

    def to_list(self) -> list[CopyOp]:
        """The operations as a list of CopyOp (for tests and debugging)."""

class MatchResult:
    """A side-effect-free prefix lookup."""

    @property
    def num_matched_tokens(self) -> int:
        """
        Prompt tokens whose KV can be taken from the cache (full blocks + partial copy).
        """

    @property
    def num_matched_blocks(self) -> int:
        """Full blocks that would be shared."""

    @property
    def num_secondary_blocks(self) -> int:
        """Of those, blocks in the host tier (would be onboarded)."""

    @property
    def num_partial_tokens(self) -> int:
        """
        Tokens of a partially matching block (copied, not shared). add_sequence computes them instead when the copy's evictable source would leave too few blocks.
        """

    def __repr__(self) -> str: ...

class MissReasons:
    """
    Missed full prompt blocks by reason. Each missed block counts under exactly one reason, so the fields sum to total (rules: docs/architecture.md#kv-cache-rules).
    """

    def __init__(self) -> None:
        """Every count 0."""

    @property
    def never_seen(self) -> int:
        """
        No block with its key, nor its tokens under another identity, was ever stored (as far as the manager remembers: at least the last 2 x (primary + secondary blocks) keys dropped or stored).
        """

    @property
    def evicted_primary(self) -> int:
        """
        Cached, then dropped from the primary pool without an offload (no host tier, host tier full with nothing evictable, or priority below secondary_offload_min_priority).
        """

    @property
    def evicted_host(self) -> int:
        """Offloaded, then dropped from the host (secondary) tier."""

    @property
    def identity(self) -> int:
        """
        The same tokens (from the prompt's start) were stored under another cache salt, LoRA task id or extra ids.
        """

    @property
    def partial(self) -> int:
        """
        The block after the shared chain, which got a partial-reuse copy of its first tokens.
        """

    @property
    def last_token(self) -> int:
        """
        Cached, but it holds the prompt's last token, which is always computed (a prompt of whole blocks).
        """

    @property
    def reuse_off(self) -> int:
        """Block reuse is disabled: every full prompt block."""

    @property
    def evicted_disk(self) -> int:
        """Spilled to the disk tier, then dropped from it."""

    @property
    def evicted_remote(self) -> int:
        """
        Spilled to the remote store, then dropped from the manager's index or gone from the store.
        """

    @property
    def fetch_failed(self) -> int:
        """
        Staging it from the third tier failed (read error, store down or slow, a value that does not verify).
        """

    @property
    def not_staged(self) -> int:
        """
        In the third tier, but not staged into the host tier before the request was added.
        """

    @property
    def total(self) -> int:
        """Missed blocks, every reason."""

    def to_dict(self, *, tier3: bool = False) -> dict:
        """
        {reason: blocks}, every reason in declaration order; the third tier's too with tier3=True.
        """

    def __eq__(self, arg: MissReasons, /) -> bool: ...

    def __repr__(self) -> str: ...

class AddSequenceResult:
    """What add_sequence did for one sequence."""

    @property
    def num_reused_tokens(self) -> int:
        """Prompt tokens not to compute (shared full blocks + partial copy)."""

    @property
    def num_reused_blocks(self) -> int:
        """Full blocks shared."""

    @property
    def num_onboarded_blocks(self) -> int:
        """Of the shared blocks, those brought back from the host tier."""

    @property
    def num_partial_tokens(self) -> int:
        """Tokens copied from a partially matching block."""

    @property
    def num_early_reused_blocks(self) -> int:
        """Shared blocks whose computing sequence was still running."""

    @property
    def num_new_blocks(self) -> int:
        """Blocks allocated fresh (including the partial copy target)."""

    @property
    def missed(self) -> MissReasons:
        """
        MissReasons of the prompt's full blocks not shared (decided before this call evicted anything).
        """

    def __repr__(self) -> str: ...

class PoolStats:
    """Block counts of one pool; free + cached + used = num_blocks."""

    @property
    def num_blocks(self) -> int: ...

    @property
    def num_free_blocks(self) -> int:
        """Hold nothing."""

    @property
    def num_cached_blocks(self) -> int:
        """Unreferenced but matchable (evictable)."""

    @property
    def num_used_blocks(self) -> int:
        """Referenced by at least one sequence."""

    def __repr__(self) -> str: ...

class CacheStats:
    """Counters since construction or reset_stats(), and pool occupancy."""

    @property
    def reused_blocks(self) -> int: ...

    @property
    def missed_blocks(self) -> int:
        """Prompt full blocks that had to be computed."""

    @property
    def missed(self) -> MissReasons:
        """The missed blocks by reason (MissReasons; total == missed_blocks)."""

    @property
    def cache_hit_rate(self) -> float:
        """reused / (reused + missed); 0 when both are 0."""

    @property
    def early_reused_blocks(self) -> int:
        """Reused while their computing sequence was still running."""

    @property
    def partial_reused_blocks(self) -> int: ...

    @property
    def alloc_total_blocks(self) -> int:
        """Blocks handed to sequences, reused or new."""

    @property
    def alloc_new_blocks(self) -> int: ...

    @property
    def offloaded_blocks(self) -> int:
        """Primary -> secondary."""

    @property
    def onboarded_blocks(self) -> int:
        """Secondary -> primary."""

    @property
    def evicted_blocks(self) -> int:
        """Dropped from the cache (either tier)."""

    @property
    def num_offloaded_tokens(self) -> int:
        """
        Token slots copied primary -> secondary (bytes = tokens * bytes per token).
        """

    @property
    def num_onboarded_tokens(self) -> int:
        """Token slots copied secondary -> primary."""

    @property
    def primary(self) -> PoolStats: ...

    @property
    def secondary(self) -> PoolStats: ...

    @property
    def tier3(self) -> PoolStats:
        """The third tier's slots (disk) or index entries (remote)."""

    @property
    def tier3_traffic(self) -> Tier3Stats:
        """Spills, stagings and failures of the third tier."""

    def tier(self, pool: PoolKind) -> TierStats:
        """
        TierStats of one tier: hits, arrivals, evictions, token slots copied in and out.
        """

    def to_dict(self, *, tier3: bool = False) -> dict:
        """
        Flat dict of every counter (miss reasons as missed_<reason>_blocks, the third tier's with tier3=True; pool fields prefixed primary_/secondary_/tier3_, per-tier ones primary_/secondary_/disk_/remote_), for reports.
        """

class KvCacheEvent:
    """A change of the cached blocks (for KV-aware routers)."""

    @property
    def event_id(self) -> int: ...

    @property
    def kind(self) -> KvCacheEventKind: ...

    @property
    def block_hash(self) -> int: ...

    @property
    def parent_hash(self) -> int:
        """0 for a block at the root."""

    @property
    def token_ids(self) -> list[int]:
        """The block's tokens (STORED events only)."""

    def __repr__(self) -> str: ...

class KVCacheManager:
    """
    Block pools, prefix index, reuse, LRU eviction and host offload. Decides where every block lives and returns copy operations; never touches KV data.
    """

    def __init__(self, config: CacheConfig, *, key_hash_bits: int = 64) -> None:
        """
        Raises ValueError for a bad config. key_hash_bits < 64 is a test hook that truncates block key hashes (0: every key collides) to exercise the collision guard.
        """

    @property
    def config(self) -> CacheConfig:
        """The validated configuration (a copy)."""

    def match_prefix(self, token_ids: numpy.ndarray | list[int], *, extra_ids: numpy.ndarray | list[int] | None = None, lora_task_id: int = 0, cache_salt: int = 0) -> MatchResult:
        """
        Longest cached chain for this prompt, without side effects. The last prompt token is never matched.
        """

    def num_blocks_to_add(self, token_ids: numpy.ndarray | list[int], num_tokens: int, *, extra_ids: numpy.ndarray | list[int] | None = None, lora_task_id: int = 0, cache_salt: int = 0) -> int:
        """
        Primary blocks add_sequence would take out of num_available_blocks() for num_tokens tokens.
        """

    def num_available_blocks(self) -> int:
        """
        Primary blocks that can be handed out now: free plus evictable cached ones.
        """

    def can_add_sequence(self, token_ids: numpy.ndarray | list[int], num_tokens: int, *, extra_ids: numpy.ndarray | list[int] | None = None, lora_task_id: int = 0, cache_salt: int = 0) -> bool:
        """Whether add_sequence(..., num_tokens) would find enough blocks."""

    def add_sequence(self, seq_id: int, token_ids: numpy.ndarray | list[int], num_tokens: int, *, extra_ids: numpy.ndarray | list[int] | None = None, lora_task_id: int = 0, cache_salt: int = 0, priority: int = 35, retention: Sequence[RetentionRange] | None = None) -> AddSequenceResult:
        """
        Registers a sequence with prompt token_ids (1-D int32 array or list; extra_ids: one uint64 per token or None), shares its longest cached prefix (onboarding host blocks, copying a partially matching block) and allocates blocks to hold num_tokens (>= 1) tokens. priority (0..100) is the retention priority of the blocks it computes, retention (RetentionRange list) that of token ranges, shared blocks included. Raises ValueError for bad input or a known seq_id, RuntimeError when blocks lack (nothing changes then).
        """

    def can_allocate(self, seq_id: int, num_tokens: int) -> bool:
        """
        Whether allocate(seq_id, num_tokens) would find enough blocks. KeyError for an unknown id.
        """

    def allocate(self, seq_id: int, num_tokens: int) -> None:
        """
        Grows the block table to hold num_tokens tokens in total. RuntimeError when blocks lack.
        """

    def append_tokens(self, seq_id: int, token_ids: numpy.ndarray | list[int]) -> None:
        """
        Appends generated tokens (extra id 0), so blocks they fill become reusable once computed.
        """

    def mark_computed(self, seq_id: int, num_computed_tokens: int) -> None:
        """
        KV of the first num_computed_tokens tokens is written: full blocks among them become matchable at once; with a sliding window, blocks wholly outside it are released.
        """

    def release(self, seq_id: int) -> None:
        """
        Drops the sequence; its computed full blocks stay matchable until evicted.
        """

    def has_sequence(self, seq_id: int) -> bool: ...

    def num_tokens(self, seq_id: int) -> int:
        """Tokens known: prompt + appended."""

    def num_computed_tokens(self, seq_id: int) -> int: ...

    def block_ids(self, seq_id: int) -> Annotated[NDArray[numpy.int32], dict(shape=(None,))]:
        """
        Primary block table as an int32 array; -1 where the sliding window released a block.
        """

    def take_copy_ops(self) -> CopyOpArrays:
        """
        Copy operations emitted since the last call, as CopyOpArrays, in the order they must run.
        """

    def take_events(self) -> list[KvCacheEvent]:
        """KV cache events recorded since the last call."""

    def stats(self) -> CacheStats:
        """Counters and pool occupancy."""

    def reset_stats(self) -> None:
        """Zeroes the counters; the cache is kept."""

    def check_invariants(self) -> list[str]:
        """
        Empty list when every invariant holds; otherwise one message per violation.
        """

    def set_time(self, now_ms: int) -> None:
        """
        Sets the manager's clock (milliseconds, the engine's or a simulated one; never earlier than before: ValueError). Priorities whose duration ran out by now revert to 35.
        """

    def time(self) -> int:
        """The manager's clock in milliseconds."""

    def tier3_lookup(self, token_ids: numpy.ndarray | list[int], *, extra_ids: numpy.ndarray | list[int] | None = None, lora_task_id: int = 0, cache_salt: int = 0) -> Tier3Lookup:
        """
        The keys of the prompt's matchable blocks after its cached chain in the primary and host tiers, for the store to check which it holds (no side effects). ValueError without a third tier.
        """

    def stage_tier3(self, token_ids: numpy.ndarray | list[int], num_present: int, *, extra_ids: numpy.ndarray | list[int] | None = None, lora_task_id: int = 0, cache_salt: int = 0, priority: int = 35, retention: Sequence[RetentionRange] | None = None) -> StageResult:
        """
        Stages the first num_present blocks of tier3_lookup's keys (those the store holds) into the host tier: each gets a host block and a fetch in take_copy_ops. The staging stays open until complete_staging (add_sequence, allocate and mark_computed raise RuntimeError meanwhile). Remote: index entries past num_present are dropped, the store no longer holds them.
        """

    def complete_staging(self, failed_host_block_ids: numpy.ndarray | list[int]) -> None:
        """
        The staging's fetches ran: those into failed_host_block_ids (and the chain after the first of them) are dropped, a miss; the others are host blocks like any. ValueError for a block that is no fetch of it.
        """

    def staging_open(self) -> bool:
        """Whether a staging waits for complete_staging."""

    def tier3_keys(self, token_ids: numpy.ndarray | list[int], *, extra_ids: numpy.ndarray | list[int] | None = None, lora_task_id: int = 0, cache_salt: int = 0) -> list:
        """
        list[bytes]: the third-tier key of each full prompt block, first block first (SHA-256 chained from the plan digest: docs/architecture.md#kv-cache-rules).
        """

class TierStats:
    """One tier's counters; bytes = tokens * bytes per token."""

    @property
    def hit_blocks(self) -> int:
        """
        Reused blocks served from this tier (third tier: staged into the host tier, then reused).
        """

    @property
    def stored_blocks(self) -> int:
        """Blocks that arrived: computed, offloaded, spilled, staged."""

    @property
    def evicted_blocks(self) -> int:
        """
        Blocks dropped from the cache while in this tier (third tier: failed stagings too).
        """

    @property
    def num_tokens_in(self) -> int:
        """Token slots copied into this tier."""

    @property
    def num_tokens_out(self) -> int:
        """Token slots copied out of this tier."""

    def __repr__(self) -> str: ...

class Tier3Stats:
    """The third tier's traffic."""

    @property
    def spilled_blocks(self) -> int:
        """Host tier -> third tier."""

    @property
    def staged_blocks(self) -> int:
        """Third tier -> host tier, fetched and confirmed."""

    @property
    def fetch_failed_blocks(self) -> int:
        """
        Staged, but the fetch failed (or one before it in the chain did): dropped, a miss.
        """

    @property
    def lost_blocks(self) -> int:
        """
        Remote: in the manager's index, but the store no longer had them at a lookup.
        """

    @property
    def discovered_blocks(self) -> int:
        """
        Remote: staged from the store without being in the index (another engine stored them).
        """

class Tier3Lookup:
    """What tier3_lookup found for a prompt."""

    @property
    def num_local_blocks(self) -> int:
        """
        Leading prompt blocks in the primary or host tier (shared or onboarded by add_sequence).
        """

    @property
    def num_known_blocks(self) -> int:
        """
        Of the keys, the leading ones the manager's third-tier index holds (disk: exactly those on disk).
        """

    @property
    def keys(self) -> list:
        """
        list[bytes]: keys of the matchable prompt blocks after the local ones, for the store to check.
        """

    def __repr__(self) -> str: ...

class StageResult:
    """What stage_tier3 did."""

    @property
    def num_local_blocks(self) -> int:
        """Leading prompt blocks already in the primary or host tier."""

    @property
    def num_staged_blocks(self) -> int:
        """
        Fetches emitted (third tier -> host): run take_copy_ops, then complete_staging.
        """

    @property
    def num_lost_blocks(self) -> int:
        """Remote index entries dropped because the store no longer holds them."""

    def __repr__(self) -> str: ...

class CapacitySchedulerPolicy(enum.Enum):
    """How many requests hold KV cache blocks (TensorRT-LLM's names)."""

    GUARANTEED_NO_EVICT = 0
    """
    Admit only if the whole lifetime fits beside every running request; never pause.
    """

    MAX_UTILIZATION = 1
    """
    Admit while the next step fits; pause the most recently started request when blocks lack.
    """

    STATIC_BATCH = 2
    """Admit a new batch only when no request is running."""

class ContextChunkingPolicy(enum.Enum):
    """Which context advances first when chunked."""

    FIRST_COME_FIRST_SERVED = 0
    """The oldest context takes as much of the token budget as it can."""

    EQUAL_PROGRESS = 1
    """Every context advances one block before any advances a second."""

class RequestState(enum.Enum):
    """QUEUED -> CONTEXT -> GENERATION -> FINISHED; PAUSED re-queued."""

    QUEUED = 0

    CONTEXT = 1

    GENERATION = 2

    PAUSED = 3

    FINISHED = 4

class SchedulerConfig:
    """Capacity policy, context chunking and per-step limits."""

    def __init__(self, *, capacity_scheduler_policy: CapacitySchedulerPolicy = CapacitySchedulerPolicy.GUARANTEED_NO_EVICT, context_chunking_policy: ContextChunkingPolicy = ContextChunkingPolicy.FIRST_COME_FIRST_SERVED, enable_chunked_context: bool = False, max_batch_size: int = 8, max_num_tokens: int = 8192, max_seq_len: int = 4096, enable_in_batch_prefix_reuse: bool = True, vocab_size: int = 0) -> None: ...

    @property
    def capacity_scheduler_policy(self) -> CapacitySchedulerPolicy: ...

    @capacity_scheduler_policy.setter
    def capacity_scheduler_policy(self, arg: CapacitySchedulerPolicy, /) -> None: ...

    @property
    def context_chunking_policy(self) -> ContextChunkingPolicy: ...

    @context_chunking_policy.setter
    def context_chunking_policy(self, arg: ContextChunkingPolicy, /) -> None: ...

    @property
    def enable_chunked_context(self) -> bool: ...

    @enable_chunked_context.setter
    def enable_chunked_context(self, arg: bool, /) -> None: ...

    @property
    def max_batch_size(self) -> int:
        """Requests per step."""

    @max_batch_size.setter
    def max_batch_size(self, arg: int, /) -> None: ...

    @property
    def max_num_tokens(self) -> int:
        """Tokens per step: context-chunk tokens + one per generating request."""

    @max_num_tokens.setter
    def max_num_tokens(self, arg: int, /) -> None: ...

    @property
    def max_seq_len(self) -> int:
        """Prompt + generated tokens of one request."""

    @max_seq_len.setter
    def max_seq_len(self, arg: int, /) -> None: ...

    @property
    def enable_in_batch_prefix_reuse(self) -> bool:
        """
        Hold a queued request back while a running context computes prompt blocks it could reuse.
        """

    @enable_in_batch_prefix_reuse.setter
    def enable_in_batch_prefix_reuse(self, arg: bool, /) -> None: ...

    @property
    def vocab_size(self) -> int:
        """
        > 0: add_request refuses a prompt token id outside [0, vocab_size); 0: ids are not checked.
        """

    @vocab_size.setter
    def vocab_size(self, arg: int, /) -> None: ...

    def validate(self) -> None:
        """Raises ValueError naming a bad field."""

    def __repr__(self) -> str: ...

class ScheduledRequest:
    """One request's share of a step."""

    @property
    def request_id(self) -> int: ...

    @property
    def is_context(self) -> bool:
        """True for a context chunk, False for one generation token."""

    @property
    def num_cached_tokens(self) -> int:
        """
        Tokens whose KV is cached before the step = position of the first new token.
        """

    @property
    def token_ids(self) -> Annotated[NDArray[numpy.int32], dict(shape=(None,))]:
        """int32 [num_new_tokens]: the tokens to compute in this step."""

    @property
    def block_ids(self) -> Annotated[NDArray[numpy.int32], dict(shape=(None,))]:
        """
        int32 [num_blocks]: primary block table covering num_cached_tokens + len(token_ids) tokens (-1 where a sliding window released a block).
        """

    @property
    def num_tokens(self) -> int:
        """len(token_ids): tokens computed in this step."""

    @property
    def samples(self) -> bool:
        """Produces a token this step (last context chunk, or generation)."""

    def __repr__(self) -> str: ...

class DecodeRows:
    """A decode step's rows as the arrays a decode kernel reads."""

    @property
    def token_ids(self) -> Annotated[NDArray[numpy.int64], dict(shape=(None,))]:
        """int64 [num_rows]: each row's new token."""

    @property
    def positions(self) -> Annotated[NDArray[numpy.int64], dict(shape=(None,))]:
        """int64 [num_rows]: the tokens each row has cached."""

    @property
    def block_tables(self) -> Annotated[NDArray[numpy.int32], dict(shape=(None, None))]:
        """int32 [num_rows, max_blocks]: each row's block table, -1 padded."""

class ScheduledBatch:
    """What the runtime executes in one step."""

    @property
    def step_id(self) -> int: ...

    @property
    def requests(self) -> list:
        """list[ScheduledRequest]: context chunks first, then generation."""

    @property
    def copy_ops(self) -> CopyOpArrays:
        """
        CopyOpArrays to run, in order, before the forward (even when requests is empty).
        """

    @property
    def paused_request_ids(self) -> list[int]:
        """list[int]: requests paused this step (MAX_UTILIZATION)."""

    @property
    def num_tokens(self) -> int:
        """Tokens computed in the step."""

    def __len__(self) -> int: ...

    def decode_rows(self) -> DecodeRows | None:
        """
        DecodeRows of a step whose every request has one new token and samples (a decode step), in the order of requests; None for any other step.
        """

    def __repr__(self) -> str: ...

class RequestStats:
    """Per-request outcome for reports (reuse figures at first admission)."""

    @property
    def request_id(self) -> int: ...

    @property
    def state(self) -> RequestState: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def num_generated_tokens(self) -> int: ...

    @property
    def num_reused_tokens(self) -> int:
        """Prompt tokens taken from the cache."""

    @property
    def num_reused_blocks(self) -> int:
        """Full blocks shared."""

    @property
    def num_onboarded_blocks(self) -> int:
        """Of those, brought back from host."""

    @property
    def num_early_reused_blocks(self) -> int:
        """Of those, computed by a request that was still running."""

    @property
    def missed(self) -> MissReasons:
        """MissReasons of the full prompt blocks not reused."""

    @property
    def num_pauses(self) -> int:
        """Times paused (MAX_UTILIZATION)."""

    def __repr__(self) -> str: ...

class Scheduler:
    """
    Request states, capacity policy, micro-batch limits and chunked context over a KV cache manager it owns. Each step: schedule() -> run the batch -> complete_step().
    """

    def __init__(self, cache_config: CacheConfig, scheduler_config: SchedulerConfig) -> None:
        """Raises ValueError for a bad configuration."""

    def add_request(self, request_id: int, token_ids: numpy.ndarray | list[int], max_new_tokens: int, *, extra_ids: numpy.ndarray | list[int] | None = None, lora_task_id: int = 0, cache_salt: int = 0, priority: int = 35, retention: Sequence[RetentionRange] | None = None) -> None:
        """
        Queues a request: prompt token_ids (1-D int32 array or list), extra_ids (one uint64 per prompt token, 0 for a normal token, or None), retention priority 0..100 and token ranges with their own (RetentionRange list). Raises ValueError naming the request for an empty prompt, a token id outside [0, vocab_size), prompt + max_new_tokens > max_seq_len, a prompt longer than max_num_tokens without chunked context, a request larger than the primary pool, wrong extra_ids length or a known id.
        """

    def request_problem(self, token_ids: numpy.ndarray | list[int], max_new_tokens: int, *, extra_ids: numpy.ndarray | list[int] | None = None, priority: int = 35) -> str | None:
        """
        Why add_request would refuse this prompt (the message calls it 'request'), or None when it would queue it; changes nothing. A known request id is not checked.
        """

    def finish_request(self, request_id: int) -> None:
        """
        Finishes a request early (EOS, stop string, abort) and releases its blocks; no-op when already finished. KeyError for an unknown id.
        """

    def remove_request(self, request_id: int) -> None:
        """
        Forgets a request, finishing it first if it is not: its stats and generated tokens are dropped and its id becomes unknown. A long-lived caller removes each request once it has read what it needs. KeyError for an unknown id.
        """

    def schedule(self) -> ScheduledBatch:
        """
        Schedules the next step. Run its copy_ops, then the forward of its requests, then call complete_step. RuntimeError if the previous non-empty batch was not completed.
        """

    def complete_step(self, request_ids: numpy.ndarray | list[int], token_ids: numpy.ndarray | list[int]) -> list[int]:
        """
        Reports the last batch: request_ids (int64) of the requests that sampled and their sampled token_ids (int32). Returns the ids of requests that reached max_new_tokens (finished, blocks released). ValueError when request_ids are not the batch's sampling requests.
        """

    def has_unfinished_requests(self) -> bool: ...

    def num_queued_requests(self) -> int:
        """Waiting requests, paused ones included."""

    def num_running_requests(self) -> int:
        """Requests holding blocks (context or generation)."""

    def num_requests(self) -> int:
        """
        Requests the scheduler keeps a record of: unfinished ones and finished ones not removed yet.
        """

    def request_state(self, request_id: int) -> RequestState:
        """KeyError for an unknown id."""

    def request_stats(self, request_id: int) -> RequestStats:
        """KeyError for an unknown id."""

    def generated_token_ids(self, request_id: int) -> Annotated[NDArray[numpy.int32], dict(shape=(None,))]:
        """
        int32 array of the tokens the request generated so far. KeyError for an unknown id.
        """

    @property
    def config(self) -> SchedulerConfig:
        """The validated SchedulerConfig (a copy)."""

    @property
    def cache_manager(self) -> KVCacheManager:
        """
        The KVCacheManager the scheduler owns (stats(), reset_stats(), check_invariants(), ...); valid while the scheduler lives.
        """

class StepCosts:
    """
    Seconds per unit of each term of a step's shape (kvtool.simulate.cost_model.TERMS), and the KV cache's bytes per token (copies cost per byte).
    """

    def __init__(self, *, step: float = 0.0, context_row: float = 0.0, context_token: float = 0.0, context_cached_token: float = 0.0, context_pair: float = 0.0, decode_row: float = 0.0, decode_kv_token: float = 0.0, copied_byte: float = 0.0, bytes_per_token: int = 0) -> None: ...

    @property
    def step(self) -> float: ...

    @property
    def context_row(self) -> float: ...

    @property
    def context_token(self) -> float: ...

    @property
    def context_cached_token(self) -> float: ...

    @property
    def context_pair(self) -> float: ...

    @property
    def decode_row(self) -> float: ...

    @property
    def decode_kv_token(self) -> float: ...

    @property
    def copied_byte(self) -> float: ...

    @property
    def bytes_per_token(self) -> int: ...

class SimulatedSteps:
    """What one StepSimulator.run did."""

    @property
    def end_time(self) -> float:
        """The clock after the last step (seconds)."""

    @property
    def num_steps(self) -> int:
        """Steps that computed something."""

    @property
    def finished_request_ids(self) -> list[int]:
        """list[int]: requests the last step finished, in complete_step's order."""

    @property
    def paused_request_ids(self) -> list[int]:
        """
        list[int]: requests paused in these steps, once per pause (MAX_UTILIZATION).
        """

    @property
    def stalled(self) -> bool:
        """
        The last step had no request while some are unfinished: no queued request fits.
        """

class StepSimulator:
    """
    Runs a Scheduler's steps back to back without a model: each costs StepCosts' prediction for its shape, each sampling request gets simulated_token.
    """

    def __init__(self, costs: StepCosts, vocab_size: int) -> None:
        """Raises ValueError for a bad one."""

    def run(self, scheduler: Scheduler, now: float, until: float = float('inf'), max_steps: int = 2147483647) -> SimulatedSteps:
        """
        Runs steps from clock `now` until, after a step, a request has finished, the clock has reached `until` or max_steps ran; stops early at a step with no request (stalled when requests are left). The same schedule() and complete_step() as a step-by-step run.
        """

    def take_token_times(self, request_id: int) -> Annotated[NDArray[numpy.float64], dict(shape=(None,))]:
        """
        float64 array: the times of the tokens the request sampled in runs since the last call for it (then forgotten).
        """

def simulated_token(last_token: int, num_tokens: int, vocab_size: int) -> int:
    """
    The token a simulated request samples after last_token with num_tokens tokens before it (prompt and generated): the same prompt gives the same answer, as greedy decoding does.
    """
