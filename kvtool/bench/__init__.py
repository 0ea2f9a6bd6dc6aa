"""Benchmarking front end: datasets (datasets, generators, sharegpt, dataset_stats), the replay
driver (replay), metrics and CSV reports (metrics, report), a bench run (options, runner, device),
YAML scenarios and sweeps (scenario, sweep) and side-by-side comparison (compare)."""
