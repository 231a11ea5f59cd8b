"""Tiny LoRA adapters as PEFT saves them, built here with the `peft` package over a tiny random HF
model (no hub), with B random (PEFT starts it at zero) so every adapter changes the output."""

import json
from pathlib import Path

import torch
from helpers import hf_model

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# (rank, target modules, extra LoraConfig fields) of three adapters unlike each other
KINDS = [
    (4, ["q_proj", "v_proj"], {}),
    (8, ALL, {"use_rslora": True}),
    (2, ["o_proj", "down_proj", "gate_proj"], {"rank_pattern": {"down_proj": 4}}),
]


def peft_model(arch: str, r: int, targets, seed: int, **extra):
    """(HF model wrapped by PEFT with a random adapter, the base HF model's config)."""
    from peft import LoraConfig, get_peft_model

    hf = hf_model(arch)
    config = LoraConfig(
        r=r, lora_alpha=2 * r + 1, target_modules=targets, init_lora_weights=False, **extra
    )
    torch.manual_seed(seed)
    wrapped = get_peft_model(hf, config)
    with torch.no_grad():  # B as large as A: a delta the logits show
        for name, p in wrapped.named_parameters():
            if "lora_" in name:
                p.copy_(0.3 * torch.randn_like(p))
    return wrapped.eval()


def save_adapter(wrapped, folder: Path) -> Path:
    wrapped.save_pretrained(folder)
    return folder


def adapter_folders(root: Path, arch: str = "llama3") -> list:
    """The three KINDS saved under root, each with its PEFT model: [(folder, peft model)]."""
    out = []
    for i, (r, targets, extra) in enumerate(KINDS):
        wrapped = peft_model(arch, r, targets, 100 + i, **extra)
        out.append((save_adapter(wrapped, root / f"adapter{i}"), wrapped))
    return out


def edit_config(folder: Path, **changes) -> Path:
    path = folder / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return folder
