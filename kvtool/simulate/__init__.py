"""`kvtool simulate` and `kvtool calibrate`: replay a dataset through the real scheduler and KV cache
manager with the forward replaced by a step cost model, on a simulated clock."""
