"""Tiny embedding checkpoints as sentence-transformers saves them, built here (no hub): a qwen3
base model (no output head, "Qwen3Model") whose tokenizer closes each text with <|endoftext|> as
Qwen3-Embedding's does, with the pipeline's files in the published layout (sentence-transformers
before 6: Qwen3-Embedding, gte-Qwen2) or as sentence-transformers 6 itself writes them."""

import json
import shutil
from pathlib import Path

import torch
from helpers import tiny_checkpoint

OLD_KEYS = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens")
TEXTS = [
    "hello world",
    "the quick brown fox jumps over the lazy dog " * 6,
    "fox",
    "the lazy dog, hello",
    "world " * 30,
]


def causal_folder(root: Path, special=(), context=256) -> Path:
    """A tiny qwen3 causal LM whose tokenizer appends <|endoftext|> (its post-processor)."""
    from tokenizers import Tokenizer, processors

    folder = tiny_checkpoint(root, arch="qwen3", special=special, max_position_embeddings=context)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(
        single="$A <|endoftext|>", special_tokens=[("<|endoftext|>", 0)]
    )
    tok.save(str(folder / "tokenizer.json"))
    return folder


def embedding_folder(root: Path, pooling="lasttoken", layout="published", normalize=True) -> Path:
    """The base model of causal_folder with sentence-transformers' files; layout "published" or
    "st6" (written by sentence-transformers 6, whose "message" modality renders the chat
    template)."""
    from transformers import AutoModel

    causal = causal_folder(root / "causal")
    folder = root / f"embed-{layout}-{pooling}"
    AutoModel.from_pretrained(causal, dtype=torch.float32).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(causal / name, folder / name)
    if layout == "st6":
        return _saved_by_sentence_transformers(folder, pooling, normalize)
    types = ["Transformer", "Pooling"] + ["Normalize"] * normalize
    modules = [
        {"idx": i, "name": str(i), "path": ["", "1_Pooling", "2_Normalize"][i],
         "type": f"sentence_transformers.models.{t}"}
        for i, t in enumerate(types)
    ]  # fmt: skip
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    config = {"word_embedding_dimension": 64, "include_prompt": True}
    config |= {f"pooling_mode_{k}": k == pooling for k in OLD_KEYS + ("lasttoken",)}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(config))
    (folder / "sentence_bert_config.json").write_text('{"max_seq_length": 256}')
    prompts = {"prompts": {"query": "Instruct: find\nQuery:", "document": ""}}
    (folder / "config_sentence_transformers.json").write_text(json.dumps(prompts))
    return folder


def _saved_by_sentence_transformers(folder: Path, pooling: str, normalize: bool) -> Path:
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    base = Transformer(str(folder))
    mode = {"mean_tokens": "mean", "cls_token": "cls"}.get(pooling, pooling)
    modules = [base, Pooling(base.get_embedding_dimension(), pooling_mode=mode)]
    SentenceTransformer(modules=modules + [Normalize()] * normalize).save(str(folder))
    return folder


def reference(folder: Path, texts, batch_size=8, max_len=None) -> torch.Tensor:
    """sentence-transformers' own embeddings of `texts` [n, dim], float32 (max_len: its
    max_seq_length, which truncates)."""
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(folder), device="cpu")
    if max_len:
        st.max_seq_length = max_len
    return st.encode(texts, batch_size=batch_size, convert_to_tensor=True).float()
