"""The house's floors (docs/files.md): files import only downward, the core never from a folder,
nothing imports in a circle, and each core file still works when copied alone (with what it
imports) into another project."""

import ast
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The places, lowest first: the root's core, then each folder. A file imports only files on lower
# floors of its own place and files of lower places (docs/files.md prints these floors).
PLACES = ["", "formats", "speedups", "server", "cli"]
ENTRY = [
    "generate",
    "batch",
    "serve",
    "perplexity",
]  # on top of everything: they wire the parts together
FLOORS = {
    "": {
        1: [
            "constrain",
            "cpu_kernels",
            "moe",
            "rope",
            "runtime",
            "sampling",
            "scheduler",
            "scoring",
            "text_stream",
            "tp",
        ],
        2: ["compiling", "kv_cache", "model", "quantize", "sequence"],
        3: ["batch_invariant", "paged", "speculative", "step_layout"],
        4: ["memory"],
        5: ["engine"],
    },
    "formats": {
        1: ["chat_template", "deepseek", "gguf_file", "lora_files", "quant_files", "quant_groups"],
        2: [
            "checkpoint_checks",
            "families",
            "fuse_layers",
            "gguf_config",
            "hf_quant",
            "mxfp4",
            "pooling",
        ],
        3: ["gguf_tokenizer", "gguf_weights"],
        4: ["tokenizer", "weights"],
        5: ["hf_folder"],
    },
    "speedups": {
        1: [
            "cuda_graphs",
            "kv_int8",
            "kv_tier",
            "kv_window",
            "lora",
            "paged_flex",
            "prompt_lookup",
        ],
        2: ["aot_export", "draft_model", "kv_disk"],
        3: ["aot"],
    },
    "server": {
        1: [
            "constraint_check",
            "engine_flags",
            "engine_loop",
            "harmony",
            "one_process",
            "tool_calls",
            "tp_link",
        ],
        2: ["choices", "openai_format", "tp_engine"],
        3: ["adapters", "delivery", "response_items", "server_limits"],
        4: ["completions", "embeddings", "info_routes", "responses"],
    },
    "cli": {1: ["generate_flags"], 2: ["speculate"]},
}


def module(place: str, name: str) -> str:
    return f"{place}.{name}" if place else name


FLOOR = {
    module(p, n): floor
    for p, floors in FLOORS.items()
    for floor, names in floors.items()
    for n in names
}
ORDER = list(FLOOR) + ENTRY
TORCH_ONLY = {
    "runtime",
    "compiling",
    "cpu_kernels",
    "rope",
    "moe",
    "model",
    "sampling",
    "tp",
    "scheduler",
}
NO_TORCH = {"scheduler", "text_stream"}  # host bookkeeping only: the standard library
STDLIB = set(sys.stdlib_module_names)


def place_of(name: str) -> str:
    return name.split(".")[0] if "." in name else ""


def path_of(name: str) -> str:
    return os.path.join(ROOT, *name.split(".")) + ".py"


def imports(path: str, top_only: bool = False) -> set:
    """Modules a file imports ("formats.weights" for `from formats import weights`), leaving out
    its command line: the body of `main()` and of `if __name__ == "__main__":` (a CLI's main may
    import anything). top_only: only what it imports when it is imported, not what a function
    imports where an option is used."""
    tree = ast.parse(open(path).read())
    found = set()

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef) and (child.name == "main" or top_only):
                continue
            if isinstance(child, ast.If) and "__main__" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0:
                if child.module in PLACES[1:]:  # from formats import weights
                    found.update(f"{child.module}.{a.name}" for a in child.names)
                else:
                    found.add(child.module)
            visit(child)

    visit(tree)
    return found


def project_imports(name: str) -> set:
    return imports(path_of(name)) & set(ORDER) - {name}


def project_files() -> list:
    found = []
    for place in PLACES:
        for f in os.listdir(os.path.join(ROOT, place)):
            if f.endswith(".py") and f != "__init__.py":
                found.append(module(place, f[:-3]))
    return sorted(found)


def test_every_file_has_a_floor():
    assert set(project_files()) == set(ORDER), (
        "add new files to FLOORS (or ENTRY) and to docs/files.md"
    )


def test_the_root_holds_the_core_and_the_entry_points_only():
    root = [f for f in project_files() if "." not in f]
    assert len(root) <= 25, f"{len(root)} Python files at the root: {root}"


def test_every_python_file_parses_on_this_python():
    """Benchmarks and tests too, which nothing imports: an f-string nesting its own quotes (a
    Python 3.12 feature) once broke a benchmark on 3.11 while the suite passed."""
    bad = []
    for folder in [os.path.join(ROOT, p) for p in PLACES] + [
        os.path.join(ROOT, f) for f in ("benchmarks", "tests")
    ]:
        for f in sorted(os.listdir(folder)):
            if f.endswith(".py"):
                try:
                    ast.parse(open(os.path.join(folder, f)).read(), filename=f)
                except SyntaxError as e:
                    bad.append(
                        f"{os.path.relpath(os.path.join(folder, f), ROOT)}:{e.lineno}: {e.msg}"
                    )
    assert not bad, f"Python {sys.version.split()[0]} cannot parse:\n" + "\n".join(bad)


def allowed(name: str, dep: str) -> bool:
    """Whether file `name` may import file `dep`: the rule in docs/files.md."""
    if name in ENTRY:
        return dep not in ENTRY
    if dep in ENTRY:
        return False
    mine, theirs = PLACES.index(place_of(name)), PLACES.index(place_of(dep))
    return theirs < mine or (theirs == mine and FLOOR[dep] < FLOOR[name])


def test_files_import_only_lower_floors_and_lower_places():
    problems = []
    for name in ORDER:
        for dep in sorted(project_imports(name) & set(ORDER)):
            if not allowed(name, dep):
                where = lambda m: (
                    "entry point" if m in ENTRY else f"{place_of(m) or 'root'} floor {FLOOR[m]}"
                )
                problems.append(f"{path_of(name)} ({where(name)}) imports {dep} ({where(dep)})")
    assert not problems, "\n".join(problems)


def test_no_core_file_imports_from_a_folder():
    for names in FLOORS[""].values():
        for name in names:
            outside = {m for m in imports(path_of(name)) if m.split(".")[0] in PLACES[1:]}
            assert not outside, (
                f"{name}.py imports {outside}: a core file never imports from a folder"
            )


def test_the_file_table_prints_these_floors():
    text = open(os.path.join(ROOT, "docs", "files.md")).read()
    rows = re.findall(r"^\| (\d+|top) \| `([\w/]+)\.py` \|", text, re.M)
    table = {path.replace("/", "."): floor for floor, path in rows}
    assert table == {**{m: str(f) for m, f in FLOOR.items()}, **{m: "top" for m in ENTRY}}, (
        "docs/files.md's tables and FLOORS differ"
    )


def test_no_file_over_500_lines_and_no_function_over_60():
    """Formatted lines (the formatter's test below keeps them formatted): a file that outgrows
    500 lines is split by idea, a function over 60 into named steps."""
    problems = []
    for name in ORDER:
        text = open(path_of(name)).read()
        if text.count("\n") > 500:
            problems.append(f"{name}: {text.count(chr(10))} lines")
        long = sorted(
            node.name
            for node in ast.walk(ast.parse(text))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno >= 60
        )
        if long:
            problems.append(f"{name}: functions over 60 lines {long}")
    assert not problems, "\n".join(problems)


def test_no_line_over_100_characters():
    """ruff's E501 passes a line ending in a pragma (`# noqa`) or a single long word; this counts
    every line of every Python file, tests and benchmarks included."""
    long = []
    for folder in [os.path.join(ROOT, p) for p in PLACES] + [
        os.path.join(ROOT, f) for f in ("benchmarks", "tests")
    ]:
        for f in sorted(os.listdir(folder)):
            if f.endswith(".py"):
                lines = open(os.path.join(folder, f), encoding="utf-8").read().splitlines()
                long += [f"{f}:{i + 1}" for i, line in enumerate(lines) if len(line) > 100]
    assert not long, long


def test_the_code_is_formatted_and_lint_free():
    """ruff (pyproject.toml's settings): `ruff format --check` and `ruff check` over the project."""
    ruff = os.path.join(os.path.dirname(sys.executable), "ruff")
    for args in (["format", "--check", "."], ["check", "."]):
        proc = subprocess.run([ruff, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, (
            f"ruff {' '.join(args)}:\n{proc.stdout[-3000:]}{proc.stderr[-1000:]}"
        )


def test_the_bottom_floor_needs_only_torch():
    for name in TORCH_ONLY:
        outside = (
            {m.split(".")[0] for m in imports(path_of(name))} - STDLIB - TORCH_ONLY - {"torch"}
        )
        assert not outside, f"{name}.py imports {outside}"
    for name in NO_TORCH:
        outside = {m.split(".")[0] for m in imports(path_of(name))} - STDLIB
        assert not outside, f"{name}.py imports {outside}"


def test_no_import_cycles():
    # the floors above already rule cycles out; this names one directly if ORDER is ever loosened
    graph = {name: project_imports(name) & set(ORDER) for name in ORDER}
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
config = ModelConfig(
    vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=64
)
model = Transformer(config).eval()
"""

USES = {
    "model": (
        ["model.py", "rope.py", "moe.py", "kv_cache.py", "cpu_kernels.py"],
        TINY
        + """
from kv_cache import NoCache, StaticKVCache
tokens = torch.tensor([[1, 5, 9, 3]])
cache = StaticKVCache.for_model(model, 1, 16)
with torch.no_grad():
    full = model(tokens, torch.arange(4)[None], NoCache())
    model(tokens[:, :3], torch.arange(3)[None], cache)
    step = model(tokens[:, 3:], torch.tensor([[3]]), cache)
assert torch.allclose(step[0, -1], full[0, -1], atol=1e-5)
""",
    ),
    "cpu_kernels": (
        ["cpu_kernels.py"],
        """
import torch
import cpu_kernels
q, k, v = torch.randn(2, 1, 4, 8), torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8)
mask = torch.arange(16) <= torch.tensor([5, 15])[:, None, None, None]
sdpa = torch.nn.functional.scaled_dot_product_attention
ref = sdpa(q.transpose(1, 2), k, v, attn_mask=mask, enable_gqa=True)
for kernel in (
    cpu_kernels.static_decode, cpu_kernels.decode_attention, cpu_kernels.grouped_decode_attention
):
    assert torch.allclose(kernel(q, k, v, mask), ref.transpose(1, 2), atol=1e-5)
assert cpu_kernels.gemm_padding(130, torch.bfloat16, "cpu") == 14
""",
    ),
    "paged": (
        None,
        """
import torch
from paged import BlockAllocator, PagedKVCache
allocator = BlockAllocator(8, block_size=4)
blocks = [allocator.allocate() for _ in range(2)]
cache = PagedKVCache(1, 8, 4, 2, 8)
cache.block_tables = torch.tensor([blocks])
q, k, v = torch.randn(1, 6, 4, 8), torch.randn(1, 6, 2, 8), torch.randn(1, 6, 2, 8)
y = cache.attend(0, q, k, v, torch.arange(6)[None])
sdpa = torch.nn.functional.scaled_dot_product_attention
ref = sdpa(
    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
).transpose(1, 2)
assert torch.allclose(y, ref, atol=1e-5)
""",
    ),
    "quantize": (
        ["quantize.py", "moe.py", "cpu_kernels.py"],
        """
import torch
import quantize
torch.manual_seed(0)
w, x = torch.randn(64, 128), torch.randn(3, 128)
for mode in ("int8", "int4"):
    portable = quantize.portable_tensors(w, mode, 64)
    layer = quantize.make_layer(portable, None, mode, 64, torch.float32, "cpu")
    assert torch.allclose(layer(x), x @ layer.dequantize().T, atol=1e-3)
""",
    ),
    "speculative": (
        [
            "speculative.py",
            "model.py",
            "rope.py",
            "moe.py",
            "kv_cache.py",
            "cpu_kernels.py",
            "sampling.py",
        ],
        TINY
        + """
from kv_cache import StaticKVCache
from sampling import SamplingParams
from speculative import ModelDrafter, speculative_generate
params = SamplingParams(0.0)
prompt = [1, 5, 9, 3]
drafter = ModelDrafter(model, 32, params, layers=1)
cache = StaticKVCache.for_model(model, 1, 32)
tokens, stats = speculative_generate(
    model, cache, drafter, prompt, 10, params, 3, ignore_eos=True
)
cache, plain, pos = StaticKVCache.for_model(model, 1, 32), [], len(prompt)
with torch.no_grad():
    logits = model(torch.tensor([prompt]), torch.arange(pos)[None], cache)[0, -1]
    for _ in range(10):
        plain.append(int(logits.argmax()))
        logits = model(torch.tensor([[plain[-1]]]), torch.tensor([[pos]]), cache)[0, -1]
        pos += 1
assert tokens == plain and stats["drafted"] > 0, (tokens, plain)
""",
    ),
    "sampling": (
        ["sampling.py"],
        """
import torch
from sampling import SamplingParams, sample
logits = torch.tensor([[0.0, 5.0, 1.0]])
assert int(sample(logits, SamplingParams(0.0))) == 1
assert int(sample(logits, SamplingParams(1.0, top_k=1), torch.Generator().manual_seed(0))) == 1
""",
    ),
    "scheduler": (
        ["scheduler.py"],
        """
import sys

class Req:  # stands in for sequence.Sequence and Request: their fields, hashable by identity
    def __init__(self, **fields):
        self.__dict__.update(fields)

class Allocator:  # stands in for paged.BlockAllocator: plain counting, no prefix cache
    block_size, num_blocks, window = 4, 8, 0
    def __init__(self):
        self.ref, self.free = [0] * 8, list(range(1, 8))
    def allocate_many(self, n):
        if n > len(self.free):
            return None
        got, self.free = self.free[:n], self.free[n:]
        for b in got:
            self.ref[b] = 1
        return got
    def release(self, b):
        self.ref[b] -= 1
        if self.ref[b] == 0:
            self.free.append(b)
    def lookup_prefix(self, tokens, n, root=None):
        return [], []
    def register(self, block, parent, tokens, parent_block=None):
        return hash((parent, tuple(tokens)))
    def num_used(self):
        return 7 - len(self.free)
    def num_available(self):
        return len(self.free)

from scheduler import Scheduler
scheduler = Scheduler(Allocator(), max_num_seqs=2, max_num_batched_tokens=8)
request = lambda: Req(
    params=Req(n=1), needs_fork=False, prompt_tokens_hit=0, pools_every_token=False,
    hash_root=None,
)
seqs = [
    Req(request=request(), tokens=[1, 2, 3], num_computed=0, draft=[], blocks=[], hashes=[],
        finish_reason=None)
    for _ in range(2)
]
for s in seqs:
    scheduler.add(s)
plan = scheduler.schedule()
assert list(plan.runs.values()) == [3, 3] and not plan.copies
scheduler.update(plan, [(seqs[0], 9, None), (seqs[1], 9, "stop")])
plan = scheduler.schedule()
assert list(plan.runs.items()) == [(seqs[0], 1)] and scheduler.allocator.num_used() == 1
assert "torch" not in sys.modules
""",
    ),
    "engine": (
        None,
        TINY
        + """
from engine import Engine, Finished, RequestParams
engine = Engine.for_model(model, num_blocks=16, block_size=4)
out = engine.run_batch([[1, 5, 9], [2, 7]], RequestParams(max_new_tokens=5, temperature=0.0))
assert [len(r["tokens"]) for r in out] == [5, 5], out
""",
    ),
}


def closure(name: str) -> list:
    """name.py and every project file it imports when imported, directly or not (an option a
    function imports where it is used, such as --batch_invariant's file, is left out)."""
    todo, seen = [name], set()
    while todo:
        f = todo.pop()
        if f not in seen:
            seen.add(f)
            todo += sorted(imports(path_of(f), top_only=True) & set(ORDER))
    return [os.path.relpath(path_of(f), ROOT) for f in sorted(seen)]


@pytest.mark.parametrize("name, files, lines", [("engine", 12, 3500), ("model", 5, 1500)])
def test_a_core_file_with_what_it_imports_stays_small(name, files, lines):
    """What a reader copies to lift a core file into another project (formatted lines)."""
    copied = closure(name)
    total = sum(open(os.path.join(ROOT, f)).read().count("\n") for f in copied)
    assert len(copied) <= files and total <= lines, (
        f"{name}.py takes {len(copied)} files, {total} lines: {copied}"
    )


@pytest.mark.parametrize("name", sorted(USES))
def test_a_core_file_copied_alone_still_runs(name, tmp_path):
    files, use = USES[name]
    files = files or sorted(
        set(closure(name)) | set(closure("model") if "from model import" in use else [])
    )
    for f in files:
        (tmp_path / f).parent.mkdir(exist_ok=True)
        shutil.copy(os.path.join(ROOT, f), tmp_path / f)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(use)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"{name}.py with {files} alone:\n{proc.stderr[-3000:]}"
