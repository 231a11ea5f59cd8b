"""Builders for test checkpoints: tiny random-weight HF folders of each supported architecture."""
import json
from pathlib import Path

import torch

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)

# One entry per architecture the model claims, each exercising its distinguishing switch.
ARCHS = {
    "llama2": dict(model_type="llama", num_key_value_heads=4),  # multi-head attention
    "llama3": dict(model_type="llama", rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}),
    "llama3.2": dict(model_type="llama", tie_word_embeddings=True, rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}),
    "llama_linear_rope": dict(model_type="llama", rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "mistral": dict(model_type="mistral", sliding_window=None),
    "tinyllama_mqa": dict(model_type="llama", num_key_value_heads=1),
    "smollm2": dict(model_type="llama", hidden_size=48, num_attention_heads=3, num_key_value_heads=1,
                    tie_word_embeddings=True, rope_theta=100000.0),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=True, rope_theta=1000000.0),
    "qwen3": dict(model_type="qwen3", head_dim=32),  # head_dim != hidden / heads, RMSNorm on q and k
    "llama_bias": dict(model_type="llama", attention_bias=True, mlp_bias=True),
}


def hf_model(arch: str, seed: int = 0):
    """A random HF transformers model of a tiny `arch` config, with every weight perturbed."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = {**TINY, **ARCHS[arch]}
    config = AutoConfig.for_model(kw.pop("model_type"), **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():  # norms around 1, everything else around 0
            p.copy_((1.0 if "norm" in name else 0.0) + 0.2 * torch.randn_like(p))
    return model.eval()


def save_hf(model, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def to_classic_config(folder: Path):
    """Rewrite config.json from the newer `rope_parameters` form to `rope_theta` + `rope_scaling`."""
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = None if rope.get("rope_type") == "default" else rope
    path.write_text(json.dumps(cfg))


def hf_reference_embedded():
    from transformers import AutoModelForCausalLM

    import weights

    path = weights.default_checkpoint()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
