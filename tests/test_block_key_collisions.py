"""The collision guard: a block key's hash only finds candidates; reuse needs every stored key field
(parent, token ids, extra ids, LoRA task id, cache salt) to be equal too.

Every manager here is built with ``key_hash_bits=0``: every block key hashes to 0, so two prompts
collide whenever they could, and only the stored fields tell them apart. With 64-bit keys the
identity is already inside the hash, which would hide a missing comparison. Each rule gets a
prompt with the SAME token ids as the cached one and one field changed; the same field unchanged
must reuse (so the test can tell reuse from no reuse at all).
"""

import numpy as np
import pytest
from reference_kv_cache import KvStore

from kvtool._core import CacheConfig, KVCacheManager, KvCacheEventKind

T = 4
TOKENS = list(range(10, 10 + 2 * T + 1))  # two full blocks and the last prompt token


def colliding_manager(**kwargs) -> KVCacheManager:
    config = dict(tokens_per_block=T, num_primary_blocks=16, event_buffer_max_size=64, enable_partial_reuse=False)
    config.update(kwargs)
    return KVCacheManager(CacheConfig(**config), key_hash_bits=0)


def compute(manager, seq_id, tokens, kv: KvStore, identity, **spec):
    """A request's context: adds it, checks every reused position holds this request's own KV
    (``identity`` names what must have produced it), writes the rest, marks it computed."""
    result = manager.add_sequence(seq_id, np.asarray(tokens, dtype=np.int32), len(tokens), **spec)
    kv.apply(manager.take_copy_ops())
    table = manager.block_ids(seq_id)
    for j in range(result.num_reused_tokens):
        assert kv.read(int(table[j // T]), j % T) == (identity, tuple(tokens[: j + 1])), f"position {j} is another prompt's KV"
    for j in range(result.num_reused_tokens, len(tokens)):
        kv.write(int(table[j // T]), j % T, (identity, tuple(tokens[: j + 1])))
    manager.mark_computed(seq_id, len(tokens))
    return result


def cached_then_asked(stored: dict, asked: dict, **config):
    """Caches TOKENS under ``stored``; returns (reused blocks asking with ``asked``, with ``stored``)."""
    m = colliding_manager(**config)
    kv = KvStore(T)
    compute(m, 1, TOKENS, kv, "stored", **stored)
    m.release(1)
    assert {e.block_hash for e in m.take_events() if e.kind == KvCacheEventKind.STORED} == {0}  # really colliding
    other = compute(m, 2, TOKENS, kv, "asked", **asked)
    m.release(2)
    same = compute(m, 3, TOKENS, kv, "stored", **stored)
    assert m.check_invariants() == []
    return other.num_reused_blocks, same.num_reused_blocks


@pytest.mark.parametrize("stored_salt,asked_salt", [(1, 2), (1, 0), (0, 7)])
def test_colliding_keys_with_equal_tokens_and_another_cache_salt_never_reuse(stored_salt, asked_salt):
    other, same = cached_then_asked(dict(cache_salt=stored_salt), dict(cache_salt=asked_salt))
    assert (other, same) == (0, 2)


@pytest.mark.parametrize("stored_lora,asked_lora", [(1, 2), (1, 0), (0, 3)])
def test_colliding_keys_with_equal_tokens_and_another_lora_task_never_reuse(stored_lora, asked_lora):
    other, same = cached_then_asked(dict(lora_task_id=stored_lora), dict(lora_task_id=asked_lora))
    assert (other, same) == (0, 2)


@pytest.mark.parametrize("stored_extra,asked_extra", [(7, 8), (7, None), (None, 7)],
                         ids=["other-extra-ids", "extra-ids-vs-none", "none-vs-extra-ids"])
def test_colliding_keys_with_equal_tokens_and_other_extra_ids_never_reuse(stored_extra, asked_extra):
    def extra_ids(value):  # a multimodal item in the first block: its positions carry the item's id
        return None if value is None else np.array([value] * T + [0] * (len(TOKENS) - T), dtype=np.uint64)

    other, same = cached_then_asked(dict(extra_ids=extra_ids(stored_extra)), dict(extra_ids=extra_ids(asked_extra)))
    assert (other, same) == (0, 2)


def test_colliding_keys_with_equal_tokens_and_another_salt_never_share_a_partial_block():
    # Partial reuse looks for a cached block that starts like the next one: never another tenant's.
    other, same = cached_then_asked(dict(cache_salt=1), dict(cache_salt=2), enable_partial_reuse=True)
    assert (other, same) == (0, 2)


def test_colliding_block_with_equal_tokens_below_another_parent_is_not_reused():
    # Prompt A = [a][b], prompt B = [c][b]: B's second block has A's tokens and the same (0) hash,
    # but another parent, so its KV (attention over [c] before it) differs.
    # [c] has a cached child [d] of its own, so the lookup below [c] compares candidates.
    m = colliding_manager()
    kv = KvStore(T)
    a0, b, c0, d = (list(range(start, start + T)) for start in (10, 30, 50, 70))
    compute(m, 1, a0 + b + [1], kv, "x")
    compute(m, 2, c0 + d + [1], kv, "x")
    m.release(1)
    m.release(2)
    assert m.match_prefix(a0 + b + [1]).num_matched_blocks == 2
    assert m.match_prefix(c0 + b + [1]).num_matched_blocks == 1
    assert compute(m, 3, c0 + b + [1], kv, "x").num_reused_blocks == 1
    assert m.check_invariants() == []
