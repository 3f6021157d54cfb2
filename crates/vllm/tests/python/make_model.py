"""Writes the tiny checkpoint of CONFIG (argv[1]: a directory holding its config.json, e.g.
model-mla) with weights drawn from a fixed seed into DIR (argv[2]): vLLM's dummy weights differ
between TP sizes (each rank draws its own shard), real ones are the same model at any TP size."""

import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

config_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)
torch.manual_seed(0)
config = AutoConfig.from_pretrained(config_dir)
model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
# Wider than the default init (std 0.02): distinct logits, so greedy picks are far from ties.
with torch.no_grad():
    for p in model.parameters():
        if p.dim() > 1:
            p.normal_(0.0, 0.08)
model.save_pretrained(out, safe_serialization=True)
shutil.copy(config_dir / "config.json", out / "config.json")
print(out)
