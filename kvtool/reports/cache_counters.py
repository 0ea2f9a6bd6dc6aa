"""The engine's cache counters (Engine.get_stats keys that only grow) that `kvtool serve` publishes on
/metrics and `kvtool bench --endpoint` reads back into its summary: one list for both sides."""

# (engine.get_stats() key, help); the Prometheus metric is kvtool_<key>. Counters only grow while the server runs.
COUNTERS = (
    ("reused_blocks", "Full prompt blocks found in the cache"),
    ("missed_blocks", "Full prompt blocks computed"),
    ("early_reused_blocks", "Blocks reused while the request computing them still ran"),
    ("partial_reused_blocks", "Blocks whose first tokens were copied from a cached block"),
    ("offloaded_blocks", "Blocks moved from the primary pool to host memory"),
    ("onboarded_blocks", "Blocks moved from host memory back to the primary pool"),
    ("evicted_blocks", "Cached blocks evicted"),
    ("offloaded_bytes", "KV bytes offloaded to host memory"),
    ("onboarded_bytes", "KV bytes onboarded from host memory"),
    # Why the missed blocks were missed (docs/architecture.md#kv-cache-rules): bench --endpoint sums them too.
    ("missed_never_seen_blocks", "Missed full prompt blocks seen for the first time"),
    ("missed_evicted_primary_blocks", "Missed blocks evicted from the primary pool without a host copy"),
    ("missed_evicted_host_blocks", "Missed blocks evicted from the host pool"),
    ("missed_identity_blocks", "Missed blocks cached under another cache salt, LoRA task or extra ids"),
    ("missed_partial_blocks", "Missed blocks reused partly (their first tokens copied)"),
    ("missed_last_token_blocks", "Missed blocks that were cached but hold the prompt's last token"),
    ("missed_reuse_off_blocks", "Missed blocks while block reuse is off"),
)
