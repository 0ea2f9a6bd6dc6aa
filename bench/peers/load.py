"""The machine's load while the peers run: sampled every few seconds, the load average, the CPU
share of the benchmark's own processes and that of every other process (other users of the
machine). A variant during which other processes took more than OTHER_CPU_LIMIT_PCT of the CPU on
average is flagged: its timings are not the machine's.
"""

from __future__ import annotations

import os
import threading
import time

OTHER_CPU_LIMIT_PCT = 25.0


class LoadSampler:
    """Samples the machine every ``interval_s``; ``variant`` names what runs (set by the caller)."""

    def __init__(self, interval_s: float = 2.0) -> None:
        self.interval_s = interval_s
        self.samples: list[dict] = []
        self.variant = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        ticks_per_s = os.sysconf("SC_CLK_TCK")
        num_cpus = os.cpu_count() or 1
        previous = (time.monotonic(), _cpu_busy_ticks(), _tree_ticks(os.getpid()))
        while not self._stop.wait(self.interval_s):
            now = (time.monotonic(), _cpu_busy_ticks(), _tree_ticks(os.getpid()))
            capacity = (now[0] - previous[0]) * ticks_per_s * num_cpus
            busy = 100.0 * (now[1] - previous[1]) / capacity
            ours = 100.0 * max(0, now[2] - previous[2]) / capacity
            self.samples.append({"at": time.strftime("%Y-%m-%dT%H:%M:%S"), "variant": self.variant,
                                 "loadavg_1m": os.getloadavg()[0], "cpu_busy_pct": round(busy, 1),
                                 "cpu_benchmark_pct": round(min(ours, busy), 1),
                                 "cpu_other_pct": round(max(0.0, busy - ours), 1)})
            previous = now


def other_cpu_pct(samples: list[dict]) -> float | None:
    """Mean CPU share of other processes over the samples (None without samples)."""
    return round(sum(s["cpu_other_pct"] for s in samples) / len(samples), 1) if samples else None


def is_loaded(samples: list[dict]) -> bool:
    share = other_cpu_pct(samples)
    return share is not None and share > OTHER_CPU_LIMIT_PCT


def machine_is_quiet(seconds: float = 10.0) -> tuple[bool, float]:
    """Whether other processes took at most OTHER_CPU_LIMIT_PCT of the CPU over the next ``seconds``
    (nothing of ours runs meanwhile), and that share."""
    ticks_per_s, num_cpus = os.sysconf("SC_CLK_TCK"), os.cpu_count() or 1
    start, busy = time.monotonic(), _cpu_busy_ticks()
    time.sleep(seconds)
    share = 100.0 * (_cpu_busy_ticks() - busy) / ((time.monotonic() - start) * ticks_per_s * num_cpus)
    return share <= OTHER_CPU_LIMIT_PCT, round(share, 1)


def _cpu_busy_ticks() -> int:
    with open("/proc/stat") as stat:
        fields = [int(v) for v in stat.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields[:8]) - idle


def _tree_ticks(root: int) -> int:
    """CPU ticks (user + system) of ``root`` and every descendant: the live ones' own, and those of the
    ones that ended and were waited for (each process's cutime + cstime). Without the ended ones, the
    CPU a variant's process used in the sample it ended in was counted as another process's, and the
    floors probed right after the last variant were flagged as loaded in every run."""
    children: dict[int, list[int]] = {}
    ticks: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
        ticks[int(entry)] = sum(int(v) for v in fields[11:15])  # utime, stime, cutime, cstime
    total, frontier = 0, [root]
    while frontier:
        pid = frontier.pop()
        total += ticks.get(pid, 0)
        frontier.extend(children.get(pid, ()))
    return total
