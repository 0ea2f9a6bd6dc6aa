"""Benchmark runs: a dataset replayed through a target (target: kvtool.LLM, a simulation's SimulatedLLM, or
a server over HTTP: endpoint, http_stream) by the replay and one run (replay, runner), the pre-check of every
request (precheck), YAML scenarios and sweeps (scenario, sweep), and `kvtool explain`'s simulated what-ifs
(explain). Datasets are kvtool.workloads'; metrics and report files kvtool.reports'."""
