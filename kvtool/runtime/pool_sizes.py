"""How big the KV pools are: the primary pool from max_tokens and the memory fraction (TensorRT-LLM's
rule), the host pool from host_cache_size; what was created is reported (PoolSizes) with notes
on how it was sized."""

from __future__ import annotations

from dataclasses import dataclass

from kvtool.errors import KvtoolError
from kvtool.units import format_byte_count, format_bytes

CPU_PRIMARY_POOL_CAP_BYTES = 256 << 20  # on a CPU, "free device memory" is host memory: cap the default


@dataclass(frozen=True)
class PoolSizes:
    """The KV pools as created (blocks of ``block_bytes``, ``tokens_per_block`` tokens each), and notes
    on how they were sized that a user should read (a limit that did not apply, ...)."""

    tokens_per_block: int
    block_bytes: int
    num_primary_blocks: int
    num_secondary_blocks: int
    notes: tuple[str, ...] = ()

    def as_row(self) -> dict[str, int]:
        """Summary columns: what a report's figures were measured with."""
        row = {}
        for tier, num_blocks in (("primary", self.num_primary_blocks), ("host", self.num_secondary_blocks)):
            row.update({f"kv_{tier}_blocks": num_blocks, f"kv_{tier}_tokens": num_blocks * self.tokens_per_block,
                        f"kv_{tier}_bytes": num_blocks * self.block_bytes})
        return row

    def describe(self, device: str) -> str:
        """One line, e.g. 'KV cache: primary 512 blocks x 32 tokens = 16,384 tokens (16.0 MiB, cpu); host off'."""
        primary = (f"primary {self.num_primary_blocks:,} blocks x {self.tokens_per_block} tokens = "
                   f"{self.num_primary_blocks * self.tokens_per_block:,} tokens "
                   f"({format_bytes(self.num_primary_blocks * self.block_bytes)}, {device})")
        host = "host off" if not self.num_secondary_blocks else (
            f"host {self.num_secondary_blocks:,} blocks = {self.num_secondary_blocks * self.tokens_per_block:,} "
            f"tokens ({format_bytes(self.num_secondary_blocks * self.block_bytes)}, allocated as blocks are offloaded)")
        return f"KV cache: {primary}; {host}"


MAX_TOKENS_FLAG, FRACTION_FLAG = "--max_tokens_in_paged_kv_cache", "--kv_cache_free_gpu_mem_fraction"


def _primary_blocks(block_bytes: int, tokens_per_block: int, max_tokens: int | None, fraction: float,
                    free_memory_bytes: int, on_cpu: bool, notes: list[str]) -> int:
    """TensorRT-LLM's rule: max_tokens, else the memory fraction's budget; the smaller when both."""
    budget_bytes = int(fraction * free_memory_bytes)
    budget_blocks = budget_bytes // block_bytes
    memory = "available host memory" if on_cpu else "free device memory"
    budget = (f"{format_byte_count(budget_bytes)}: {FRACTION_FLAG} {fraction} of the "
              f"{format_byte_count(free_memory_bytes)} of {memory}")
    block = f"one block of {tokens_per_block} tokens takes {format_byte_count(block_bytes)}"
    smaller_blocks = "or a smaller --tokens_per_block"
    if max_tokens is None:
        if on_cpu and budget_blocks * block_bytes > CPU_PRIMARY_POOL_CAP_BYTES:
            budget_blocks = CPU_PRIMARY_POOL_CAP_BYTES // block_bytes
            if budget_blocks < 1:
                # The cap, not the memory, is what leaves no room: the flag that lifts it is the fix.
                raise KvtoolError(
                    f"the KV cache gets no block: {block}, more than the {format_bytes(CPU_PRIMARY_POOL_CAP_BYTES)} "
                    f"a CPU primary pool is capped at without {MAX_TOKENS_FLAG}: give {MAX_TOKENS_FLAG} "
                    f"{tokens_per_block} or more (up to {budget_bytes // block_bytes * tokens_per_block:,} tokens "
                    f"fit in the {memory}), {smaller_blocks}")
            notes.append(f"no {MAX_TOKENS_FLAG} given: the CPU primary pool is capped at "
                         f"{format_bytes(CPU_PRIMARY_POOL_CAP_BYTES)} (give {MAX_TOKENS_FLAG} for another size)")
        num_blocks = budget_blocks
    else:
        asked_blocks = -(-max_tokens // tokens_per_block)
        asked_bytes = asked_blocks * block_bytes
        if asked_bytes > free_memory_bytes:
            there = "host memory are available" if on_cpu else "device memory are free"
            raise KvtoolError(
                f"{MAX_TOKENS_FLAG} {max_tokens:,} needs {format_byte_count(asked_bytes)} of KV cache "
                f"but only {format_byte_count(free_memory_bytes)} of {there}: choose at most "
                f"{free_memory_bytes // block_bytes * tokens_per_block:,} tokens")
        num_blocks = min(asked_blocks, budget_blocks)
        if 0 < num_blocks < asked_blocks:
            notes.append(
                f"{MAX_TOKENS_FLAG} {max_tokens:,} ({format_bytes(asked_bytes)}) is more than {FRACTION_FLAG} "
                f"{fraction} of the {format_bytes(free_memory_bytes)} of {memory} allows: the pool holds "
                f"{num_blocks * tokens_per_block:,} tokens, the smaller of the two (as in TensorRT-LLM)")
    if num_blocks < 1:
        raise KvtoolError(f"the KV cache gets no block: {block} but the budget is {budget}; raise {FRACTION_FLAG}, "
                          f"{smaller_blocks}")
    return num_blocks


def _host_blocks(block_bytes: int, tokens_per_block: int, host_cache_size: int, available_bytes: int,
                 num_workload_blocks: int | None, notes: list[str]) -> int:
    """The host pool holds ``host_cache_size`` bytes of blocks. It is allocated as blocks are offloaded,
    so the size is a limit: one larger than the memory available is accepted when the workload cannot
    fill more than what is available (``num_workload_blocks``: the most blocks it can ever create)."""
    if host_cache_size == 0:
        return 0
    flag = "--kv_host_cache_bytes"
    if host_cache_size < block_bytes:
        raise KvtoolError(f"{flag} of {format_byte_count(host_cache_size)} is smaller than one KV block of "
                          f"{tokens_per_block} tokens, {format_byte_count(block_bytes)}: give at least "
                          f"{block_bytes:,} bytes, or 0 for no offloading")
    num_blocks = host_cache_size // block_bytes
    if num_blocks * block_bytes <= available_bytes:
        return num_blocks
    too_big = (f"{flag} of {format_byte_count(host_cache_size)} exceeds the {format_byte_count(available_bytes)} of "
               "host memory available")
    if num_workload_blocks is None:
        raise KvtoolError(f"{too_big}: choose at most {available_bytes:,} bytes")
    reachable = min(num_blocks, num_workload_blocks) * block_bytes
    if reachable > available_bytes:
        raise KvtoolError(f"{too_big}, and this workload can fill {format_byte_count(reachable)} of it, "
                          f"{format_byte_count(reachable - available_bytes)} more than available: choose at most "
                          f"{available_bytes:,} bytes")
    notes.append(f"--kv_host_cache_bytes {format_byte_count(host_cache_size)} is more than the "
                 f"{format_bytes(available_bytes)} of host memory "
                 f"available, but it is a limit (allocated as blocks are offloaded) and this workload can put at most "
                 f"{min(num_blocks, num_workload_blocks):,} blocks ({format_bytes(reachable)}) there: going ahead")
    return num_blocks


def size_pools(block_bytes: int, tokens_per_block: int, *, max_tokens: int | None,
               free_memory_fraction: float, free_memory_bytes: int, host_cache_size: int,
               on_cpu: bool, available_host_bytes: int, num_workload_blocks: int | None = None) -> PoolSizes:
    """The primary pool: max_tokens, else a fraction of the free memory (on a CPU: the available host
    memory, capped at 256 MiB when max_tokens is not given); the smaller of the two when both are.
    A max_tokens larger than all of that memory is an error. The host pool: host_cache_size bytes
    (see _host_blocks; on a CPU it shares the available memory with the primary pool)."""
    notes: list[str] = []
    num_primary = _primary_blocks(block_bytes, tokens_per_block, max_tokens, free_memory_fraction,
                                  free_memory_bytes, on_cpu, notes)
    host_available = available_host_bytes - (num_primary * block_bytes if on_cpu else 0)
    num_host = _host_blocks(block_bytes, tokens_per_block, host_cache_size, host_available, num_workload_blocks,
                            notes)
    return PoolSizes(tokens_per_block, block_bytes, num_primary, num_host, tuple(notes))
