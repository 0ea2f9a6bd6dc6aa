"""Benchmark runs: a dataset replayed through an engine or an endpoint (replay, runner, endpoint,
http_stream), the pre-check of every request (precheck), YAML scenarios and sweeps (scenario, sweep).
Datasets are kvtool.workloads'; metrics and report files kvtool.reports'."""
