"""`python -m kvtool`: the kvtool command (what kvtool.bench.served_probe starts its server and client with)."""

from kvtool.cli import main

main()
