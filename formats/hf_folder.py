"""Writing checkpoint folders in the published HF layout (config.json + model.safetensors), float
or weight-only quantized (quantize.py's format, which weights.load reads back), and the command
line that writes a quantized one:

    python quantize.py --mode int4 --groupsize 64     # the embedded model -> ./<name>-int4-g64
    python quantize.py --checkpoint some/folder --mode int8 --out int8-folder
"""

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

import moe
from formats import gguf_weights, weights
from formats.families import MIXTRAL_EXPERT
from formats.quant_files import METADATA_KEY, describe
from quantize import GROUP_SIZES, check_mode, plan, portable_tensors, quantize_int8


def hf_state_dict(model, keep_head: bool = False, skip=()) -> dict:
    """The model's tensors under HF names ("model." prefix), a tied head left out unless keep_head,
    the modules in `skip` left out; stacked experts (moe.py) one tensor per expert, as published."""
    tied, kind = model.config.tie_word_embeddings and not keep_head, _kind(model.config)
    mixtral, out = kind == "mixtral", {}
    state = {
        k: v
        for k, v in model.state_dict().items()
        if not ((k == "lm_head.weight" and tied) or k.rpartition(".")[0] in skip)
    }
    for k, v in (_gpt_oss_layout(state) if kind == "gpt_oss" else state).items():
        name, v = (k if k.startswith("lm_head.") else f"model.{k}"), v.detach().contiguous().cpu()
        if mixtral:
            name = name.replace(".mlp.", ".block_sparse_moe.")
        if (
            ".experts." in name and v.dim() == 3 and kind != "gpt_oss"
        ):  # [E, out, in] -> experts.{e}.{projection}.weight
            prefix, _, projection = name.rpartition(".")
            projection = MIXTRAL_NAMES[projection] if mixtral else projection
            out.update({f"{prefix}.{e}.{projection}.weight": w.clone() for e, w in enumerate(v)})
        else:
            out[name] = v
    return out


MIXTRAL_NAMES = {
    v: k for k, v in MIXTRAL_EXPERT.items()
}  # gate_proj -> w1, up_proj -> w3, down_proj -> w2


def _gpt_oss_layout(state: dict) -> dict:
    """gpt-oss's names and layout (families.gpt_oss_experts read back): the router as mlp.router,
    experts as x @ W, gate and up interleaved in gate_up_proj [E, dim, 2 ff] (and its bias),
    down_proj [E, ff, dim]."""
    out = {}
    for k, v in state.items():
        k = k.replace(".mlp.gate.", ".mlp.router.")
        if k.endswith(("experts.up_proj", "experts.up_proj_bias")):
            continue  # with gate_proj
        if k.endswith(("experts.gate_proj", "experts.gate_proj_bias")):
            up = state[k.replace("gate_proj", "up_proj")]
            both = torch.stack((v, up), dim=2).flatten(
                1, 2
            )  # rows (or bias entries) gate 0, up 0, gate 1, ...
            out[k.replace("gate_proj", "gate_up_proj")] = (
                both if k.endswith("_bias") else both.transpose(1, 2)
            )
        else:
            out[k] = v.transpose(1, 2) if k.endswith("experts.down_proj") else v
    return out


def _kind(a) -> str:
    """The model_type whose config.json expresses this ModelConfig."""
    gemma = a.norm_offset == 1.0
    if a.attn_sinks:
        return "gpt_oss"
    if a.moe:
        mixtral = a.moe.norm_topk_prob and not (
            a.moe.shared_expert_size or a.moe.dense_layers or a.qkv_bias
        )
        return "qwen3_moe" if a.qk_norm else "mixtral" if mixtral else "qwen2_moe"
    return (
        ("gemma3_text" if a.qk_norm else "gemma2")
        if gemma
        else "qwen3"
        if a.qk_norm
        else "qwen2"
        if a.qkv_bias and not a.o_bias
        else "mistral"
        if a.sliding_window
        else "llama"
    )


def hf_config(model) -> dict:
    """config.json for the model's family (formats/families.py reads it back to the same
    ModelConfig)."""
    a = model.config
    if a.mla:
        raise ValueError(
            "a DeepSeek model (latent attention) is not written as an HF folder here; keep the "
            "original folder (its weights load at --quantize's bits each run)"
        )
    if a.rotary_dim or (a.rope_scaling or {}).get("rope_type") == "longrope":
        raise ValueError(
            "a Phi-3 style model (partial rotary, LongRoPE) is not written as an HF folder here: "
            "Hugging Face's phi3 layout fuses q/k/v; keep the original folder or GGUF file"
        )
    if a.moe and a.qk_norm and (a.moe.shared_expert_size or a.qkv_bias):
        raise ValueError(
            "experts with q/k norms and a shared expert or q/k/v biases have no HF family here"
        )
    kind = _kind(a)
    return {
        **_common_config(model, kind),
        **_family_config(a, a.norm_offset == 1.0),
        **_experts_config(a, kind),
    }


def _experts_config(a, kind: str) -> dict:
    """The keys of Mixtral's and Qwen-MoE's experts (families.experts_of reads them)."""
    if not a.moe:
        return {}
    m = a.moe
    if kind in ("mixtral", "gpt_oss"):
        out = {
            "num_local_experts": m.n_experts,
            "num_experts_per_tok": m.n_experts_per_tok,
            "intermediate_size": m.intermediate_size,
        }
        return (
            {**out, "swiglu_limit": m.glu_limit, "swiglu_alpha": m.glu_alpha}
            if kind == "gpt_oss"
            else out
        )
    out = {
        "num_experts": m.n_experts,
        "num_experts_per_tok": m.n_experts_per_tok,
        "decoder_sparse_step": 1,
        "moe_intermediate_size": m.intermediate_size,
        "norm_topk_prob": m.norm_topk_prob,
        "mlp_only_layers": list(m.dense_layers),
    }
    if kind == "qwen2_moe":
        out.update(shared_expert_intermediate_size=m.shared_expert_size, qkv_bias=a.qkv_bias)
    return out


def _family_config(a, gemma: bool) -> dict:
    """The keys of windows and of Gemma's switches."""
    out = {}
    if a.sliding_window:
        out.update(
            sliding_window=a.sliding_window,
            use_sliding_window=True,
            layer_types=list(a.layer_types) or ["sliding_attention"] * a.n_layers,
        )
    if gemma:
        out.update(
            query_pre_attn_scalar=a.query_scale or a.head_dim,
            attn_logit_softcapping=a.attn_softcap or None,
            final_logit_softcapping=a.logit_softcap or None,
            hidden_activation="gelu_pytorch_tanh",
        )
        if a.local_rope_theta:
            out["rope_local_base_freq"] = a.local_rope_theta
    return out


# config.json's "architectures": the class transformers (and llama.cpp's converter) picks by it
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}


def _common_config(model, kind: str) -> dict:
    a = model.config
    return {
        "architectures": [ARCHITECTURES[kind]],
        "model_type": kind,
        "vocab_size": a.vocab_size,
        "hidden_size": a.dim,
        "num_hidden_layers": a.n_layers,
        "num_attention_heads": a.n_heads,
        "num_key_value_heads": a.n_kv_heads,
        "head_dim": a.head_dim,
        "intermediate_size": a.intermediate_size,
        "rms_norm_eps": a.norm_eps,
        "rope_theta": a.rope_theta,
        "rope_scaling": a.rope_scaling or None,
        "max_position_embeddings": a.max_position_embeddings,
        "tie_word_embeddings": a.tie_word_embeddings,
        "attention_bias": a.o_bias,
        "mlp_bias": a.mlp_bias,
        "torch_dtype": str(model.norm.weight.dtype).removeprefix("torch."),
    }


def save_hf_folder(model, folder) -> Path:
    """Write a model as an HF checkpoint folder (config.json + model.safetensors), e.g. to turn a
    GGUF file into a folder that Hugging Face transformers loads as plain float weights."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(hf_state_dict(model), folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(hf_config(model), indent=2))
    return folder


def save_quantized(
    model,
    folder,
    mode: str,
    groupsize: int = 64,
    head: bool = False,
    embedding: bool = False,
    tokenizer_source=None,
) -> dict:
    """Write a float model as a quantized checkpoint folder that weights.load (and so generate.py
    --checkpoint) reads (quantize.py's format). Returns the plan's report."""
    layers = plan(model, mode, groupsize, head, embedding)
    quantized = [n for n, r in layers.items() if r is None]
    experts = {n for n in quantized if isinstance(model.get_submodule(n), moe.Experts)}
    state = hf_state_dict(
        model, keep_head=bool({"lm_head", "embed_tokens"} & set(quantized)), skip=experts
    )
    for name in experts:  # model.{name}.{projection}.{weight, scales, zeros}
        state.update(_quantized_experts(model, name, mode, groupsize))
    for name in set(quantized) - experts:
        state.update(_quantized_layer(state, name, mode, groupsize))
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    meta = {"mode": mode, "groupsize": groupsize if mode == "int4" else None, "layers": quantized}
    save_file(
        state,
        folder / "model.safetensors",
        metadata={"format": "pt", METADATA_KEY: json.dumps(meta)},
    )
    (folder / "config.json").write_text(json.dumps(hf_config(model), indent=2))
    _copy_tokenizer(tokenizer_source, folder)
    report = {
        "mode": mode,
        "groupsize": meta["groupsize"],
        "quantized": quantized,
        "kept": {n: r for n, r in layers.items() if r is not None},
        "bytes_before": model.weight_bytes(),
        "bytes_after": sum(t.numel() * t.element_size() for t in state.values()),
    }
    return report


def _quantized_experts(model, name: str, mode: str, groupsize: int) -> dict:
    """The tensors of one stacked experts module (moe.py) in quantize.py's portable format:
    model.{name}.{projection}.{weight, scales, zeros}, and gpt-oss's expert biases in float."""
    experts = model.get_submodule(name)
    tensors = moe.portable(experts, lambda w: portable_tensors(w.float(), mode, groupsize))
    out = {
        f"model.{name}.{p}.{s}": t.contiguous() for p, ts in tensors.items() for s, t in ts.items()
    }
    out.update(
        {
            f"model.{name}.{b}": t.detach().float().contiguous()
            for b, t in experts.named_parameters()
            if b.endswith("_bias")
        }
    )
    return out


def _quantized_layer(state: dict, name: str, mode: str, groupsize: int) -> dict:
    """One layer's weight taken out of `state` and returned quantized: the embedding as int8 rows,
    any other layer in quantize.py's portable format ({prefix}.{weight, scales, zeros})."""
    w = state.pop(f"{name}.weight" if name == "lm_head" else f"model.{name}.weight")
    tensors = quantize_int8(w) if name == "embed_tokens" else portable_tensors(w, mode, groupsize)
    prefix = name if name == "lm_head" else f"model.{name}"
    return {f"{prefix}.{s}": t.contiguous() for s, t in tensors.items()}


def _copy_tokenizer(tokenizer_source, folder: Path):
    """The source checkpoint's tokenizer beside the weights: a GGUF's as a tensor-less GGUF file,
    a folder's tokenizer, special-tokens, generation and chat-template files copied."""
    source = Path(tokenizer_source) if tokenizer_source else None
    if source and source.is_file():  # a GGUF: keep its tokenizer as a tensor-less GGUF file
        gguf_weights.write_tokenizer_only(source, folder / "tokenizer.gguf")
    elif source:
        for f in source.iterdir():
            if f.name.startswith(
                ("tokenizer", "special_tokens", "generation_config", "chat_template")
            ):
                shutil.copy(f, folder / f.name)


def parse_args(argv):
    p = argparse.ArgumentParser(
        description="Write a weight-only quantized checkpoint folder (quantize.py's int8 or int4) "
        "that generate.py --checkpoint runs.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--checkpoint",
        default=None,
        help="HF folder, .gguf file or Hub id (default: embedded SmolLM2-135M)",
    )
    p.add_argument("--mode", required=True, help="int8 or int4")
    p.add_argument(
        "--groupsize", type=int, default=64, help=f"int4 group size, one of {GROUP_SIZES}"
    )
    p.add_argument("--quantize_head", action="store_true", help="quantize the output head too")
    p.add_argument(
        "--quantize_embedding", action="store_true", help="store the embedding table int8"
    )
    p.add_argument("--out", default=None, help="output folder (default: <checkpoint name>-<mode>)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    """python quantize.py --mode int4 [--checkpoint ...] [--out folder]"""
    args = parse_args(argv)
    try:
        check_mode(args.mode, args.groupsize)  # before the (slow) load
        model, info = weights.load(
            args.checkpoint, device="cpu", dtype=torch.float32, dequantize=True
        )
        suffix = args.mode + (f"-g{args.groupsize}" if args.mode == "int4" else "")
        out = Path(args.out or f"{Path(info.source).name.removesuffix('.gguf')}-{suffix}")
        report = save_quantized(
            model,
            out,
            args.mode,
            args.groupsize,
            args.quantize_head,
            args.quantize_embedding,
            info.source,
        )
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(describe(report).replace("weights", "checkpoint", 1), file=sys.stderr)
    print(f"wrote {out}  (run: python generate.py --checkpoint {out})", file=sys.stderr)
    return 0
