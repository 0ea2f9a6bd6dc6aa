"""The LLM API, named as TensorRT-LLM's: build (or load) a plan, generate, read cache stats."""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType

import torch

from kvtool.config import EngineConfig, KvCacheConfig, SamplingParams, SchedulerConfig
from kvtool.layers.cpu_linear import pack_linears, unpacked_bfloat16_note
from kvtool.plan import BuildOptions, Plan
from kvtool.plan.kernels import plan_kernel_cache
from kvtool.plan.load import engine_plan
from kvtool.runtime.assemble import assemble_engine
from kvtool.runtime.clock import WALL_CLOCK
from kvtool.runtime.device import default_device, describe_device
from kvtool.runtime.detokenizer import IncrementalDetokenizer
from kvtool.runtime.model_runner import ModelRunner
from kvtool.runtime.request import Request

logger = logging.getLogger("kvtool")


@dataclass
class CompletionOutput:
    """One generated sequence of a request."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None


@dataclass
class GenerationOutput:
    """What generate returns per prompt: the prompt and its completion(s)."""

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    error: str | None = None
    # What ran and what happened (kvtool.runtime.request.Request): token times, reuse figures, pauses.
    # The engine forgets a request once it finishes; this is where its record stays.
    request: Request | None = field(default=None, repr=False, compare=False)


def _kernel_library(device: torch.device, kernel_cache: Path):
    """kvtool's CUDA kernels (cubins cached in the plan) when on a GPU with CuPy and a CUDA
    compiler; None otherwise: the torch paths are correct everywhere, just slower."""
    if device.type != "cuda":
        return None
    try:
        from kvtool.kernels.compiler import KernelCompiler
        from kvtool.kernels.loader import KernelLibrary, require_cupy

        require_cupy()
        library = KernelLibrary(KernelCompiler(cache_dir=kernel_cache))
        library.compiler.backends  # noqa: B018 - finds nvcc / NVRTC now, not in the middle of a step
        return library
    except ImportError:  # no CuPy, or KernelToolchainError (an ImportError too)
        return None


def _attention_backend(kernels):
    if kernels is not None:
        from kvtool.layers.cuda_attention import CudaPagedAttention

        return CudaPagedAttention(kernels)
    from kvtool.layers.attention import TorchPagedAttention

    return TorchPagedAttention()


class LLM:
    """A model served by kvtool's runtime.

    ``model`` is a plan directory (or a loaded Plan), a local Hugging Face checkpoint directory or
    ``preset:NAME``; the latter two are built into a plan on the fly (cached, see `kvtool plans`)
    with ``build_options``, the block size asked for (``kv_cache_config.tokens_per_block``) and limits
    above what those options admit. Runtime limits default to the plan's and may not exceed them.
    The engine is configured by TensorRT-LLM's keyword arguments (max_batch_size, max_seq_len,
    max_num_tokens, kv_cache_config, scheduler_config, cuda_graphs), or by one ``config`` instead.
    ``num_workload_blocks``: the most KV blocks the work ahead can create (the bench computes it from
    its dataset); a ``host_cache_size`` larger than the available memory is then accepted when those
    blocks fit. ``pool_sizes`` tells the KV pools actually created (and notes on how they were sized).
    ``cuda_graphs``: on a GPU, decode steps replay CUDA graphs captured at start-up, one per batch-size
    bucket, and prefill / mixed steps of up to 512 tokens one per token bucket
    (kvtool.runtime.cuda_graphs); False launches every kernel eagerly (vLLM's --enforce-eager).

    An LLM is also what a bench replays through (kvtool.bench.target.Target).
    """

    engine_name = "kvtool"  # what served the requests, in every report row (kvtool.reports.metrics.ENGINE)
    endpoint = None
    # Beyond the plan's, pools' and device's: on a CPU, the instruction set its kernels run (cpu_kernels).
    report_columns: Mapping[str, object] = MappingProxyType({})
    clock = WALL_CLOCK

    def __init__(self, model: str | Plan, *, max_batch_size: int | None = None, max_seq_len: int | None = None,
                 max_num_tokens: int | None = None, kv_cache_config: KvCacheConfig | None = None,
                 scheduler_config: SchedulerConfig | None = None, device: str | None = None,
                 build_options: BuildOptions | None = None, num_workload_blocks: int | None = None,
                 cuda_graphs: bool | None = None, config: EngineConfig | None = None) -> None:
        keywords = {"max_batch_size": max_batch_size, "max_seq_len": max_seq_len, "max_num_tokens": max_num_tokens,
                    "kv_cache_config": kv_cache_config, "scheduler_config": scheduler_config,
                    "cuda_graphs": cuda_graphs}
        if config is None:
            config = EngineConfig(kv_cache_config=kv_cache_config or KvCacheConfig(),
                                  scheduler_config=scheduler_config or SchedulerConfig(),
                                  max_batch_size=max_batch_size, max_num_tokens=max_num_tokens,
                                  max_seq_len=max_seq_len, enforce_eager=cuda_graphs is False)
        elif any(value is not None for value in keywords.values()):
            given = next(name for name, value in keywords.items() if value is not None)
            raise ValueError(f"LLM got both config and {given}: give the engine's configuration once (config, or "
                             "TensorRT-LLM's keyword arguments)")
        self.config = config
        self.plan = engine_plan(model, config, build_options=build_options)
        self.device = torch.device(device) if device else default_device()
        self.device_description = describe_device(self.device)
        kernels = _kernel_library(self.device, plan_kernel_cache(self.plan.path))
        # CudaPagedAttention (kvtool's kernels) on a GPU with CuPy, else TorchPagedAttention.
        self.attention_backend = _attention_backend(kernels)
        model_module = self.plan.load_model(self.device, self.attention_backend,
                                            attention_window=config.kv_cache_config.max_attention_window)
        pack_linears(model_module)  # CPU float32: decode and short chunks run ~1.5x faster (cpu_linear.py)
        note = unpacked_bfloat16_note(model_module)
        if note is not None:
            logger.warning(note)
        self.tokenizer = self.plan.tokenizer
        runner = ModelRunner(model_module, self.device, kernels=kernels, cpu_kernels_isa=config.cpu_kernels_isa)
        if self.device.type == "cpu":  # the instruction set the CPU kernels run ('auto' resolved), in every row
            self.report_columns = MappingProxyType({"cpu_kernels": runner.cpu_kernels_isa or "off"})
        self.engine, limits, self.pool_sizes = assemble_engine(self.plan, config, runner, self.clock,
                                                               num_workload_blocks=num_workload_blocks)
        self.max_batch_size, self.max_num_tokens, self.max_seq_len = limits
        self.cuda_graphs = runner.decode_graphs is not None
        self.kv_cache_config = config.kv_cache_config
        self.scheduler_config = config.scheduler_config

    # -- generation -------------------------------------------------------------------------
    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 extra_ids: Sequence[Sequence[int]] | None = None):
        """Generates for one prompt or a list (text, or token-id lists); returns output(s) in order.

        A prompt the runtime cannot serve (e.g. longer than max_seq_len) gets an output whose
        ``error`` says why; the other prompts still complete.
        """
        single = isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], int))
        prompt_list = [prompts] if single else list(prompts)
        params_list = _broadcast(sampling_params or SamplingParams(), len(prompt_list))
        extra_list = [None] * len(prompt_list) if extra_ids is None else list(extra_ids)
        results = [self._submit(p, sp, e) for p, sp, e in zip(prompt_list, params_list, extra_list)]
        by_id = {r.request_id: r for r in results if r.error is None}
        while self.engine.has_unfinished_requests():
            for request in self.engine.step():
                if request.finished and request.request_id in by_id:
                    _update(by_id[request.request_id], request)
        return results[0] if single else results

    def generate_async(self, prompt, sampling_params: SamplingParams | None = None, *,
                       extra_ids: Sequence[int] | None = None, streaming: bool = True) -> Iterator[GenerationOutput]:
        """Streams one request: yields its output each time it grows (other queued work runs too)."""
        result = self._submit(prompt, sampling_params or SamplingParams(), extra_ids)
        if result.error is not None:
            yield result
            return
        try:
            while not result.finished:
                for request in self.engine.step():
                    if request.request_id == result.request_id and (streaming or request.finished):
                        _update(result, request)
                        yield result
        except GeneratorExit:  # the caller stopped reading: the request stops too, its blocks are freed
            self.engine.abort_request(result.request_id)
            raise

    def _submit(self, prompt, params: SamplingParams, extra_ids) -> GenerationOutput:
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, token_ids = None, [int(t) for t in prompt]
        room = self.max_seq_len - len(token_ids)
        if 0 < room < params.max_tokens:
            # As TensorRT-LLM's LLM API: generate up to max_seq_len, with a warning.
            logger.warning("SamplingParams.max_tokens=%d is more than the %d tokens max_seq_len=%d leaves after the "
                           "%d-token prompt: generating at most %d", params.max_tokens, room, self.max_seq_len,
                           len(token_ids), room)
            params = replace(params, max_tokens=room)
        request = Request(token_ids, params, None if extra_ids is None else list(extra_ids),
                          detokenizer=IncrementalDetokenizer(self.tokenizer, params.stop))
        error = None
        try:
            self.engine.add_request(request)
        except ValueError as refused:
            error = str(refused)
        result = GenerationOutput(request.request_id, text, token_ids, [CompletionOutput(0, "", [], None)],
                                  error=error, finished=error is not None, request=request)
        if error is not None:
            result.outputs[0].finish_reason = "error"
        return result

    # -- stats and lifetime -----------------------------------------------------------------
    def get_stats(self) -> dict[str, int | float]:
        """KV cache statistics: reused/missed blocks, hit rate, offloaded/onboarded/evicted, bytes moved."""
        return self.engine.get_stats()

    def shutdown(self) -> None:
        """Frees the model and the KV pools; the third tier's queued spills are written first."""
        if self.engine is not None:
            self.engine.close()
        self.engine = None
        if self.device.type == "cuda":
            # The engine's reference cycles hold its pools and graphs: free them now, so that the memory
            # returns here and no later collection destroys the graphs inside another LLM's capture.
            gc.collect()
            torch.cuda.empty_cache()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _update(result: GenerationOutput, request: Request) -> None:
    """The output as the request stands: read when it finishes, or at each token when streaming (the text
    decodes incrementally: each token once over the whole request)."""
    completion = result.outputs[0]
    completion.token_ids = list(request.output_token_ids)
    completion.text = request.detokenizer.text(finished=request.finished)  # without a stop string (vLLM's)
    completion.finish_reason = request.finish_reason
    result.finished = request.finished


def _broadcast(params, n: int) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"sampling_params has {len(params)} entries for {n} prompts: give one, or one per prompt")
    return params
