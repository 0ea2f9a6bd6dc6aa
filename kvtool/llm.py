"""The LLM API, named as TensorRT-LLM's: build (or load) a plan, generate, read cache stats."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from kvtool.config import KvCacheConfig, SamplingParams, SchedulerConfig
from kvtool.errors import KvtoolError
from kvtool.layers.cpu_linear import pack_linears
from kvtool.plan.kernels import plan_kernel_cache
from kvtool.plan import BuildOptions, Plan, is_built_plan, resolve_model
from kvtool.runtime.device import (available_host_memory_bytes, default_device, default_dtype, describe_device,
                                   free_device_memory_bytes)
from kvtool.runtime.detokenizer import IncrementalDetokenizer
from kvtool.runtime.engine import Engine
from kvtool.runtime.kv_pool import BlockShape, KvCachePools
from kvtool.runtime.pool_sizes import size_pools
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


def _graphs_can_capture(backend, kv_cache) -> bool:
    """Decode steps are captured on kvtool's CUDA kernels only: the torch fallback (other head dims,
    float32 caches) reads sequence lengths on the host, which a graph cannot replay."""
    if kv_cache.device.type != "cuda":
        return False
    from kvtool.layers.cuda_attention import CudaPagedAttention

    return isinstance(backend, CudaPagedAttention) and backend.supports(kv_cache)


class LLM:
    """A model served by kvtool's runtime.

    ``model`` is a plan directory (or a loaded Plan), a local Hugging Face checkpoint directory or
    ``preset:NAME``; the latter two are built into a plan on the fly (cached, see `kvtool plans`)
    with ``build_options``, ``kv_cache_config.tokens_per_block`` and limits above what those options
    admit. Runtime limits default to the plan's and may not exceed them. ``num_workload_blocks``:
    the most KV blocks the work ahead can create (the bench computes it from its dataset); a
    ``host_cache_size`` larger than the available memory is then accepted when those blocks fit.
    ``pool_sizes`` tells the KV pools actually created (and notes on how they were sized).
    ``cuda_graphs``: on a GPU, decode steps replay CUDA graphs captured at start-up, one per batch-size
    bucket, and prefill / mixed steps of up to 512 tokens one per token bucket
    (kvtool.runtime.cuda_graphs); False launches every kernel eagerly (vLLM's --enforce-eager).
    """

    def __init__(self, model: str | Plan, *, max_batch_size: int | None = None, max_seq_len: int | None = None,
                 max_num_tokens: int | None = None, kv_cache_config: KvCacheConfig | None = None,
                 scheduler_config: SchedulerConfig | None = None, device: str | None = None,
                 build_options: BuildOptions | None = None, num_workload_blocks: int | None = None,
                 cuda_graphs: bool = True) -> None:
        kv_cache_config = kv_cache_config or KvCacheConfig()
        scheduler_config = scheduler_config or SchedulerConfig()
        if not is_built_plan(model):
            build_options = on_the_fly_build_options(build_options, kv_cache_config, max_batch_size=max_batch_size,
                                                     max_seq_len=max_seq_len, max_num_tokens=max_num_tokens)
        self.plan = resolve_model(model, options=build_options)
        opts = self.plan.build_options
        self.max_batch_size = runtime_limit("max_batch_size", max_batch_size, opts.max_batch_size)
        self.max_seq_len = runtime_limit("max_seq_len", max_seq_len, opts.max_seq_len)
        self.max_num_tokens = runtime_limit("max_num_tokens", max_num_tokens, opts.max_num_tokens)
        check_against_plan(self.plan, kv_cache_config, scheduler_config)

        self.device = torch.device(device) if device else default_device()
        self.device_description = describe_device(self.device)
        config = self.plan.model_config
        kernels = _kernel_library(self.device, plan_kernel_cache(self.plan.path))
        tokens_per_block = opts.tokens_per_block
        shape = BlockShape(config.num_layers, tokens_per_block, config.num_kv_heads, config.head_dim,
                           self.plan.kv_cache_dtype)
        # CudaPagedAttention (kvtool's kernels) on a GPU with CuPy, else TorchPagedAttention.
        self.attention_backend = _attention_backend(kernels)
        model_module = self.plan.load_model(self.device, self.attention_backend,
                                            attention_window=kv_cache_config.max_attention_window)
        pack_linears(model_module)  # CPU float32: decode and short chunks run ~1.5x faster (cpu_linear.py)
        # The model's window is the smaller of its own and max_attention_window; one reaching past
        # max_seq_len never applies, and the cache manager keeps every block then.
        window = model_module.sliding_window
        window = window if window is not None and window < self.max_seq_len else None
        self.pool_sizes = size_pools(
            shape.num_bytes, tokens_per_block, max_tokens=kv_cache_config.max_tokens,
            free_memory_fraction=kv_cache_config.free_gpu_memory_fraction,
            free_memory_bytes=free_device_memory_bytes(self.device), host_cache_size=kv_cache_config.host_cache_size,
            on_cpu=self.device.type == "cpu", available_host_bytes=available_host_memory_bytes(),
            num_workload_blocks=num_workload_blocks)
        sizes = self.pool_sizes
        pools = KvCachePools(shape, sizes.num_primary_blocks, sizes.num_secondary_blocks, self.device, kernels,
                             layered_copy_min_bytes=kv_cache_config.layered_copy_min_bytes)
        self.tokenizer = self.plan.tokenizer
        runner = ModelRunner(model_module, pools, tokens_per_block, self.device)
        runner.warm_up(min(self.max_num_tokens, self.max_seq_len - 1, 4 * tokens_per_block))
        self.cuda_graphs = cuda_graphs and _graphs_can_capture(self.attention_backend, runner.kv_caches[0])
        if self.cuda_graphs:
            runner.enable_cuda_graphs(self.max_batch_size, self.max_seq_len, self.max_num_tokens)
        self.engine = Engine(
            runner, kv_cache_config.to_core(tokens_per_block=tokens_per_block,
                                            num_primary_blocks=sizes.num_primary_blocks,
                                            num_secondary_blocks=sizes.num_secondary_blocks,
                                            max_attention_window=window),
            scheduler_config.to_core(max_batch_size=self.max_batch_size, max_num_tokens=self.max_num_tokens,
                                     max_seq_len=self.max_seq_len),
            vocab_size=config.vocab_size, eos_token_ids=config.eos_token_ids, bytes_per_token=shape.bytes_per_token,
            tokenizer=self.tokenizer)
        self.kv_cache_config = kv_cache_config
        self.scheduler_config = scheduler_config

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
        """Frees the model and the KV pools."""
        self.engine = None
        if self.device.type == "cuda":
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


def runtime_limit(name: str, value: int | None, plan_value: int) -> int:
    """A runtime limit asked for (None: the plan's), refused above what the plan was built for."""
    if value is None:
        return plan_value
    if value < 1 or value > plan_value:
        raise ValueError(f"--{name} {value} is outside what the plan was built for (1..{plan_value}): "
                         f"rebuild with `kvtool build --{name} {value}` or choose at most {plan_value}")
    return value


def on_the_fly_build_options(build_options: BuildOptions | None, kv_cache_config: KvCacheConfig, *,
                             max_batch_size: int | None = None, max_seq_len: int | None = None,
                             max_num_tokens: int | None = None) -> BuildOptions:
    """What a plan built on the fly is built with: ``build_options`` (default: BuildOptions()), the
    block size KvCacheConfig asks for, and the runtime limits asked for where they exceed those options.
    Without build options, the dtype is the device's (bfloat16 on a GPU, float32 on a CPU)."""
    options = build_options or BuildOptions(dtype=default_dtype())
    wanted = kv_cache_config.tokens_per_block
    default = BuildOptions().tokens_per_block
    if wanted is not None and wanted != options.tokens_per_block and options.tokens_per_block != default:
        raise KvtoolError(f"KvCacheConfig.tokens_per_block={wanted} and BuildOptions.tokens_per_block="
                          f"{options.tokens_per_block} disagree: give the block size once")
    return options.admitting(tokens_per_block=wanted, max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                             max_num_tokens=max_num_tokens)


def check_against_plan(plan, kv_cache_config: KvCacheConfig, scheduler_config: SchedulerConfig) -> None:
    """Refuses a block size other than the plan's, and reuse or chunking a plan without paged context
    attention cannot do (an LLM and a simulation of the plan share these rules)."""
    opts = plan.build_options
    if kv_cache_config.tokens_per_block is not None and kv_cache_config.tokens_per_block != opts.tokens_per_block:
        # Only a plan the user built: a plan built on the fly gets the block size asked for.
        raise KvtoolError(
            f"--tokens_per_block {kv_cache_config.tokens_per_block} does not match the plan {plan.path}, "
            f"built with --tokens_per_block {opts.tokens_per_block}: rebuild it with "
            f"`kvtool build --tokens_per_block {kv_cache_config.tokens_per_block}`, or leave --tokens_per_block out")
    if not plan.supports_kv_reuse:
        if kv_cache_config.enable_block_reuse:
            raise KvtoolError(
                f"the plan {plan.path} was built with --use_paged_context_fmha disable, which cannot reuse "
                "KV: rebuild with --use_paged_context_fmha enable or disable reuse (--disable_kv_cache_reuse)")
        if scheduler_config.enable_chunked_context:
            raise KvtoolError(
                f"the plan {plan.path} was built with --use_paged_context_fmha disable, which cannot chunk "
                "contexts: rebuild with --use_paged_context_fmha enable or drop --enable_chunked_context")
