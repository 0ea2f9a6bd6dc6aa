"""Runs a scheduled batch: its block copies, then the forward of its requests; returns logits, or (as an
engine's executor, kvtool.runtime.assemble.Executor) the tokens sampled from them."""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import numpy as np
import torch

from kvtool.cpu_kernels import decoder as cpu_decoder
from kvtool.cpu_kernels import supported_isas
from kvtool.config import EngineConfig, KvCacheConfig
from kvtool.errors import KvtoolError
from kvtool.layers.attention_metadata import AttentionMetadata
from kvtool.layers.sampler import StepPicks, make_generator, sample, step_picks
from kvtool.runtime.assemble import PoolBudget, RuntimeLimits
from kvtool.runtime.cuda_graphs import DecodeBatch, DecodeGraphs, MixedGraphs
from kvtool.runtime.device import available_host_memory_bytes, free_device_memory_bytes
from kvtool.runtime.host_allocator import keep_freed_memory
from kvtool.runtime.kv_pool import BlockShape, KvCachePools
from kvtool.runtime.pool_sizes import PoolSizes
from kvtool.runtime.step_batch import MAX_GRAPH_TOKENS, HostStep, flatten_step
from kvtool.runtime.tier3_store import Tier3Store, run_copies


class StepRequest(NamedTuple):
    """The fields of a scheduled request that prepare() reads (the scheduler's ScheduledRequest has
    them too); for driving a runner directly: warm-up, tests."""

    token_ids: np.ndarray
    block_ids: np.ndarray
    num_cached_tokens: int
    is_context: bool
    samples: bool


class ModelRunner:
    """Owns the model and the KV pools of one engine; executes scheduled batches. The pools are created
    when the engine is assembled (``start``), sized from the memory left after the model's weights."""

    def __init__(self, model: torch.nn.Module, device: torch.device, *, kernels=None,
                 fused_kernels: bool = True, cpu_kernels_isa: str = "auto") -> None:
        """``kernels``: kvtool's CUDA KernelLibrary (None: torch's paths), which the pools' copies use.
        ``fused_kernels``: on a GPU whose attention runs on kvtool's kernels, the model's forward uses
        the fused ones too (``use_fused_kernels``, kvtool/models/llama.py). ``cpu_kernels_isa``: on a
        CPU, the instruction set of kvtool's CPU kernels (EngineConfig.cpu_kernels_isa; KvtoolError when
        this CPU does not run it)."""
        self.model = model
        self.device = device
        self.kernels = kernels
        self.fused_kernels = fused_kernels
        self.pools: KvCachePools | None = None  # set by start
        self.tokens_per_block = 0
        self.kv_caches: list[torch.Tensor] = []
        self.decode_graphs: DecodeGraphs | None = None  # set by enable_cuda_graphs
        self.mixed_graphs: MixedGraphs | None = None
        # On the CPU the model runs through kvtool's fused kernels where they apply (the ISA they
        # use, e.g. 'avx512_bf16'; None: the torch path).
        self.cpu_kernels_isa = enable_cpu_kernels(model, cpu_kernels_isa) if device.type == "cpu" else None
        if device.type == "cpu":
            keep_freed_memory()  # a prompt's activations are reused, not page-faulted in again each product
        self.tier3_store: Tier3Store | None = None  # the third tier's (use_tier3_store)

    # -- the executor of an engine (kvtool.runtime.assemble.Executor) ----------------------------
    def pool_budget(self, kv_cache_config: KvCacheConfig) -> PoolBudget:
        """The device's free memory (after the weights) for the primary pool, the host's for the host pool."""
        return PoolBudget(free_device_memory_bytes(self.device), available_host_memory_bytes(),
                          on_cpu=self.device.type == "cpu")

    def start(self, shape: BlockShape, pool_sizes: PoolSizes, config: EngineConfig, limits: RuntimeLimits) -> None:
        """Creates the pools, warms up, and on a GPU captures the CUDA graphs (unless config.enforce_eager)."""
        self.tokens_per_block = shape.tokens_per_block
        self.pools = KvCachePools(shape, pool_sizes.num_primary_blocks, pool_sizes.num_secondary_blocks, self.device,
                                  self.kernels, layered_copy_min_bytes=config.kv_cache_config.layered_copy_min_bytes,
                                  cuda_graphs=config.cuda_graphs)
        self.kv_caches = self.pools.layer_caches()
        library = fused_kernel_library(self.model, self.kv_caches[0]) if self.fused_kernels else None
        if library is not None:
            self.model.use_fused_kernels(library)
        self.warm_up(min(limits.max_num_tokens, limits.max_seq_len - 1, 4 * self.tokens_per_block))
        if config.cuda_graphs and graphs_can_capture(self.model, self.kv_caches[0]):
            self.enable_cuda_graphs(limits.max_batch_size, limits.max_seq_len, limits.max_num_tokens)

    def use_tier3_store(self, store: Tier3Store) -> None:
        """Runs the copies into and out of the third tier on ``store`` (a disk or remote store)."""
        self.tier3_store = store

    def run_copies(self, ops) -> list[int]:
        """Runs copy operations (kvtool._core.CopyOpArrays) in order, the third tier's on its store;
        returns the host blocks whose fetch from the third tier failed."""
        if self.tier3_store is None:
            self.pools.execute_copies(ops.src_pool, ops.src_block_ids, ops.dst_pool, ops.dst_block_ids,
                                      ops.num_tokens)
            return []
        return run_copies(ops, self.pools, self.tier3_store)

    def execute_step(self, batch, requests, generators) -> list[int] | None:
        """Runs the batch (execute_batch) and samples a token for each of ``requests``."""
        params = [r.sampling_params for r in requests]
        picks = step_picks(params, generators)
        output = self.execute_batch(batch, picks)
        if output is None:
            return None
        if isinstance(output, np.ndarray):  # the step's own picks
            return output.tolist()
        # sample() syncs: the tokens are on the host.
        return sample(output, params, None if picks is None else picks.uniforms)

    def make_generator(self, params) -> torch.Generator | None:
        return make_generator(params)

    def enable_cuda_graphs(self, max_batch_size: int, max_seq_len: int,
                           max_num_tokens: int = MAX_GRAPH_TOKENS) -> None:
        """Replays steps from CUDA graphs (kvtool.runtime.cuda_graphs), captured now: decode steps for
        every batch-size bucket up to ``max_batch_size``, prefill / mixed steps for every token bucket
        up to min(MAX_GRAPH_TOKENS, ``max_num_tokens``)."""
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; this runner is on {self.device}")
        pool = torch.cuda.graph_pool_handle()  # one pool for every graph: they replay one at a time
        decode = DecodeGraphs(self.model, self.kv_caches, self.tokens_per_block, max_batch_size, max_seq_len,
                              self.device, pool)
        mixed = MixedGraphs(self.model, self.kv_caches, self.tokens_per_block, max_batch_size, max_seq_len,
                            max_num_tokens, self.device, pool)
        decode.capture_all()
        mixed.capture_all()
        torch.cuda.synchronize(self.device)
        self.decode_graphs, self.mixed_graphs = decode, mixed

    def prepare(self, requests) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Flattens the step's requests (kvtool.runtime.step_batch.flatten_step: multi-token context
        chunks first, then every request with one new token, which on a GPU the split-K decode kernel
        serves instead of a mostly idle context-kernel tile) and moves the metadata to the device.

        Returns input_ids [num_tokens], the attention metadata, and the row of the last token of
        each sampling request [num_sampling] (whose logits are needed), in the order of ``requests``.
        """
        return self._upload(flatten_step(requests, self.tokens_per_block))

    def _upload(self, step: HostStep) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor]:
        query_lens, seq_lens = step.query_lens, step.seq_lens
        device = self.device
        meta = AttentionMetadata(
            positions=torch.from_numpy(step.positions).to(device),
            query_start_loc=torch.from_numpy(step.query_start_loc).to(device),
            query_lens=torch.from_numpy(query_lens).to(device),
            seq_lens=torch.from_numpy(seq_lens).to(device),
            block_tables=torch.from_numpy(step.block_tables).to(device),
            slot_mapping=torch.from_numpy(step.slot_mapping).to(device),
            tokens_per_block=self.tokens_per_block,
            num_context_seqs=step.num_context_seqs,
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
            max_decode_seq_len=int(seq_lens[query_lens == 1].max(initial=0)),
        )
        input_ids = torch.from_numpy(step.input_ids).to(device)
        return input_ids, meta, torch.from_numpy(step.sample_rows).to(device)

    def warm_up(self, num_tokens: int) -> None:
        """One context step and one decode step on scratch blocks, so the first measured request
        does not pay one-time costs (allocator growth, kernel loading / compilation, thread pools).

        The blocks it writes are free: every block is written before it is read, so the scratch
        KV is never seen by a request.
        """
        tpb = self.tokens_per_block
        num_tokens = max(1, min(num_tokens, self.pools.num_primary_blocks * tpb - 1))
        block_ids = np.arange(-(-(num_tokens + 1) // tpb), dtype=np.int32)
        context = StepRequest(np.zeros(num_tokens, np.int32), block_ids, 0, True, True)
        decode = StepRequest(np.zeros(1, np.int32), block_ids, num_tokens, False, True)
        self.execute([context])
        self.execute([decode])
        self.pools.load_copy_kernel()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def execute_batch(self, batch, picks: StepPicks | None) -> torch.Tensor | np.ndarray | None:
        """Runs a kvtool._core.ScheduledBatch: its block copies, then the forward of its requests;
        returns what execute does, or None when no request was scheduled. A CPU decode step taken in one
        call returns its tokens instead, int64 [num_rows]: each row's greedy pick, or its draw as
        ``picks`` (a row each, in batch order: a decode step's rows all sample; None: all greedy) says."""
        # A step's copies never fetch from the third tier (stagings do, before the step): its ops are spills.
        self.run_copies(batch.copy_ops)
        if len(batch.requests) == 0:
            self.pools.wait_for_all_copies()  # no forward will wait for them layer by layer
            return None
        decoder = self._one_call_decoder()
        if decoder is not None:
            rows = batch.decode_rows()
            if rows is not None and decoder.decodes(len(rows.token_ids)):
                # A decode step on the CPU: the scheduler's arrays straight into one C++ call. The general
                # path (flatten_step, inference mode, the sampled rows) took ~0.2 ms of a ~7 ms step: the
                # step's weights stream leaves the host's own code and data cold, so each Python operation
                # between two steps costs several times what it costs warm (the picks too: NumPy's argmax
                # of the logits after the step, or the sampler's draws, ~0.5 ms cold).
                return decoder.decode_picks(rows.token_ids, rows.positions, rows.block_tables, self.kv_caches, picks)
        return self.execute(batch.requests)

    @torch.inference_mode()
    def execute(self, requests) -> torch.Tensor:
        """Runs the forward for the step; returns logits [num_sampling_requests, vocab] float32."""
        batch = self._graph_batch(requests)
        if batch is not None:
            logits = self.decode_graphs.run(batch)
            sampling = [i for i, r in enumerate(requests) if r.samples]
            if len(sampling) == len(requests):
                return logits
            return logits[torch.tensor(sampling, dtype=torch.int64, device=self.device)]
        try:
            step = flatten_step(requests, self.tokens_per_block)
            if self.mixed_graphs is not None and not self.pools.copies_pending_per_layer:
                layout = self.mixed_graphs.layout(step)
                if layout is not None:
                    return self.mixed_graphs.run(step, layout)
            decoder = self._one_call_decoder()
            if decoder is not None and step.num_tokens == step.num_seqs and decoder.decodes(step.num_tokens):
                # A decode step on the CPU: one C++ call from the host arrays to the logits.
                logits = decoder.decode(step.input_ids, step.positions, step.block_tables, self.kv_caches)
                return logits if step.samples_every_row else logits[torch.from_numpy(step.sample_rows)]
            input_ids, meta, sample_rows = self._upload(step)
            with self._layers_wait_for_their_copies():
                hidden = self.model(input_ids, meta, self.kv_caches)  # [num_tokens, hidden_size]
        except BaseException:
            self.pools.wait_for_all_copies()  # no copy may outlive a forward that stopped early
            raise
        # A decode step samples every row, in order: no gather (39 us of a CPU decode step).
        return self.model.compute_logits(hidden if step.samples_every_row else hidden[sample_rows])

    def _one_call_decoder(self):
        """The CPU decoder, whose ``decode`` takes a decode step in one call, or None: no CPU decoder, or a
        step whose copies land layer by layer (the layers must wait for them one at a time)."""
        decoder = getattr(self.model, "cpu_decoder", None)
        return None if decoder is None or self.pools.copies_pending_per_layer else decoder

    def _graph_batch(self, requests) -> DecodeBatch | None:
        """The step as a DecodeBatch when a captured graph can run it: one new token per request, no
        copy landing layer by layer, a batch and block tables within the graphs' sizes. Else None."""
        graphs = self.decode_graphs
        if (graphs is None or self.pools.copies_pending_per_layer or len(requests) > graphs.max_batch_size
                or any(len(r.token_ids) != 1 for r in requests)
                or max(len(r.block_ids) for r in requests) > graphs.max_blocks):
            return None
        step = flatten_step(requests, self.tokens_per_block)  # one-token rows: the requests' own order
        return DecodeBatch(input_ids=step.input_ids, positions=step.positions, seq_lens=step.seq_lens,
                           block_tables=step.block_tables, slot_mapping=step.slot_mapping)

    def _layers_wait_for_their_copies(self) -> contextlib.AbstractContextManager:
        """While a step's copies land layer by layer, each decoder layer first waits for its own. Without
        such copies (every CPU step) a plain nullcontext: a generator's context manager cost 19 us of a
        CPU decode step."""
        return self._layer_hooks() if self.pools.copies_pending_per_layer else contextlib.nullcontext()

    @contextlib.contextmanager
    def _layer_hooks(self):
        handles = [layer.register_forward_pre_hook(lambda *_, index=index: self.pools.wait_for_layer(index))
                   for index, layer in enumerate(self.model.layers)]
        # The CPU kernels' forward calls no layer module, so no hook: such a step takes the torch path
        # (copies land layer by layer only on a GPU; this keeps the rule wherever the runner is).
        cpu_decoder, self.model.cpu_decoder = self.model.cpu_decoder, None
        try:
            yield
        finally:
            self.model.cpu_decoder = cpu_decoder
            for handle in handles:
                handle.remove()


def enable_cpu_kernels(model: torch.nn.Module, isa: str) -> str | None:
    """Runs the model's forward through kvtool's CPU kernels in ``isa`` ('auto': the best this CPU runs;
    'off': not at all); returns the instruction set in use, None for the torch path."""
    if isa == "off":
        return None
    if isa != "auto" and isa not in supported_isas():
        raise KvtoolError(f"--cpu_kernels_isa {isa}: this CPU does not run kvtool's {isa} kernels; it runs "
                          f"{', '.join(supported_isas())} (or give auto, or off for torch's ops)")
    reason = cpu_decoder.unsupported_reason(model)
    if isa != "auto" and reason is not None:
        raise KvtoolError(f"--cpu_kernels_isa {isa}: kvtool's CPU kernels cannot run this model ({reason}); give "
                          "auto or off")
    return cpu_decoder.enable(model, isa=isa)


def graphs_can_capture(model: torch.nn.Module, kv_cache: torch.Tensor) -> bool:
    """Steps are captured on kvtool's CUDA kernels only: the torch fallback (other head dims, float32
    caches) reads sequence lengths on the host, which a graph cannot replay."""
    if kv_cache.device.type != "cuda":
        return False
    from kvtool.layers.cuda_attention import CudaPagedAttention  # noqa: PLC0415 - GPU only

    backend = model.layers[0].attention.backend
    return isinstance(backend, CudaPagedAttention) and backend.supports(kv_cache)


def fused_kernel_library(model: torch.nn.Module, kv_cache: torch.Tensor):
    """The KernelLibrary the model's fused forward would use, or None where it does not apply: on a
    CUDA device whose attention runs on kvtool's kernels (CudaPagedAttention, a cache it supports) with
    the cache in the model's own dtype, and hidden / intermediate sizes of whole 16-byte vectors."""
    if kv_cache.device.type != "cuda" or not hasattr(model, "use_fused_kernels"):
        return None
    from kvtool.layers.cuda_attention import CudaPagedAttention  # noqa: PLC0415 - GPU only

    backend = model.layers[0].attention.backend
    config = model.config
    if (not isinstance(backend, CudaPagedAttention) or not backend.supports(kv_cache)
            or model.embed_tokens.weight.dtype != kv_cache.dtype
            or config.hidden_size % 8 or config.intermediate_size % 8):
        return None
    return backend.library
