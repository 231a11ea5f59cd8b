"""server/tp_engine.py: the engine, batch.py and serve.py over tensor-parallel gloo ranks give the
tokens of one process: shared prefixes, preemption in a tight pool, n = 2, an abort; serve.py under
torchrun answers the `openai` client as one process does, frees a leaving client's blocks, drains on
SIGTERM with every rank exiting 0; a rank killed mid-run takes the others down, named."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch
from helpers import tiny_checkpoint
from test_serve import client, start_server
from test_tp import start_ranks
from tp_worker import ENGINE, engine_workload, run_engine_rank

from engine import Engine
from formats import weights
from formats.tokenizer import load_tokenizer
from server import tp_link

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node"]


@pytest.fixture(scope="module")
def gqa(tmp_path_factory):
    """4 heads and 2 KV heads (each rank holds 1), biases everywhere."""
    return tiny_checkpoint(
        tmp_path_factory.mktemp("tp-engine"), arch="llama_bias", max_position_embeddings=512
    )


def spawn_engine(folder, tmp_path, options, timeout_s=180):
    world = len(options)
    start_ranks(
        run_engine_rank,
        (world, str(folder), str(tmp_path / "rendezvous"), str(tmp_path), options),
        world,
        timeout_s,
    )
    errors = [
        (tmp_path / f"rank{r}.err").read_text()
        for r in range(world)
        if (tmp_path / f"rank{r}.err").exists()
    ]
    return errors or json.loads((tmp_path / "rank0.json").read_text())


def test_engine_on_two_ranks_equals_one_process(gqa, tmp_path):
    model, info = weights.load(gqa, dtype=torch.float64)
    tokenizer = load_tokenizer(info.source)
    alone, preemptions = engine_workload(
        Engine.for_model(model, stop_ids=tokenizer.stop_ids, tokenizer=tokenizer, **ENGINE),
        tokenizer,
    )
    assert preemptions > 0 and len(alone) == 4
    got = spawn_engine(gqa, tmp_path, [ENGINE, ENGINE])
    assert isinstance(got, dict), got[0]
    assert got["ranks"] == 2 and got["preemptions"] == preemptions
    assert got["results"] == {str(k): [list(map(list, v[0])), v[1]] for k, v in alone.items()}


def test_a_step_crosses_the_broadcast_whole_hybrid_tables_and_pools_included():
    """pack/unpack: a decode group's [R, W] table and a hybrid's [2, R, W] (full and windowed
    layers' blocks), and copy-on-write copies naming their pool, arrive as sent."""
    groups = [
        (2, 1, torch.tensor([[1, 2, 0], [3, 4, 5]])),
        (1, 5, torch.tensor([[[6, 7]], [[0, 8]]])),
        (3, 1, torch.zeros(3, 1, dtype=torch.long)),
    ]
    tokens, pos, keep = torch.arange(10)[None], torch.arange(10, 20)[None], torch.tensor([1, 6])
    copies, got, *rest = tp_link.unpack(
        *tp_link.pack([(3, 9, 0), (8, 2, 1)], groups, tokens, pos, keep)
    )
    assert copies == [(3, 9, 0), (8, 2, 1)]
    assert [(r, t, table.tolist()) for r, t, table in got] == [
        (r, t, table.tolist()) for r, t, table in groups
    ]
    assert all(torch.equal(a, b) for a, b in zip(rest, (tokens, pos, keep)))


def test_ranks_with_different_engine_flags_stop_naming_them(gqa, tmp_path):
    errors = spawn_engine(gqa, tmp_path, [ENGINE, {**ENGINE, "max_num_seqs": 4}], timeout_s=60)
    assert len(errors) == 2 and all("max_num_seqs: [8, 4]" in e for e in errors), errors


def run_batch(args, requests, tmp_path, ranks=None):
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in requests))
    launcher = TORCHRUN + [str(ranks)] if ranks else [sys.executable]
    out = subprocess.run(
        launcher + ["batch.py", "--requests", str(path), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return {
        json.loads(line)["id"]: json.loads(line)["tokens"] for line in out.stdout.splitlines()
    }, out.stderr


def test_batch_on_three_ranks_equals_one_process_on_the_embedded_model(tmp_path):
    """The embedded model (9 heads, 3 KV heads) in float32, greedy, through torchrun and
    batch.py."""
    requests = [
        {"id": i, "prompt": p, "max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
        for i, p in enumerate(
            ["The capital of France is", "The capital of France is a city", "Once"]
        )
    ]
    requests.append(
        {
            "id": 3,
            "prompt": "The capital of France is",
            "max_new_tokens": 12,
            "temperature": 0.8,
            "seed": 7,
            "n": 2,
            "ignore_eos": True,
        }
    )  # forked samples, seeded
    args = ["--dtype", "float32", "--num_blocks", "9", "--block_size", "4"]  # tight: preemption
    alone, one_log = run_batch(args, requests, tmp_path)
    three, log = run_batch(args, requests, tmp_path, ranks=3)
    assert three == alone and len(alone) == 4 and "preemptions 0" not in one_log
    assert "tensor parallel over 3 ranks" in log and "steps broadcast to 2 ranks" in log


def test_a_world_size_that_does_not_divide_the_heads_is_refused_with_the_sizes_that_work(tmp_path):
    out = subprocess.run(
        TORCHRUN + ["2", "batch.py", "--requests", "-"],
        cwd=ROOT,
        input="",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0 and "world sizes that work: [1, 3]" in out.stderr


def start_torchrun_server(folder, ranks=2, extra=()):
    proc = subprocess.Popen(
        TORCHRUN
        + [
            str(ranks),
            "serve.py",
            "--checkpoint",
            str(folder),
            "--port",
            "0",
            "--dtype",
            "float32",
            "--num_blocks",
            "200",
            "--block_size",
            "8",
            *extra,
        ],
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines = []
    while "serving on" not in (line := proc.stderr.readline()):
        assert line, "serve.py exited before serving:\n" + "".join(lines[-30:])
        lines.append(line)
    pids = [int(p) for p in "".join(lines).split("(pids ")[1].split(")")[0].split(", ")]
    return proc, line.split("serving on ")[1].split()[0], pids


def stream_text(url, body):
    text = ""
    for chunk in client(url).completions.create(**body, stream=True):
        text += chunk.choices[0].text
    return text


def test_serve_on_two_ranks_answers_as_one_process_and_drains_on_sigterm(gqa):
    model, info = weights.load(gqa, dtype=torch.float32)
    tokenizer = load_tokenizer(info.source)
    one = Engine.for_model(
        model, num_blocks=200, block_size=8, stop_ids=tokenizer.stop_ids, tokenizer=tokenizer
    )
    url_one, _, stop_one = start_server(one, tokenizer)
    proc, url, pids = start_torchrun_server(gqa, extra=["--api_key", "test-key"])
    try:
        assert httpx.get(url + "/health").json() == {"status": "ok", "ranks": 2}
        body = dict(model="tiny", prompt="hello world, the", max_tokens=24, temperature=0)
        whole = client(url).completions.create(**body).choices[0].text
        assert whole == client(url_one).completions.create(**body).choices[0].text
        assert stream_text(url, body) == whole
        chat = dict(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=12, temperature=0
        )
        assert (
            client(url).chat.completions.create(**chat).choices[0].message.content
            == client(url_one).chat.completions.create(**chat).choices[0].message.content
        )
        scored = dict(
            body,
            logprobs=2,
            echo=True,
            max_tokens=4,
            extra_body={"structured_outputs": {"regex": "[a-z]+"}},
        )
        two, alone = (client(u).completions.create(**scored).choices[0] for u in (url, url_one))
        assert two.text == alone.text and two.logprobs.tokens == alone.logprobs.tokens
        assert two.logprobs.token_logprobs[1:] == pytest.approx(
            alone.logprobs.token_logprobs[1:], abs=1e-4
        )
        leaving = {"prompt": "the lazy dog", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream(
            "POST",
            url + "/v1/completions",
            json=leaving,
            headers={"Authorization": "Bearer test-key"},
        ) as r:
            assert next(r.iter_lines()).startswith("data: ")
        deadline = time.time() + 10
        while (
            "llm_kv_blocks_used 0"
            not in httpx.get(url + "/metrics", headers={"Authorization": "Bearer test-key"}).text
        ):
            assert time.time() < deadline, "the leaving client's blocks were not freed"
            time.sleep(0.05)
        os.kill(pids[0], signal.SIGTERM)  # rank 0 drains, then stops the other rank
        assert proc.wait(timeout=60) == 0, proc.stderr.read()[-3000:]
        assert not any(tp_link.alive(pid) for pid in pids)
    finally:
        stop_one()
        if proc.poll() is None:
            proc.kill()


def test_a_rank_killed_mid_run_stops_the_others_naming_it(gqa):
    proc, url, pids = start_torchrun_server(gqa)
    try:
        body = {
            "model": "tiny",
            "prompt": "hello",
            "max_tokens": 3000,
            "ignore_eos": True,
            "stream": True,
        }
        streaming = threading.Thread(
            target=lambda: httpx.post(url + "/v1/completions", json=body, timeout=60)
        )
        streaming.start()
        time.sleep(1.0)
        os.kill(pids[1], signal.SIGKILL)
        assert proc.wait(timeout=60) != 0
        assert "rank 1 stopped" in proc.stderr.read()
        streaming.join(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
