"""Loaders against files written by someone else: hypothesis mutates small valid GGUF,
safetensors, config.json and tokenizer.json files (truncation, flipped bytes, huge declared sizes,
wrong dtypes, negative shapes, duplicate names, absurd counts). Loading must either give a model
that runs or raise CheckpointError / TokenizerError with a message, quickly, without allocating
much more than the file holds. Derandomised, so a failure reproduces."""

import json
import re
import resource
import shutil
import struct
import time

import pytest
import torch
from helpers import hf_model, tiny_checkpoint, write_gguf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from formats import weights
from formats.tokenizer import load_tokenizer
from kv_cache import NoCache
from runtime import CheckpointError, TokenizerError

FUZZ = settings(
    derandomize=True,
    max_examples=25,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
SECONDS = 10  # per load
MARGIN = 300 * 2**20  # bytes of RSS growth allowed beyond the file's size


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    hf = hf_model("smollm2", num_hidden_layers=1)
    gguf = write_gguf(hf, root / "tiny.gguf")
    folder = tiny_checkpoint(root / "folder", num_hidden_layers=1)
    return root, gguf.read_bytes(), folder


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def check_load(path, size: int):
    """Loads or fails clearly, in time and in memory."""
    before, start = peak_rss(), time.perf_counter()
    try:
        model, _ = weights.load(path)
        with torch.no_grad():
            out = model(torch.tensor([[1, 2, 3]]), torch.arange(3)[None], NoCache())
        assert out.shape[-1] == model.config.vocab_size
    except CheckpointError as e:
        assert str(e)
    assert time.perf_counter() - start < SECONDS
    assert peak_rss() - before < size + MARGIN


MUTATIONS = st.one_of(
    st.tuples(st.just("truncate"), st.floats(0, 1)),
    st.tuples(st.just("flip"), st.floats(0, 1), st.integers(1, 255)),
    st.tuples(
        st.just("huge"),
        st.floats(0, 0.2),
        st.sampled_from([2**40, 2**63 - 1, 2**64 - 1, 2**32 - 1]),
    ),
    st.tuples(st.just("negative"), st.floats(0, 0.2), st.integers(-(2**31), -1)),
)


def mutate(data: bytes, mutation) -> bytes:
    kind, where, *rest = mutation
    i = int(where * (len(data) - 1))
    if kind == "truncate":
        return data[:i]
    if kind == "flip":
        return data[:i] + bytes([data[i] ^ rest[0]]) + data[i + 1 :]
    if kind == "huge":  # a declared count or size (GGUF: u64 little-endian) made enormous
        return data[:i] + struct.pack("<Q", rest[0]) + data[i + 8 :]
    return data[:i] + struct.pack("<q", rest[0]) + data[i + 8 :]


def fresh_copy(files, name: str):
    """A new copy of the valid checkpoint folder, for one example to mutate."""
    root, _, folder = files
    target = root / name
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(folder, target)
    return target


@FUZZ
@given(MUTATIONS)
def test_mutated_gguf_loads_or_fails_clearly(files, mutation):
    root, data, _ = files
    path = root / "mutated.gguf"
    path.write_bytes(mutate(data, mutation))
    check_load(path, len(data))


@FUZZ
@given(MUTATIONS)
def test_mutated_safetensors_loads_or_fails_clearly(files, mutation):
    target = fresh_copy(files, "st")
    weights_file = target / "model.safetensors"
    data = weights_file.read_bytes()
    weights_file.write_bytes(mutate(data, mutation))
    check_load(target, len(data))


@FUZZ
@given(st.data())
def test_mutated_safetensors_header_loads_or_fails_clearly(files, data):
    """The JSON header: wrong dtypes, negative or huge shapes, offsets past the end, duplicates."""
    target = fresh_copy(files, "sth")
    path = target / "model.safetensors"
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header, body = json.loads(raw[8 : 8 + n]), raw[8 + n :]
    name = data.draw(st.sampled_from(sorted(k for k in header if k != "__metadata__")))
    field = data.draw(st.sampled_from(["dtype", "shape", "data_offsets", "duplicate"]))
    value = data.draw(
        {
            "dtype": st.sampled_from(["F8", "I64", "BOOL", "X", "F64", 7]),
            "shape": st.sampled_from([[-1, 4], [2**40], [2**31, 2**31], [], [0], "x"]),
            "data_offsets": st.sampled_from([[0, 2**40], [10, 5], [-4, 8], [0, len(body) + 1]]),
            "duplicate": st.just(None),
        }[field]
    )
    if field == "duplicate":  # raw JSON with the name twice
        entry = json.dumps(header[name])
        text = json.dumps(header)[:-1] + f', "{name}": {entry}' + "}"
    else:
        header[name][field] = value
        text = json.dumps(header)
    encoded = text.encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + body)
    check_load(target, len(raw))


CONFIG_VALUES = st.sampled_from(
    [0, -1, 1, 2**40, 2**63, 1e308, float("nan"), "2", None, [], {}, True]
)


@FUZZ
@given(st.data())
def test_mutated_config_loads_or_fails_clearly(files, data):
    target = fresh_copy(files, "cfg")
    cfg = json.loads((target / "config.json").read_text())
    for _ in range(data.draw(st.integers(1, 3))):
        cfg[data.draw(st.sampled_from(sorted(cfg)))] = data.draw(CONFIG_VALUES)
    (target / "config.json").write_text(json.dumps(cfg))
    check_load(target, (target / "model.safetensors").stat().st_size)


@FUZZ
@given(st.data())
def test_mutated_tokenizer_json_loads_or_fails_clearly(files, data):
    target = fresh_copy(files, "tok")
    path = target / "tokenizer.json"
    raw = path.read_text()
    if data.draw(st.booleans()):
        text = raw[: data.draw(st.integers(0, len(raw)))]
    else:
        tok = json.loads(raw)
        section = data.draw(
            st.sampled_from(["model", "added_tokens", "pre_tokenizer", "decoder", "post_processor"])
        )
        tok[section] = data.draw(
            st.sampled_from([None, 5, "x", [], {"type": "Nope"}, {"type": "BPE", "vocab": 3}])
        )
        text = json.dumps(tok)
    path.write_text(text)
    start = time.perf_counter()
    try:
        tok = load_tokenizer(target)
        tok.decode(tok.encode("hello world"))
    except TokenizerError as e:
        assert str(e)
    assert time.perf_counter() - start < SECONDS


@pytest.mark.parametrize("dim", [2**40, 2**63])
def test_a_gguf_tensor_claiming_huge_sizes_fails_before_allocating(files, dim):
    root, data, _ = files
    name = b"token_embd.weight"
    at = data.index(name) + len(name) + 4  # then: n_dims (u32), dims (u64 each)
    path = root / "huge.gguf"
    path.write_bytes(data[:at] + struct.pack("<Q", dim) + data[at + 8 :])
    before = peak_rss()
    with pytest.raises(CheckpointError):
        weights.load(path)
    assert peak_rss() - before < len(data) + MARGIN


CRAFTED = [  # (family, config.json changes, what the error must name)
    ("gemma3", {"layer_types": ["sliding_attention"]}, "layer_types must give each of the 2"),
    ("gemma3", {"layer_types": ["sliding_attention", "nope"]}, "layer_types"),
    ("gemma3", {"sliding_window": 0}, "sliding_window must be a positive integer"),
    ("mistral_window", {"sliding_window": -8}, "sliding_window must be a positive integer"),
    ("gpt_oss", {"sliding_window": 0}, "sliding_window must be a positive integer"),
    ("qwen2_yarn", {"rope": {"factor": 0.0}}, "positive number factor"),
    ("qwen2_yarn", {"rope": {"beta_fast": -1}}, "positive number beta_fast"),
    ("qwen2_yarn", {"rope": {"attention_factor": "x"}}, "positive number attention_factor"),
    ("mixtral", {"num_experts_per_tok": 5}, "experts per token (5)"),
    ("mixtral", {"num_local_experts": 8}, "expected (8, 64)"),
    ("qwen2_moe", {"num_experts": 2}, "but the config has 2 experts"),
    ("gpt_oss", {"num_local_experts": 2}, "expected (2, 64, 32)"),
]


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    from helpers import save_hf

    root = tmp_path_factory.mktemp("crafted")
    return root, {arch: save_hf(hf_model(arch), root / arch) for arch in {c[0] for c in CRAFTED}}


@pytest.mark.parametrize("arch, change, message", CRAFTED)
def test_crafted_configs_of_the_newer_families_fail_by_name(families, arch, change, message):
    """Windows of 0 or below, layer_types that contradict the layer count, YaRN numbers that are
    not positive, expert counts the tensors or the router contradict: each a CheckpointError that
    names what is wrong (a window of -8 once loaded and ran; a negative beta_fast raised a bare
    "math domain error")."""
    root, base = families
    target = root / "case"
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(base[arch], target)
    cfg = json.loads((target / "config.json").read_text())
    rope = change.get("rope")
    if rope:  # the newer rope_parameters form, or the older rope_scaling
        key = "rope_parameters" if "rope_parameters" in cfg else "rope_scaling"
        cfg[key] = {**cfg[key], **rope}
    cfg.update({k: v for k, v in change.items() if k != "rope"})
    (target / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=re.escape(message)):
        weights.load(target)
