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
    # Per tier: where reused blocks came from, where blocks were dropped (docs/architecture.md#kv-cache-rules).
    *((f"{tier}_hit_blocks", f"Reused blocks served from the {where}") for tier, where in (
        ("primary", "primary pool"), ("host", "host tier"), ("disk", "disk tier (staged into the host tier)"),
        ("remote", "remote tier (staged into the host tier)"))),
    *((f"{tier}_evicted_blocks", f"Cached blocks dropped from the {tier} tier") for tier in (
        "primary", "host", "disk", "remote")),
    # With a third tier only (--kv_disk_cache_dir, --kv_remote_cache): /metrics leaves out what the engine lacks.
    ("missed_evicted_disk_blocks", "Missed blocks dropped from the disk tier"),
    ("missed_evicted_remote_blocks", "Missed blocks dropped from the remote tier or gone from its store"),
    ("missed_fetch_failed_blocks", "Missed blocks whose fetch from the third tier failed"),
    ("missed_not_staged_blocks", "Missed blocks in the third tier, not staged before their request was admitted"),
    ("tier3_spilled_blocks", "Blocks spilled from the host tier to the third tier"),
    ("tier3_staged_blocks", "Blocks fetched from the third tier into the host tier"),
    ("tier3_write_failures", "Spills the third tier's store refused or lost"),
    ("tier3_lookup_failures", "Lookups the third tier's store could not answer (nothing staged)"),
    ("tier3_timeouts", "Calls to the remote store cut by its timeout"),
)
