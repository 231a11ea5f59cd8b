"""The house's floors: library files import only downward, nothing imports in a circle, and each
core file still works when copied alone (with the floors below it) into another project."""
import ast
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Bottom to top; a file may import only files listed before it. The first seven need only torch
# (besides it they import only each other, downward: kv_cache uses cpu_kernels).
ORDER = ["runtime", "cpu_kernels", "model", "kv_cache", "sampling", "tp", "int4_layout",
         "paged", "scoring", "constrain", "sequence", "quantize", "quant_groups", "fuse_layers", "hf_quant", "speculative", "gguf_file", "gguf_weights", "gguf_tokenizer",
         "weights", "tokenizer", "aot",
         "scheduler", "batch", "engine_loop", "tool_calls", "openai_format", "serve",
         "perplexity", "generate"]
TORCH_ONLY = {"runtime", "cpu_kernels", "model", "kv_cache", "sampling", "tp", "int4_layout"}
STDLIB = set(sys.stdlib_module_names)


def imports(path: str) -> set:
    """Top-level modules a file imports, leaving out its command line: the body of `main()` and of
    `if __name__ == "__main__":` (a CLI's main may import anything)."""
    tree = ast.parse(open(path).read())
    found = set()

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef) and child.name == "main":
                continue
            if isinstance(child, ast.If) and "__main__" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                found.update(a.name.split(".")[0] for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0:
                found.add(child.module.split(".")[0])
            visit(child)

    visit(tree)
    return found


def project_files() -> list:
    return sorted(f[:-3] for f in os.listdir(ROOT) if f.endswith(".py"))


def test_every_file_has_a_floor():
    assert set(project_files()) == set(ORDER), "add new files to ORDER at their floor"


def test_every_python_file_parses_on_this_python():
    """Benchmarks and tests too, which nothing imports: an f-string nesting its own quotes (a
    Python 3.12 feature) once broke a benchmark on 3.11 while the suite passed."""
    bad = []
    for folder in (ROOT, os.path.join(ROOT, "benchmarks"), os.path.join(ROOT, "tests")):
        for f in sorted(os.listdir(folder)):
            if f.endswith(".py"):
                try:
                    ast.parse(open(os.path.join(folder, f)).read(), filename=f)
                except SyntaxError as e:
                    bad.append(f"{os.path.relpath(os.path.join(folder, f), ROOT)}:{e.lineno}: {e.msg}")
    assert not bad, f"Python {sys.version.split()[0]} cannot parse:\n" + "\n".join(bad)


def test_library_files_import_only_downward():
    problems = []
    for name in ORDER:
        for dep in imports(os.path.join(ROOT, f"{name}.py")) & set(ORDER):
            if ORDER.index(dep) >= ORDER.index(name):
                problems.append(f"{name}.py imports {dep}.py, which is not below it")
    assert not problems, "\n".join(problems)


def test_the_bottom_floor_needs_only_torch():
    for name in TORCH_ONLY:
        outside = {m for m in imports(os.path.join(ROOT, f"{name}.py")) if m not in STDLIB | TORCH_ONLY and m != "torch"}
        assert not outside, f"{name}.py imports {outside}"


def test_no_import_cycles():
    # the floors above already rule cycles out; this names one directly if ORDER is ever loosened
    graph = {name: imports(os.path.join(ROOT, f"{name}.py")) & set(ORDER) - {name} for name in ORDER}
    state = {}

    def walk(node, path):
        state[node] = "open"
        for dep in graph[node]:
            assert state.get(dep) != "open", f"import cycle: {' -> '.join(path + [dep])}"
            if dep not in state:
                walk(dep, path + [dep])
        state[node] = "done"

    for name in ORDER:
        if name not in state:
            walk(name, [name])


TINY = """
import torch
from model import ModelConfig, Transformer
torch.manual_seed(0)
config = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=64)
model = Transformer(config).eval()
"""

USES = {
    "model": (["model.py", "kv_cache.py", "cpu_kernels.py"], TINY + """
from kv_cache import NoCache, StaticKVCache
tokens = torch.tensor([[1, 5, 9, 3]])
cache = StaticKVCache.for_model(model, 1, 16)
with torch.no_grad():
    full = model(tokens, torch.arange(4)[None], NoCache())
    model(tokens[:, :3], torch.arange(3)[None], cache)
    step = model(tokens[:, 3:], torch.tensor([[3]]), cache)
assert torch.allclose(step[0, -1], full[0, -1], atol=1e-5)
"""),
    "cpu_kernels": (["cpu_kernels.py"], """
import torch
import cpu_kernels
q, k, v = torch.randn(2, 1, 4, 8), torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8)
mask = torch.arange(16) <= torch.tensor([5, 15])[:, None, None, None]
ref = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask, enable_gqa=True)
for kernel in (cpu_kernels.static_decode, cpu_kernels.decode_attention, cpu_kernels.grouped_decode_attention):
    assert torch.allclose(kernel(q, k, v, mask), ref.transpose(1, 2), atol=1e-5)
assert cpu_kernels.gemm_padding(130, torch.bfloat16, "cpu") == 14
"""),
    "paged": (["paged.py", "kv_cache.py", "cpu_kernels.py"], """
import torch
from paged import BlockAllocator, PagedKVCache
allocator = BlockAllocator(8, block_size=4)
blocks = [allocator.allocate() for _ in range(2)]
cache = PagedKVCache(1, 8, 4, 2, 8)
cache.block_tables = torch.tensor([blocks])
q, k, v = torch.randn(1, 6, 4, 8), torch.randn(1, 6, 2, 8), torch.randn(1, 6, 2, 8)
y = cache.attend(0, q, k, v, torch.arange(6)[None])
ref = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                       is_causal=True, enable_gqa=True).transpose(1, 2)
assert torch.allclose(y, ref, atol=1e-5)
"""),
    "quantize": (["quantize.py", "int4_layout.py", "cpu_kernels.py"], """
import torch
import quantize
torch.manual_seed(0)
w, x = torch.randn(64, 128), torch.randn(3, 128)
for mode in ("int8", "int4"):
    layer = quantize.make_layer(quantize.portable_tensors(w, mode, 64), None, mode, 64, torch.float32, "cpu")
    assert torch.allclose(layer(x), x @ layer.dequantize().T, atol=1e-3)
"""),
    "speculative": (["speculative.py", "model.py", "kv_cache.py", "cpu_kernels.py", "sampling.py"], TINY + """
from kv_cache import StaticKVCache
from sampling import SamplingParams
from speculative import ModelDrafter, speculative_generate
params = SamplingParams(0.0)
prompt = [1, 5, 9, 3]
drafter = ModelDrafter(model, 32, params, layers=1)
tokens, stats = speculative_generate(model, StaticKVCache.for_model(model, 1, 32), drafter, prompt, 10, params, 3,
                                     ignore_eos=True)
cache, plain, pos = StaticKVCache.for_model(model, 1, 32), [], len(prompt)
with torch.no_grad():
    logits = model(torch.tensor([prompt]), torch.arange(pos)[None], cache)[0, -1]
    for _ in range(10):
        plain.append(int(logits.argmax()))
        logits = model(torch.tensor([[plain[-1]]]), torch.tensor([[pos]]), cache)[0, -1]
        pos += 1
assert tokens == plain and stats["drafted"] > 0, (tokens, plain)
"""),
    "sampling": (["sampling.py"], """
import torch
from sampling import SamplingParams, sample
logits = torch.tensor([[0.0, 5.0, 1.0]])
assert int(sample(logits, SamplingParams(0.0))) == 1
assert int(sample(logits, SamplingParams(1.0, top_k=1), torch.Generator().manual_seed(0))) == 1
"""),
    "scheduler": (["scheduler.py", "scoring.py", "sequence.py", "paged.py", "kv_cache.py", "cpu_kernels.py", "sampling.py",
                   "runtime.py", "model.py"], TINY + """
from scheduler import Engine, RequestParams
engine = Engine(model, num_blocks=16, block_size=4)
out = engine.generate([[1, 5, 9], [2, 7]], RequestParams(max_new_tokens=5, temperature=0.0))
assert [len(r["tokens"]) for r in out] == [5, 5], out
"""),
}


@pytest.mark.parametrize("name", sorted(USES))
def test_a_core_file_copied_alone_still_runs(name, tmp_path):
    files, use = USES[name]
    for f in files:
        shutil.copy(os.path.join(ROOT, f), tmp_path / f)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(use)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{name}.py with {files} alone:\n{proc.stderr[-3000:]}"
