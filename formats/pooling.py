"""How an embedding checkpoint turns a text into one vector, read from the files
sentence-transformers saves beside the weights (the published layout of Qwen3-Embedding and
the rest):

    modules.json               [Transformer, Pooling, Normalize]: the pipeline, in order
    1_Pooling/config.json      which token's state is the vector: the last, the first (cls), or
                               the mean over every token ("pooling_mode": "lasttoken", or the older
                               "pooling_mode_lasttoken": true, ...)
    config_sentence_transformers.json   prompts (Qwen3-Embedding's query instruction), similarity
    FILE.gguf                  llama.cpp's `{arch}.pooling_type` (1 mean, 2 cls, 3 last)
    sentence_bert_config.json  a "message" modality (sentence-transformers 6 saves one where the
                               tokenizer has a chat template): a text is embedded as a user turn

The engine pools the model's final hidden states (sequence.py: RequestParams.pooling); `finish`
does the rest: Normalize where the pipeline has it, and OpenAI's `dimensions` (Matryoshka: the
first d components, normalized again). A pipeline with anything else (a Dense projection, a
learned weighting) is refused by name rather than run wrong.

    spec = read_spec(folder)                 # or read_spec(folder, pooling="mean"): --pooling
    ids = encode_input(tokenizer, "a text")  # as sentence-transformers tokenizes it
    vectors = finish(pooled, spec.normalize, dimensions=256)

    python -m formats.pooling FOLDER         # what a folder's files say
"""

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from runtime import CheckpointError
from sequence import POOLINGS

# 1_Pooling/config.json's modes -> sequence.py's names; the rest (max, weighted mean) are refused
MODES = {
    "lasttoken": "last",
    "mean_tokens": "mean",
    "mean": "mean",
    "cls_token": "cls",
    "cls": "cls",
}
KNOWN_MODULES = ("Transformer", "Pooling", "Normalize")
GGUF_POOLING = {1: "mean", 2: "cls", 3: "last"}  # llama.cpp's pooling types (0: none, 4: rank)


@dataclass
class Spec:
    pooling: str  # "last", "mean" or "cls" (sequence.POOLINGS)
    normalize: bool  # unit length, as the Normalize module makes it
    prompts: dict = field(default_factory=dict)  # name -> text put before an input
    source: str = "--pooling"  # where the pooling was read
    chat: bool = False  # a text is rendered as a user message by the chat template first


def read_spec(folder, pooling: str = None) -> Spec:
    """The folder's pipeline; `pooling` (a --pooling flag) overrides its Pooling module's mode and
    stands in for a folder that has none (normalized then: a GGUF file, a plain model folder).
    CheckpointError naming the file when neither says how to pool, or the pipeline has a module
    this project does not run."""
    folder = Path(folder)
    if pooling is not None and pooling not in POOLINGS:
        raise ValueError(f"--pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
    if folder.suffix == ".gguf" and pooling is None:
        return Spec(_gguf_pooling(folder), normalize=True, source=str(folder))
    modules_file = folder / "modules.json" if folder.is_dir() else None
    if modules_file is None or not modules_file.exists():
        if pooling is None:
            raise CheckpointError(
                f"{folder}: no modules.json (sentence-transformers' pipeline), so nothing says how "
                f"to pool its states into one vector; give --pooling ({', '.join(POOLINGS)})"
            )
        return Spec(pooling, normalize=True)
    modules = _json(modules_file)
    kinds = [str(m.get("type", "")).rpartition(".")[2] for m in modules]
    unknown = [k for k in kinds if k not in KNOWN_MODULES]
    if unknown:
        raise CheckpointError(
            f"{modules_file}: the pipeline has {', '.join(unknown)} after the model; this project "
            f"runs {', '.join(KNOWN_MODULES)} only"
        )
    found = None
    if "Pooling" in kinds and pooling is None:
        where = modules[kinds.index("Pooling")].get("path", "1_Pooling")
        found = _mode(folder / where / "config.json")
    if (pooling or found) is None:
        raise CheckpointError(f"{modules_file}: no Pooling module; give --pooling")
    prompts = _json(folder / "config_sentence_transformers.json", {}).get("prompts") or {}
    chat = "message" in (
        _json(folder / "sentence_bert_config.json", {}).get("modality_config") or {}
    )
    return Spec(pooling or found, "Normalize" in kinds, prompts, str(modules_file), chat)


def _gguf_pooling(path: Path) -> str:
    """A GGUF file's `{arch}.pooling_type` (llama.cpp's converter writes it for embedding models;
    llama.cpp normalizes their vectors by default, as here)."""
    from formats.gguf_file import GGUFFile

    try:
        fields = GGUFFile(path).fields
    except Exception as e:  # the loader has read it already: only a race could get here
        raise CheckpointError(f"{path}: not a readable GGUF file ({e})") from None
    arch = fields.get("general.architecture")
    kind = fields.get(f"{arch.value if arch else ''}.pooling_type")
    found = GGUF_POOLING.get(kind.value if kind else None)
    if found is None:
        said = "no pooling_type" if kind is None else f"pooling_type {kind.value}"
        raise CheckpointError(
            f"{path}: {said} (an embedding model's is 1 mean, 2 cls or 3 last); give --pooling "
            f"({', '.join(POOLINGS)})"
        )
    return found


def _mode(path: Path) -> str:
    """A Pooling module's mode in sequence.py's names, from either layout of its config."""
    config = _json(path)
    modes = [config["pooling_mode"]] if config.get("pooling_mode") else []
    modes += [k.removeprefix("pooling_mode_") for k, v in config.items() if v is True]
    modes = [m for m in modes if m != "include_prompt"]
    if len(modes) != 1 or modes[0] not in MODES:
        raise CheckpointError(
            f"{path}: pooling {modes or 'not given'}; this project pools by one of "
            f"{', '.join(sorted(set(MODES)))}"
        )
    return MODES[modes[0]]


def _json(path: Path, default=None):
    if not path.exists():
        if default is not None:
            return default
        raise CheckpointError(f"{path}: missing (named by modules.json)")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None


def encode_input(tokenizer, text: str, chat: bool = False, max_len: int = None) -> list:
    """A text's ids as sentence-transformers makes them: with the tokenizer's own special tokens
    (a BOS, or Qwen3-Embedding's closing <|endoftext|>, which its last-token pooling reads); or,
    for a "message" modality (chat), the text as a user turn through the chat template. max_len:
    the text cut to fit, its special tokens kept (as transformers truncates)."""
    if chat:
        messages = [{"role": "user", "content": text}]
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
        return tokenizer.encode_rendered(rendered, messages)[:max_len]
    hf = getattr(tokenizer.backend, "tok", None)  # a tokenizer.json: its post-processor adds them
    if hf is None:
        return tokenizer.encode(text)[:max_len]
    ids = hf.encode(text, add_special_tokens=False)
    if max_len is not None:
        ids.truncate(max(0, max_len - hf.num_special_tokens_to_add(False)))
    return hf.post_process(ids, add_special_tokens=True).ids


def finish(pooled: torch.Tensor, normalize: bool, dimensions: int = None) -> torch.Tensor:
    """pooled [n, dim] float32 -> the vectors a client gets: the first `dimensions` components
    (Matryoshka), unit length where the pipeline normalizes or dimensions cut it (OpenAI's)."""
    out = pooled[:, :dimensions] if dimensions else pooled
    if normalize or dimensions:
        out = torch.nn.functional.normalize(out, dim=-1)
    return out


if __name__ == "__main__":
    print(read_spec(sys.argv[1], *sys.argv[2:3]))
