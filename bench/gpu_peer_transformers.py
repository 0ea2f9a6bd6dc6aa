"""A peer on the same GPU: transformers' continuous batching (``generate_batch``, paged SDPA attention) on
the same model, prompts and token ids as bench/gpu_e2e.py (issue 21, target 6).

The model is kvtool's plan (default preset:qwen3-8b, bf16: the plan `kvtool bench --model` builds here)
loaded into transformers: the fused qkv_proj / gate_up_proj tensors split back into q/k/v and
gate/up, so both engines run the very same weights. The prompts are gpu_e2e.py's (``e2e_prompts``,
same seed). One request at a time (batch 1, as gpu_e2e), greedy, each token's time taken by
transformers (``record_timestamps``):
  - TTFT of the 2,048-token shared prefix + 128-token question with prefix sharing off and on
    (``ContinuousBatchingConfig.allow_block_sharing``), medians; the ratio off / on;
  - TPOT at batch 1 of the 4,000-token prompt (33 tokens).
Rows name ``transformers`` (engine column) beside kvtool's rows of gpu_e2e.csv; kvtool must be faster.
transformers' own CUDA graphs and warm-up stay at its defaults; its switch to flash attention when
installed is turned off (the issue names ``sdpa_paged``).

    python bench/gpu_peer_transformers.py --output out/peer
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch

from gpu_e2e import (add_workload_arguments, bench_command, e2e_prompts, max_request_len, plan_build_options,
                     resolve_plan)
from gpu_reports import write_rows_csv

ENGINE = "transformers"


def paged_sdpa() -> str:
    """transformers' name for SDPA over its paged cache: ``paged|sdpa`` up to 5.2x (5.17 on the GPU image
    refuses any other), ``sdpa_paged`` where that registry entry is gone (5.24 on the CPU)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return "paged|sdpa" if "paged|sdpa" in ALL_ATTENTION_FUNCTIONS.valid_keys() else "sdpa_paged"


class PeerRow(NamedTuple):
    engine: str
    case: str
    metric: str
    value: float
    unit: str


def hf_config_dict(config) -> dict:
    """transformers config kwargs for a kvtool ModelConfig (rope_theta in both the 4.x and 5.x spellings)."""
    if config.rope_scaling is not None:
        raise ValueError(f"the peer script builds RoPE without scaling; this model has {config.rope_scaling}")
    return dict(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                intermediate_size=config.intermediate_size, num_hidden_layers=config.num_layers,
                num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
                head_dim=config.head_dim, rms_norm_eps=config.rms_norm_eps,
                max_position_embeddings=config.max_position_embeddings,
                tie_word_embeddings=config.tie_word_embeddings, attention_bias=config.attention_bias,
                rope_theta=config.rope_theta, rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
                bos_token_id=config.bos_token_id,
                eos_token_id=config.eos_token_ids[0] if config.eos_token_ids else None)


def hf_tensors(name: str, tensor: torch.Tensor, config) -> list[tuple[str, torch.Tensor]]:
    """A plan tensor as the transformers tensor(s) it came from (the inverse of kvtool.plan.builder's mapping)."""
    if not name.startswith("layers."):
        return [(name if name == "lm_head.weight" else "model." + name, tensor)]
    _, index, rest = name.split(".", 2)
    prefix = f"model.layers.{index}."
    if rest.startswith("attention.qkv_proj."):
        kind = rest.rsplit(".", 1)[1]
        q, k, v = tensor.split([config.q_size, config.kv_size, config.kv_size], dim=0)
        return [(f"{prefix}self_attn.{p}_proj.{kind}", t) for p, t in zip("qkv", (q, k, v))]
    if rest == "mlp.gate_up_proj.weight":
        gate, up = tensor.chunk(2, dim=0)
        return [(prefix + "mlp.gate_proj.weight", gate), (prefix + "mlp.up_proj.weight", up)]
    renamed = (rest.replace("input_norm", "input_layernorm").replace("post_attention_norm", "post_attention_layernorm")
               .replace("attention.", "self_attn."))
    return [(prefix + renamed, tensor)]


def load_hf_model(plan, device: str = "cuda", attn_implementation: str | None = None):
    """transformers' CausalLM for the plan's family, holding the plan's weights on ``device``: built there
    (its random init is a fraction of a second on a GPU), then every tensor copied in from the plan."""
    import transformers
    from safetensors import safe_open

    config = plan.model_config
    attn_implementation = attn_implementation or paged_sdpa()
    hf_config = transformers.AutoConfig.for_model(config.family, **hf_config_dict(config))
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(plan.dtype)
    try:
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation=attn_implementation)
    finally:
        torch.set_default_dtype(default_dtype)
    params = dict(model.named_parameters())
    filled = set()
    with torch.no_grad(), safe_open(str(plan.weights_path), framework="pt", device=device) as weights:
        for name in weights.keys():
            for hf_name, tensor in hf_tensors(name, weights.get_tensor(name), config):
                if hf_name not in params or params[hf_name].shape != tensor.shape:
                    raise RuntimeError(f"the plan's {name} has no place in transformers' model ({hf_name})")
                params[hf_name].copy_(tensor)
                filled.add(hf_name)
    missing = sorted(n for n in params if n not in filled and not (config.tie_word_embeddings and n == "lm_head.weight"))
    if missing:
        raise RuntimeError(f"the plan's weights leave transformers' {missing[:4]} unset")
    return model.eval()


def batching_config(allow_block_sharing: bool):
    """A ContinuousBatchingConfig with prefix sharing on or off (and no switch away from sdpa_paged)."""
    from transformers.generation import ContinuousBatchingConfig

    names = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    kwargs = {"allow_block_sharing": allow_block_sharing}
    if "auto_switch_to_flash" in names:
        kwargs["auto_switch_to_flash"] = False
    return ContinuousBatchingConfig(**kwargs)


def run_one(model, prompt: list[int], num_tokens: int, cb_config) -> tuple[float, float | None]:
    """(TTFT ms, TPOT ms or None) of one request through generate_batch, its manager kept for the next."""
    from transformers.generation import GenerationConfig

    generation = GenerationConfig(max_new_tokens=num_tokens, do_sample=False, eos_token_id=None)
    kwargs = dict(generation_config=generation, continuous_batching_config=cb_config, record_timestamps=True,
                  persistent_manager=True)
    accepted = inspect.signature(model.generate_batch).parameters
    kwargs = {k: v for k, v in kwargs.items() if k in accepted}
    outputs = model.generate_batch([prompt], progress_bar=False, **kwargs) if "progress_bar" in accepted else \
        model.generate_batch([prompt], **kwargs)
    (output,) = outputs.values()
    if output.error is not None:
        raise RuntimeError(f"transformers failed a request: {output.error}")
    stamps = output.timestamps
    if not stamps or len(output.generated_tokens) != num_tokens:
        raise RuntimeError(f"transformers returned {len(output.generated_tokens)} tokens and {len(stamps or [])} "
                           f"timestamps for {num_tokens}")
    ttft = (stamps[0] - output.created_time) * 1e3
    tpot = (stamps[-1] - stamps[0]) / (num_tokens - 1) * 1e3 if num_tokens > 1 else None
    return ttft, tpot


def measure(plan, *, prefix_len: int, question_len: int, long_len: int, repeats: int) -> list[PeerRow]:
    import transformers

    prompts = e2e_prompts(plan.model_config.vocab_size, prefix_len=prefix_len, question_len=question_len,
                          long_len=long_len, repeats=repeats)
    start = time.perf_counter()
    model = load_hf_model(plan)
    print(f"transformers {transformers.__version__}: {plan.model_config.family} loaded in "
          f"{time.perf_counter() - start:.1f} s", flush=True)
    rows, medians = [], {}
    spare = iter(prompts.spare_questions)
    for sharing in (False, True):
        config = batching_config(sharing)
        # Warm-ups: the longest request first (the manager sizes itself on its first call's requests),
        # then a question after the prefix (caching the prefix when sharing is on).
        run_one(model, prompts.long_prompt, 2, config)
        run_one(model, prompts.prefix + next(spare), 1, config)
        ttfts = [run_one(model, prompts.prefix + q, 1, config)[0] for q in prompts.questions]
        medians[sharing] = statistics.median(ttfts)
        rows.append(PeerRow(ENGINE, f"{prefix_len}-token shared prompt + {question_len}-token question, reuse "
                            f"{'on' if sharing else 'off'}", "median TTFT", medians[sharing], "ms"))
        print(f"{rows[-1].case}: {medians[sharing]:.2f} ms", flush=True)
        if sharing:
            tpots = [run_one(model, prompts.long_prompt, 33, config)[1] for _ in range(3)]
            rows.append(PeerRow(ENGINE, f"{long_len}-token prompt, decode", "median TPOT", statistics.median(tpots),
                                "ms"))
            print(f"{rows[-1].case}: {rows[-1].value:.2f} ms", flush=True)
        destroy = getattr(model, "destroy_cached_continuous_batching_manager", None)
        if destroy is not None:
            destroy()  # the next configuration gets its own manager and cache
    rows.append(PeerRow(ENGINE, "shared prompt: TTFT reuse off / on", "speed-up", medians[False] / medians[True],
                        "x"))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_arguments(parser)
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    try:
        import transformers
        from transformers.generation import ContinuousBatchingConfig  # noqa: F401 - continuous batching's config
    except ImportError as error:
        print(f"gpu_peer_transformers: this transformers has no continuous batching ({error}): it needs "
              "transformers 5 (generate_batch, ContinuousBatchingConfig)", file=sys.stderr)
        return 2
    options = plan_build_options(args.dtype, args.tokens_per_block,
                                 max_request_len(args.prefix_len, args.question_len, args.long_len), like_bench=True)
    plan = resolve_plan(args.model, options)
    print(f"plan {plan.path} (`{bench_command(args.model, options)}`)", flush=True)
    rows = measure(plan, prefix_len=args.prefix_len, question_len=args.question_len, long_len=args.long_len,
                   repeats=args.repeats)
    header = {"model": args.model, "dtype": plan.build_options.dtype, "attn_implementation": paged_sdpa(),
              "transformers": transformers.__version__,
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    write_rows_csv(args.output / "gpu_peer.csv", rows, header)
    print(f"reports in {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
