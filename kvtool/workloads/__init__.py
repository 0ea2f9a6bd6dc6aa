"""Workloads: the datasets a bench or simulation replays (JSON Lines, trtllm-bench's prepared files,
ShareGPT, text), the generators that make them, and what a workload asks of a KV cache."""
