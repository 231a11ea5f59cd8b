"""generate.py: compiled decode equals eager decode, the CLI's flags and its errors."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from helpers import tiny_checkpoint

import compiling
import generate
import quantize
from formats import weights
from formats.tokenizer import load_tokenizer
from kv_cache import StaticKVCache
from sampling import SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny-chat"))


def run_json(capsys, *argv):
    assert generate.main([*argv, "--json"]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]


@pytest.mark.isa
def test_compiled_decode_equals_eager_without_recompiling(tiny):
    """20 compiled decode steps (the CPU mode generate.py uses: frozen weights, autotuned GEMMs):
    same tokens as eager in float32, and a recompile would raise."""
    import torch._dynamo

    torch._dynamo.reset()
    model, _ = weights.load(tiny)
    prompt = torch.tensor([[5, 9, 11, 3]] * 2)
    params = SamplingParams(0.0)
    eager, _ = generate.generate(
        model,
        StaticKVCache.for_model(model, 2, 64),
        prompt,
        21,
        params,
        generate.DecodeOptions(ignore_eos=True),
    )
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled_fn = compiling.compile_decode("cpu")
        cache = StaticKVCache.for_model(model, 2, 64)
        ours, _ = generate.generate(
            model,
            cache,
            prompt,
            21,
            params,
            generate.DecodeOptions(ignore_eos=True, decode_fn=compiled_fn),
        )
        # a fresh cache of the same shape reuses the compiled graph (no recompile)
        fresh = StaticKVCache.for_model(model, 2, 64)
        again, _ = generate.generate(
            model,
            fresh,
            prompt,
            21,
            params,
            generate.DecodeOptions(ignore_eos=True, decode_fn=compiled_fn),
        )
    assert ours == eager == again
    assert len(ours[0]) == 21


def test_max_autotune_is_chosen_per_model_and_cpu(tiny, monkeypatch):
    """compiling.autotune follows the measurements (RESULTS.md): off for all-bf16 matrices on an
    AVX-512 CPU without AMX, and for int4; on for float32, int8, bf16 with AMX or under AVX2."""
    fp32, _ = weights.load(tiny)
    bf16, _ = weights.load(tiny, dtype=torch.bfloat16)
    int8, _ = weights.load(tiny, dtype=torch.bfloat16)
    quantize.quantize_model(int8, "int8")
    int4, _ = weights.load(tiny, dtype=torch.bfloat16)
    quantize.quantize_model(int4, "int4", 32)
    table = {  # (capability, AMX): autotune for fp32, bf16, int8, int4
        ("AVX512", False): (True, False, True, False),
        ("AVX512", True): (True, True, True, False),
        ("AVX2", False): (True, True, True, False),
    }
    for (cap, amx), want in table.items():
        monkeypatch.setattr(compiling, "cpu_capability", lambda cap=cap: cap)
        monkeypatch.setattr(compiling, "has_amx", lambda amx=amx: amx)
        got = tuple(compiling.autotune(m) for m in (fp32, bf16, int8, int4))
        assert got == want, f"{cap}, AMX {amx}: {got}"


@pytest.mark.isa
def test_compile_lengths_mid_conversation_then_decode_equals_eager(tmp_path):
    """--interactive --compile's order: a 120-token conversation in the cache, then every graph a
    20-token reply can reach compiled (throwaway steps at the slots after it), then the reply:
    eager's tokens (float64), and no compiling while it decodes."""
    import torch._dynamo

    model, _ = weights.load(
        tiny_checkpoint(tmp_path, max_position_embeddings=512), dtype=torch.float64
    )
    g = torch.Generator().manual_seed(2)
    history, nxt = torch.randint(3, 250, (1, 120), generator=g), torch.tensor([[7]])
    replies = []
    for compiled in (False, True):
        cache = StaticKVCache.for_model(model, 1, 512)
        with torch.no_grad():
            compiling.prefill(model, cache, history)
        step = compiling.decode_one
        if compiled:
            torch._dynamo.reset()
            step = compiling.compile_decode("cpu", autotune=False)
            assert generate.compile_lengths(step, model, cache, 121, 121 + 19) == {128, 192}
        with torch._dynamo.config.patch(error_on_recompile=True):
            rows, _ = generate.generate(
                model,
                cache,
                nxt,
                20,
                SamplingParams(0.0),
                generate.DecodeOptions(ignore_eos=True, decode_fn=step, start_pos=120),
            )
        replies.append(rows[0])
    assert replies[0] == replies[1] and len(replies[0]) == 20


def test_cli_compile_and_compile_prefill_match_eager(tiny, capsys):
    argv = [
        "--checkpoint",
        str(tiny),
        "--prompt",
        "hello world the",
        "--temperature",
        "0",
        "--max_new_tokens",
        "10",
        "--ignore_eos",
        "--dtype",
        "float32",
    ]
    eager = run_json(capsys, *argv)[0]
    compiled = run_json(capsys, *argv, "--compile", "--compile_prefill")[0]
    assert compiled["tokens"] == eager["tokens"]
    assert compiled["stats"]["compile_s"] > 0 and eager["stats"]["compile_s"] == 0


def test_greedy_batch_rows_equal_single_runs(tiny, capsys):
    single = run_json(
        capsys,
        "--checkpoint",
        str(tiny),
        "--prompt",
        "hello world",
        "--temperature",
        "0",
        "--max_new_tokens",
        "12",
        "--ignore_eos",
        "--dtype",
        "float32",
    )
    batch = run_json(
        capsys,
        "--checkpoint",
        str(tiny),
        "--prompt",
        "hello world",
        "--temperature",
        "0",
        "--max_new_tokens",
        "12",
        "--ignore_eos",
        "--dtype",
        "float32",
        "--batch_size",
        "3",
    )
    assert len(batch) == 3 and all(b["tokens"] == single[0]["tokens"] for b in batch)


def test_seed_reproduces_and_samples_differ(tiny, capsys):
    argv = [
        "--checkpoint",
        str(tiny),
        "--prompt",
        "the quick",
        "--temperature",
        "1.0",
        "--max_new_tokens",
        "16",
        "--ignore_eos",
        "--seed",
        "3",
        "--batch_size",
        "4",
        "--top_k",
        "50",
    ]
    a, b = run_json(capsys, *argv), run_json(capsys, *argv)
    assert [r["tokens"] for r in a] == [r["tokens"] for r in b]
    assert len({tuple(r["tokens"]) for r in a}) > 1  # each row sampled on its own


def test_num_samples_and_chat(tiny, capsys):
    out = run_json(
        capsys,
        "--checkpoint",
        str(tiny),
        "--prompt",
        "hi",
        "--chat",
        "--num_samples",
        "2",
        "--max_new_tokens",
        "5",
        "--ignore_eos",
        "--temperature",
        "0",
    )
    tok = load_tokenizer(tiny)
    assert len(out) == 2
    assert out[0]["prompt_tokens"] == tok.encode(
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_stops_at_stop_token(tiny, capsys):
    """Force the stop token to be the argmax; generation must end right after it."""
    model, _ = weights.load(tiny)
    with torch.no_grad():
        model.lm_head.weight[2] += (
            100 * model.norm.weight.sign()
        )  # <|im_end|> wins once hidden states align
    prompt = torch.tensor([[5, 6, 7]])
    rows, timing = generate.generate(
        model,
        StaticKVCache.for_model(model, 1, 64),
        prompt,
        20,
        SamplingParams(0.0),
        generate.DecodeOptions(stop_ids={2}),
    )
    ignored, _ = generate.generate(
        model,
        StaticKVCache.for_model(model, 1, 64),
        prompt,
        20,
        SamplingParams(0.0),
        generate.DecodeOptions(stop_ids={2}, ignore_eos=True),
    )
    assert 2 in ignored[0] and len(ignored[0]) == 20
    first = ignored[0].index(2)
    assert rows[0] == ignored[0][: first + 1]


def test_cli_penalties_reach_the_loop_and_follow_their_definitions(tiny, capsys):
    """--repetition_penalty (prompt and output), --frequency_penalty and --presence_penalty (output
    only): every batch row's greedy tokens equal a plain loop that reruns the whole sequence and
    applies the definitions token by token; they differ from the unpenalised tokens."""
    from kv_cache import NoCache

    argv = [
        "--checkpoint",
        str(tiny),
        "--temperature",
        "0",
        "--max_new_tokens",
        "12",
        "--ignore_eos",
        "--dtype",
        "float32",
        "--batch_size",
        "2",
    ]
    head = (
        "hello world" + run_json(capsys, *argv, "--prompt", "hello world")[0]["text"]
    )  # a prompt the model repeats
    plain = run_json(capsys, *argv, "--prompt", head)[0]["tokens"]
    rows = run_json(
        capsys,
        *argv,
        "--prompt",
        head,
        "--repetition_penalty",
        "1.5",
        "--frequency_penalty",
        "0.5",
        "--presence_penalty",
        "0.3",
    )
    model, _ = weights.load(tiny, dtype=torch.float32)
    ids, out = rows[0]["prompt_tokens"], []
    for _ in range(12):
        with torch.no_grad():
            seq = torch.tensor([ids + out])
            logits = model(seq, torch.arange(seq.shape[1])[None], NoCache())[0, -1].tolist()
        for j in set(ids + out):
            logits[j] = logits[j] / 1.5 if logits[j] > 0 else logits[j] * 1.5
        for j in set(out):
            logits[j] -= 0.5 * out.count(j) + 0.3
        out.append(max(range(len(logits)), key=logits.__getitem__))
    assert [r["tokens"] for r in rows] == [out, out] and out != plain


def test_cli_logit_bias_forces_a_token_and_min_p_1_samples_only_the_argmax(tiny, capsys):
    argv = [
        "--checkpoint",
        str(tiny),
        "--prompt",
        "hello",
        "--max_new_tokens",
        "8",
        "--ignore_eos",
        "--seed",
        "0",
        "--dtype",
        "float32",
    ]  # float32: no ties at the top for min_p = 1 to keep
    rows = run_json(capsys, *argv, "--temperature", "1.0", "--logit_bias", '{"5": 100}')
    assert rows[0]["tokens"] == [5] * 8
    greedy = run_json(capsys, *argv, "--temperature", "0")[0]["tokens"]
    assert (
        run_json(capsys, *argv, "--temperature", "2.0", "--min_p", "1", "--batch_size", "2")[1][
            "tokens"
        ]
        == greedy
    )
    assert (
        run_json(capsys, *argv, "--temperature", "2.0", "--batch_size", "2")[1]["tokens"] != greedy
    )


def test_streamed_text_equals_json_text(tiny, capsys):
    argv = [
        "--checkpoint",
        str(tiny),
        "--prompt",
        "hello",
        "--temperature",
        "0",
        "--max_new_tokens",
        "10",
        "--ignore_eos",
    ]
    assert generate.main(argv) == 0
    streamed = capsys.readouterr().out
    text = run_json(capsys, *argv)[0]["text"]
    assert streamed.rstrip("\n") == "hello" + text


def test_interactive_prefills_only_the_new_turn(tiny, capsys, monkeypatch):
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\nthe fox\n\n"))
    assert (
        generate.main(
            [
                "--checkpoint",
                str(tiny),
                "--interactive",
                "--max_new_tokens",
                "4",
                "--temperature",
                "0",
                "--max_seq_len",
                "128",
            ]
        )
        == 0
    )
    err = capsys.readouterr().err
    turns = [tuple(map(int, m)) for m in re.findall(r"\[(\d+) new prompt tokens of (\d+)", err)]
    assert len(turns) == 2
    new, total = turns[1]
    assert new < total  # the second turn reused the first turn's cache


def test_profile_writes_a_trace(tiny, tmp_path, capsys):
    trace = tmp_path / "trace.json"
    assert (
        generate.main(
            [
                "--checkpoint",
                str(tiny),
                "--prompt",
                "hi",
                "--max_new_tokens",
                "3",
                "--profile",
                str(trace),
            ]
        )
        == 0
    )
    assert trace.exists() and "traceEvents" in trace.read_text()[:10000]


# --- bad input: a clear error and a non-zero exit --------------------------------------------


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--max_new_tokens", "300"], "exceeds this model's context of 256 tokens"),
        (["--prompt", ""], "prompt is empty"),
        (["--max_seq_len", "8"], "smaller than prompt"),
        (["--device", "cuda"], "CUDA is not available"),
        (["--logit_bias", '{"100000": 1}'], "logit_bias keys must be token ids in [0, "),
        (["--prompt_lookup", "2", "--presence_penalty", "1"], "speculative decoding here takes no"),
    ],
)
def test_bad_values_exit_with_a_clear_error(tiny, capsys, argv, message):
    assert generate.main(["--checkpoint", str(tiny), "--prompt", "hello", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--temperature", "-1"], "temperature must be a finite number >= 0"),
        (["--top_p", "0"], "top_p must be in (0, 1]"),
        (["--top_p", "1.5"], "top_p must be in (0, 1]"),
        (["--top_k", "0"], "top_k must be >= 1"),
        (["--max_new_tokens", "0"], "--max_new_tokens must be >= 1"),
        (["--min_p", "1.5"], "min_p must be in [0, 1]"),
        (["--repetition_penalty", "0"], "repetition_penalty must be in [0.001, 1000]"),
        (["--frequency_penalty", "-2.5"], "frequency_penalty must be in [-2, 2]"),
        (["--presence_penalty", "3"], "presence_penalty must be in [-2, 2]"),
        (["--logit_bias", "{5: 1}"], "--logit_bias is not JSON"),
        (["--logit_bias", '{"five": 1}'], "logit_bias keys must be token ids"),
    ],
)
def test_bad_flags_exit_with_a_usage_error(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        generate.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_bad_checkpoints_exit_with_a_clear_error(tmp_path, capsys):
    assert generate.main(["--checkpoint", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{}")
    assert generate.main(["--checkpoint", str(tmp_path)]) == 2
    assert "is not a family this project runs" in capsys.readouterr().err


def test_cli_process_exits_non_zero_without_a_traceback(tmp_path):
    out = subprocess.run(
        [sys.executable, "generate.py", "--checkpoint", str(tmp_path / "missing.gguf")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "error: checkpoint" in out.stderr and "Traceback" not in out.stderr


def test_a_chat_template_with_a_huge_loop_exits_with_a_clear_error(tiny, tmp_path, capsys):
    import shutil

    folder = shutil.copytree(tiny, tmp_path / "hostile")
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {"eos_token": "<|im_end|>", "chat_template": "{% for i in range(10**9) %}{% endfor %}"}
        )
    )
    assert (
        generate.main(
            ["--checkpoint", str(folder), "--chat", "--prompt", "hi", "--max_new_tokens", "2"]
        )
        == 2
    )
    assert "chat template failed" in capsys.readouterr().err
