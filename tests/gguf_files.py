"""Tiny GGUF files written with the gguf library from a tiny random transformers Llama.

The file holds what a real one does: the model's shape under llama.cpp's key names, q/k weights
in llama.cpp's rotary layout, MLP weights quantized to Q8_0 (the reference model gets their
dequantized values, so it and the file hold the same numbers), and a byte-level BPE tokenizer
with ChatML special tokens and a chat template.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Merges of frequent English pairs, in byte-level spelling (Ġ is a leading space).
MERGES = (("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("o", "n"), ("Ġ", "s"),
          ("r", "e"), ("a", "t"), ("e", "n"), ("Ġ", "w"), ("o", "r"), ("Ġ", "o"), ("e", "s"), ("i", "s"))
QUANTIZED = ("ffn_gate", "ffn_up", "ffn_down")


@dataclass
class GgufModel:
    path: Path
    model: torch.nn.Module      # transformers model holding exactly the file's (dequantized) weights
    vocab_size: int


def _byte_alphabet() -> list[str]:
    """GPT-2's printable spelling of the 256 bytes (the byte-level BPE convention)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    spelled, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            spelled[byte] = chr(byte)
        else:
            spelled[byte] = chr(256 + extra)
            extra += 1
    return [spelled[byte] for byte in range(256)]


def tokenizer_vocabulary() -> list[str]:
    return _byte_alphabet() + ["".join(pair) for pair in MERGES] + list(SPECIAL_TOKENS)


def _to_llama_cpp_rotary(weight: np.ndarray, num_heads: int) -> np.ndarray:
    # llama.cpp stores q/k rows per head as interleaved (real, imaginary) pairs; HF as two halves.
    rows = weight.shape[0]
    return (weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def write_tiny_llama_gguf(path: Path, *, seed: int = 0) -> GgufModel:
    """A 2-layer Llama (GQA, tied embeddings) with seeded random weights, written to ``path``."""
    import gguf
    from hf_checkpoints import randomize_weights
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = tokenizer_vocabulary()
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rms_norm_eps=1e-5, tie_word_embeddings=True,
                         bos_token_id=vocab.index("<|im_start|>"), eos_token_id=vocab.index("<|im_end|>"))
    config._attn_implementation = "eager"
    model = LlamaForCausalLM(config).eval()
    randomize_weights(model, seed=seed)
    model.tie_weights()

    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_name("tiny-llama-gguf")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(len(vocab))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(vocab)
    writer.add_token_types([3 if token in SPECIAL_TOKENS else 1 for token in vocab])  # 3: control
    writer.add_token_merges([f"{a} {b}" for a, b in MERGES])
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    writer.add_chat_template(CHATML_TEMPLATE)

    state = {name: tensor.detach().numpy().astype(np.float32) for name, tensor in model.state_dict().items()}
    tensors = {"token_embd.weight": state["model.embed_tokens.weight"],
               "output_norm.weight": state["model.norm.weight"]}
    hf_names = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    for layer in range(config.num_hidden_layers):
        for gguf_name, hf_name in hf_names.items():
            weight = state[f"model.layers.{layer}.{hf_name}.weight"]
            if gguf_name == "attn_q":
                weight = _to_llama_cpp_rotary(weight, config.num_attention_heads)
            elif gguf_name == "attn_k":
                weight = _to_llama_cpp_rotary(weight, config.num_key_value_heads)
            tensors[f"blk.{layer}.{gguf_name}.weight"] = weight
    with torch.no_grad():
        for name, weight in tensors.items():
            if name.split(".")[-2] in QUANTIZED:
                quantized = gguf.quants.quantize(weight, gguf.GGMLQuantizationType.Q8_0)
                writer.add_tensor(name, quantized, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
                # The reference model holds what the file holds.
                layer, kind = int(name.split(".")[1]), name.split(".")[2]
                target = model.get_parameter(f"model.layers.{layer}.{hf_names[kind]}.weight")
                dequantized = gguf.quants.dequantize(quantized, gguf.GGMLQuantizationType.Q8_0)
                target.copy_(torch.from_numpy(dequantized.reshape(weight.shape)))
            else:
                writer.add_tensor(name, weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return GgufModel(Path(path), model, len(vocab))
