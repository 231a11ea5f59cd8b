"""speedups/aot.py (--compile aot): the decode step as an AOTInductor package equals the eager step,
at every attend length and cache length one package serves, without the compiler in the process."""

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import tiny_checkpoint

import compiling
import generate
import runtime
from formats import weights
from kv_cache import StaticKVCache
from server import engine_flags
from speedups import aot, aot_export

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOAD = {
    "dtype": "float32",
    "quantize": None,
    "groupsize": 32,
    "quantize_head": False,
    "quantize_embedding": False,
    "dequantize": False,
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny-aot"), max_position_embeddings=2048)


def load(tiny, **changes):
    spec = {**LOAD, "checkpoint": str(tiny), **changes}
    model, _ = weights.load_for_inference(
        spec["checkpoint"],
        "cpu",
        runtime.DTYPES[spec["dtype"]],
        spec["quantize"],
        spec["groupsize"],
        spec["quantize_head"],
        spec["quantize_embedding"],
    )
    return model, spec


def fill(model, cache, n):
    """The cache holding n positions of a fixed random sequence."""
    torch.manual_seed(1)
    with torch.no_grad():
        compiling.prefill(
            model, cache, torch.randint(3, model.config.vocab_size, (cache.batch_size, n))
        )


# Inductor's vector width follows ATEN_CPU_CAPABILITY (runtime.inductor_vector_bits)
@pytest.mark.isa
def test_package_equals_eager_at_every_attend_and_cache_length(tiny):
    """One package pair (short: up to 1,024 attended slots, long: beyond) for every cache length:
    logits equal the eager step's, including attend length == cache length in each package. Int4
    layers: both packages read constants Inductor made (kept alive while the step lives). The
    packages check their inputs against the sizes they were built for (AOTI_RUNTIME_CHECK_INPUTS,
    conftest), so a step sent to the wrong package fails."""
    model, spec = load(tiny, quantize="int4")
    big = StaticKVCache.for_model(model, 2, 1152)
    step = aot.decode_step(model, big, spec)
    assert set(step.loaders) == {"short", "long"}
    assert all(len(own) for own in step.kept)
    for capacity, positions in (
        (1152, (3, 127, 130, 600, 1023, 1030, 1100, 1151)),
        (128, (5, 127)),
        (1025, (1024,)),
    ):
        cache = StaticKVCache.for_model(model, 2, capacity)
        fill(model, cache, positions[-1])
        for p in positions:
            L = cache.use_positions(p + 1)
            assert L >= p + 1 and (L <= 1024) == (p < 1024 or capacity <= 1024)
            token, pos = torch.tensor([[5], [9]]), torch.full((2, 1), p)
            twin = StaticKVCache.for_model(model, 2, capacity)
            twin.k, twin.v, twin.attend_len = (
                [t.clone() for t in cache.k],
                [t.clone() for t in cache.v],
                L,
            )
            with torch.no_grad():
                ours = step(model, cache, token, pos)
                eager = compiling.decode_one(model, twin, token, pos)
            torch.testing.assert_close(ours, eager, rtol=1e-4, atol=1e-4)
            for a, b in zip(
                cache.k + cache.v, twin.k + twin.v
            ):  # this step's K/V written in place alike
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert (
            cache.use_positions(positions[-1] + 1) == capacity
        )  # the last step attended the whole cache
    with pytest.raises(aot.AotError, match="another model, cache class or batch size"):
        step(
            model, StaticKVCache.for_model(model, 1, 256), torch.tensor([[5]]), torch.tensor([[3]])
        )


def test_cli_int4_tokens_equal_eager_and_second_run_loads_the_package(tiny, tmp_path):
    """generate.py --compile aot on an int4 model (the kernel's group size is a constant Inductor
    makes: recorded beside the package) with the int8 KV cache: greedy tokens equal eager's; the
    second run compiles nothing; the process never imports dynamo, sympy or Inductor's compiler."""
    argv = [
        "--checkpoint",
        str(tiny),
        "--prompt",
        "hello world the",
        "--temperature",
        "0",
        "--max_new_tokens",
        "24",
        "--ignore_eos",
        "--dtype",
        "float32",
        "--quantize",
        "int4",
        "--groupsize",
        "32",
        "--kv_cache_dtype",
        "int8",
        "--json",
    ]
    env = {**os.environ, "LLM_AOT_CACHE": str(tmp_path)}
    script = (
        "import sys, json, generate; code = generate.main(sys.argv[1:]); print(json.dumps([m for m "
        "in ('torch._dynamo', 'sympy', 'torch._inductor.compile_fx') if m in sys.modules])); "
        "sys.exit(code)"
    )

    def run(*extra):
        p = subprocess.run(
            [sys.executable, "-c", script, *argv, *extra],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
        )
        assert p.returncode == 0, p.stderr[-3000:]
        lines = p.stdout.strip().splitlines()
        return json.loads(lines[0])["tokens"], json.loads(lines[-1]), p.stderr

    eager, _, _ = run()
    first, imported, err = run("--compile", "aot")
    assert first == eager and "compiling the decode step ahead of time" in err and imported == []
    again, imported, err = run("--compile", "auto")  # the default finds the same package
    assert again == eager and "compiling" not in err and "loaded in" in err and imported == []
    folder = next(
        p for p in tmp_path.iterdir() if (p / "any.pt2").exists()
    )  # the int8 cache: one package
    own = json.loads(
        subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys, json; from safetensors.torch import load_file; "
                "print(json.dumps({k: v.tolist() for k, v in load_file(sys.argv[1]).items()}))",
                str(folder / "any.safetensors"),
            ],
            capture_output=True,
            text=True,
        ).stdout
    )
    assert 32 in own.values()  # the int4 kernel's group size, which no model tensor holds

    # a package whose recorded constants are gone is named, with what to do
    from safetensors.torch import save_file

    save_file({}, str(folder / "any.safetensors"))
    p = subprocess.run(
        [sys.executable, "generate.py", *argv, "--compile", "aot"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert (
        p.returncode == 2
        and "reads tensors this model lacks" in p.stderr
        and "delete that folder" in p.stderr
    )


def test_failed_compile_is_reported_with_its_log(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("LLM_AOT_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "/bin/false")  # Inductor's C++ compiler: every compile fails
    model, spec = load(tiny)
    with pytest.raises(aot.AotError, match=r"(?s)a C\+\+ compile failed.*build\.log.*/bin/false"):
        aot.decode_step(model, StaticKVCache.for_model(model, 1, 64), spec)
    assert not [p for p in tmp_path.rglob(".short.*")]  # the half-built files are gone


def test_default_falls_back_to_eager_with_the_reason_in_one_line(
    tiny, tmp_path, monkeypatch, capsys
):
    """--compile auto (generate.py's default): a cache folder that cannot be made, or a build that
    fails, decodes eager after one line saying why; a read-only folder holding the packages loads
    them."""
    model, spec = load(tiny, quantize="int4")
    cache = StaticKVCache.for_model(model, 2, 1152)  # the packages test_package_equals_eager built
    (tmp_path / "a-file").write_text("")
    built = os.environ["LLM_AOT_CACHE"]  # conftest's folder
    monkeypatch.setenv("LLM_AOT_CACHE", str(tmp_path / "a-file" / "aot"))
    assert aot.decode_step(model, cache, spec, fallback=True) is compiling.decode_one
    said = [
        line for line in capsys.readouterr().err.splitlines() if line.startswith("decoding eager")
    ]
    assert (
        len(said) == 1
        and "cannot write the package folder" in said[0]
        and "LLM_AOT_CACHE" in said[0]
    )

    monkeypatch.setenv("LLM_AOT_CACHE", built)
    aot.decode_step(
        model, cache, spec
    )  # the packages are there (built now if this test runs alone)
    real_open = open
    monkeypatch.setattr(
        aot,
        "open",
        lambda path, *a: (
            (_ for _ in ()).throw(PermissionError(13, "read-only"))
            if path.endswith(".lock")
            else real_open(path, *a)
        ),
        raising=False,
    )
    assert isinstance(aot.decode_step(model, cache, spec, fallback=True), aot.AotDecode)
    monkeypatch.delattr(aot, "open")

    monkeypatch.setenv("LLM_AOT_CACHE", str(tmp_path / "aot"))
    monkeypatch.setenv("CXX", "/bin/false")  # Inductor's C++ compiler: the build fails
    capsys.readouterr()
    assert (
        aot.decode_step(model, StaticKVCache.for_model(model, 1, 64), spec, fallback=True)
        is compiling.decode_one
    )
    said = [
        line for line in capsys.readouterr().err.splitlines() if line.startswith("decoding eager")
    ]
    assert len(said) == 1 and "failed (a C++ compile failed" in said[0]
    # the failure is remembered: the next default run does not build again, and says how to retry
    assert (
        aot.decode_step(model, StaticKVCache.for_model(model, 1, 64), spec, fallback=True)
        is compiling.decode_one
    )
    err = capsys.readouterr().err
    assert (
        "ahead of time (package" not in err
        and "the last build into" in err
        and "delete that folder to build again" in err
    )


def test_auto_is_the_default_and_picks_the_package_only_where_one_can_serve(monkeypatch):
    monkeypatch.delenv("LLM_COMPILE")
    assert generate.parse_args([]).compile == "auto"
    assert aot.choose(generate.parse_args([]), "cpu") == "auto"
    assert aot.choose(generate.parse_args(["--compile", "off"]), "cpu") is None
    assert aot.choose(generate.parse_args(["--compile"]), "cpu") == "jit"
    for flags, device in (
        ([], "cuda"),
        (["--cache", "paged"], "cpu"),
    ):
        assert (
            aot.choose(generate.parse_args(flags), device) is None
        )  # eager, as before, without a word
    with pytest.raises(aot.AotError, match="static KV cache"):
        aot.choose(generate.parse_args(["--compile", "aot", "--cache", "paged"]), "cpu")
    assert aot.choose(generate.parse_args(["--prompt_lookup", "2"]), "cpu") == "auto"  # verify too
    import argparse

    p = argparse.ArgumentParser()
    engine_flags.add_engine_args(p)
    assert (
        engine_flags.engine_options(p.parse_args([]))["compile"] == "auto"
    )  # batch.py and serve.py alike
    monkeypatch.setenv("LLM_COMPILE", "1")
    with pytest.raises(SystemExit, match="LLM_COMPILE='1'"):
        generate.parse_args([])


def test_aot_refusals(monkeypatch):
    args = generate.parse_args(["--compile", "aot"])
    with pytest.raises(aot.AotError, match="pass --device cpu"):
        aot.check_usable(args, "cuda")
    for flags, message in (
        (["--compile_prefill"], "--compile_prefill"),
        (["--cache", "paged"], "static KV cache"),
    ):
        with pytest.raises(aot.AotError, match=message):
            aot.check_usable(generate.parse_args(["--compile", "aot", *flags]), "cpu")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(aot.AotError, match="torchrun"):
        aot.check_usable(args, "cpu")


def test_cli_refusal_is_a_clear_error(tiny, capsys):
    assert (
        generate.main(
            [
                "--checkpoint",
                str(tiny),
                "--compile",
                "aot",
                "--cache",
                "paged",
                "--max_new_tokens",
                "4",
            ]
        )
        == 2
    )
    assert "static KV cache" in capsys.readouterr().err


# Inductor's vector width follows ATEN_CPU_CAPABILITY (runtime.inductor_vector_bits)
@pytest.mark.isa
def test_engine_paged_package_equals_eager_at_every_bucket(tiny):
    """batch.py and serve.py's default (--compile auto): the engine's decode-only steps through one
    paged package (rows, table width and pool size dynamic) give the eager engine's greedy tokens,
    over batches of 1 to 8 rows, widths growing with the context, preemption and prefix hits; and in
    pieces where a step has more rows than the package takes."""
    import random

    from sequence import RequestParams
    from server import tp_engine

    rng = random.Random(3)
    head = [rng.randrange(3, 200) for _ in range(9)]
    prompts = [
        (head if i % 3 == 0 else []) + [rng.randrange(3, 200) for _ in range(rng.randint(2, 40))]
        for i in range(14)
    ]
    params = [
        RequestParams(max_new_tokens=rng.randint(4, 40), temperature=0.0, ignore_eos=True)
        for _ in prompts
    ]
    flags = dict(
        checkpoint=str(tiny),
        dtype="float32",
        block_size=4,
        num_blocks=40,
        max_num_seqs=8,
        max_num_batched_tokens=64,
    )
    eager, _, _ = tp_engine.load_one_process(compile="off", **flags)
    assert eager.decode_fn is None
    engine, _, _ = tp_engine.load_one_process(compile="aot", **flags)
    assert isinstance(engine.decode_fn, aot.AotPaged)
    rows, package = [], engine.decode_fn

    def counted(model, cache, tokens, pos):
        rows.append(
            (tokens.shape[1], cache.groups[0][2].shape[1])
        )  # (rows, table width) of this compiled step
        return package(model, cache, tokens, pos)

    class Runs:  # the C++ loader, counted: every compiled step must go through the package
        def __init__(self, loader):
            self.loader, self.n = loader, 0

        def run(self, inputs):
            self.n += 1
            assert (
                2 <= inputs[0].shape[1] <= max(2, package.max_rows)
            )  # never more rows than it was built for
            return self.loader.run(inputs)

    engine.decode_fn, package.loaders["paged"] = counted, Runs(package.loaders["paged"])
    ours, theirs = engine.run_batch(prompts, params), eager.run_batch(prompts, params)
    assert [o["tokens"] for o in ours] == [o["tokens"] for o in theirs]
    assert package.loaders["paged"].n == len(rows) > 20
    assert (
        1 in {r for r, _ in rows}
        and len({r for r, _ in rows}) >= 4
        and len({w for _, w in rows}) >= 3
    )
    assert (
        engine.scheduler.stats["preemptions"] > 0
        and engine.scheduler.stats["prompt_tokens_hit"] > 0
    )
    # a step longer than the package's rows runs as pieces of them (here 3 rows a call)
    rows.clear()
    package.max_rows, package.loaders["paged"].n = 3, 0
    assert [o["tokens"] for o in engine.run_batch(prompts, params)] == [o["tokens"] for o in theirs]
    assert (
        package.loaders["paged"].n == sum(-(-r // 3) for r, _ in rows) > len(rows)
        and max(r for r, _ in rows) > 3
    )


def test_the_package_key_hashes_the_files_the_step_is_traced_from(tiny, monkeypatch):
    """An edit to the model, its cache or its layers compiles anew; an edit to the server's files
    does not (the key once hashed every file of the project)."""
    model, _ = load(tiny, quantize="int4")
    step = aot.Step(model, StaticKVCache.for_model(model, 1, 64))
    files = {os.path.relpath(f, ROOT) for f in aot_export.traced_files(step)}
    assert {
        "model.py",
        "kv_cache.py",
        "quantize.py",
        "cpu_kernels.py",
        "compiling.py",
        "runtime.py",
        "speedups/aot_export.py",
    } <= files
    assert not [
        f for f in files if f.startswith(("server/", "tests/")) or f in ("serve.py", "batch.py")
    ], files
    # an in-process torch.compile leaves "__import_..." globals in the modules it traced (here as
    # Dynamo would after tracing the int8 cache): the key stays the one a fresh process computes
    from speedups import kv_int8

    monkeypatch.setattr(compiling, "__import_speedups_dot_kv_int8", kv_int8, raising=False)
    assert {os.path.relpath(f, ROOT) for f in aot_export.traced_files(step)} == files


def test_latent_attention_paged_packages_and_verify_steps_equal_eager(tmp_path):
    """DeepSeek-V2 (model.MLAttention, its group-limited router) in the engine: its paged packages
    (latent pools, no V), the decode steps' and, with prompt lookup, the verify steps' (1 + k
    tokens a row), give the eager engine's tokens. (generate.py's latent package:
    tests/test_deepseek.py.)"""
    import random

    from sequence import RequestParams
    from server import tp_engine

    folder = tiny_checkpoint(tmp_path, arch="deepseek_v2", max_position_embeddings=512)
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randint(3, 10))] * 3 for _ in range(8)]
    params = [RequestParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)] * 8
    flags = dict(checkpoint=str(folder), dtype="float32", block_size=4, num_blocks=80,
                 speculate="prompt_lookup", speculate_k=3)  # fmt: skip
    eager, _, _ = tp_engine.load_one_process(compile="off", **flags)
    engine, _, _ = tp_engine.load_one_process(compile="aot", **flags)
    package, calls = engine.decode_fn, []
    assert isinstance(package, aot.AotPaged) and set(package.loaders) == {"paged", "verify4"}

    class Counted:  # the C++ loader, each call's part recorded
        def __init__(self, part, loader):
            self.part, self.loader = part, loader

        def run(self, inputs):
            calls.append(self.part)
            return self.loader.run(inputs)

    package.loaders = {part: Counted(part, loader) for part, loader in package.loaders.items()}
    ours, theirs = engine.run_batch(prompts, params), eager.run_batch(prompts, params)
    assert [o["tokens"] for o in ours] == [o["tokens"] for o in theirs]
    assert calls.count("verify4") > 5 and calls.count("paged") > 0, calls
    assert engine.metrics()["draft_tokens_accepted"] > 0


def test_a_failed_verify_build_leaves_the_decode_package(tmp_path, monkeypatch):
    """Under --compile auto a verify package that fails to build costs speculation's verify steps
    (eager), not the decode steps: those build alone, and later runs do not try it again."""
    calls = []

    def build_in_child(folder, parts, load, cache):
        calls.append(list(parts))
        if any(p.startswith("verify") for p in parts):
            raise aot_export.AotError("compiling the decode step ahead of time failed (exit 1)")
        for p in parts:
            (tmp_path / f"{p}.pt2").write_text("")

    monkeypatch.setattr(aot, "build_in_child", build_in_child)
    both = ["paged", "verify5"]
    assert aot.build_parts(str(tmp_path), both, both, {}, None, retry=False) == ["paged"]
    assert calls == [both, ["paged"]] and (tmp_path / "paged.pt2").exists()
    assert (tmp_path / "failed-verify5.txt").exists() and not (tmp_path / "failed.txt").exists()
    calls.clear()
    assert aot.build_parts(str(tmp_path), both, ["verify5"], {}, None, retry=False) == ["paged"]
    assert calls == []  # remembered
    with pytest.raises(aot_export.AotError):  # --compile aot tries again, and fails loudly
        aot.build_parts(str(tmp_path), both, ["verify5"], {}, None, retry=True)
