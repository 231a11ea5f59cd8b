"""serve.py through the real `openai` client: the same greedy text as generate.py, streamed or
not; concurrent clients batched together; a client that disconnects frees its blocks; bad
requests get OpenAI-style 4xx errors while the server keeps serving. The model is the tiny one
in float64, so batching never changes a greedy token."""
import asyncio
import json
import threading
import time

import httpx
import openai
import pytest
import torch
import uvicorn

import generate
import weights
from helpers import tiny_checkpoint
from kv_cache import StaticKVCache
from sampling import SamplingParams
from scheduler import Engine
from serve import make_app
from tokenizer import load_tokenizer

KEY = "test-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tiny_checkpoint(tmp_path_factory.mktemp("serve-tiny"), max_position_embeddings=512)
    model, info = weights.load(folder, dtype=torch.float64)
    tokenizer = load_tokenizer(info.source)
    engine = Engine(model, num_blocks=400, block_size=8, max_num_seqs=32, max_num_batched_tokens=256,
                    stop_ids=tokenizer.stop_ids, tokenizer=tokenizer)
    app = make_app(engine, tokenizer, "tiny", KEY)
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0,
                                        log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not srv.started:
        assert time.time() < deadline, "the server did not start"
        time.sleep(0.05)
    url = "http://127.0.0.1:%d" % srv.servers[0].sockets[0].getsockname()[1]
    while httpx.get(url + "/health").status_code != 200:
        time.sleep(0.05)
    yield url, model, tokenizer, engine, app.state.engine_loop
    srv.should_exit = True
    thread.join(timeout=10)


def client(url, key=KEY, cls=openai.OpenAI):
    return cls(base_url=url + "/v1", api_key=key, max_retries=0)


def alone_text(model, tokenizer, ids, n):
    """generate.py's greedy loop on a static cache: the text the server must return."""
    rows, _ = generate.generate(model, StaticKVCache.for_model(model, 1, len(ids) + n), torch.tensor([ids]), n,
                                SamplingParams(0.0), stop_ids=tokenizer.stop_ids)
    return tokenizer.decode([t for t in rows[0] if t not in tokenizer.stop_ids])


def test_completions_match_generate_streamed_or_not(server):
    url, model, tokenizer, *_ = server
    c = client(url)
    prompt = "hello world, the quick"
    expected = alone_text(model, tokenizer, tokenizer.encode(prompt), 12)
    r = c.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
    assert r.choices[0].text == expected
    assert r.usage.prompt_tokens == len(tokenizer.encode(prompt)) and r.usage.completion_tokens >= 1
    chunks = list(c.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == expected
    assert chunks[-1].usage.total_tokens == r.usage.total_tokens
    assert c.models.list().data[0].id == "tiny"


def test_chat_completions_match_generate_streamed_or_not(server):
    url, model, tokenizer, *_ = server
    c = client(url)
    messages = [{"role": "user", "content": "the lazy dog"}]
    expected = alone_text(model, tokenizer, tokenizer.encode_chat(messages), 10)
    r = c.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    assert r.choices[0].message.content == expected and r.choices[0].message.role == "assistant"
    stream = c.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == expected
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_32_concurrent_streams_are_batched(server):
    url, model, tokenizer, engine, _ = server
    prompts = [f"the quick brown fox {'jumps ' * (i % 5)}over" for i in range(32)]
    expected = [alone_text(model, tokenizer, tokenizer.encode(p), 16) for p in prompts]
    engine.stats["peak_running"] = 0

    async def one(c, prompt):
        stream = await c.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0, stream=True)
        return "".join([ch.choices[0].text async for ch in stream if ch.choices])

    async def all_of_them():
        c = client(url, cls=openai.AsyncOpenAI)
        return await asyncio.gather(*(one(c, p) for p in prompts))

    assert asyncio.run(all_of_them()) == expected
    assert engine.stats["peak_running"] > 1


def test_disconnect_frees_blocks_and_others_carry_on(server):
    url, model, tokenizer, engine, _ = server
    body = {"model": "tiny", "prompt": "hello world", "max_tokens": 480, "stream": True, "ignore_eos": True}
    generated_before = server_loop(server).tokens_generated
    other = {}

    def bystander():
        other["text"] = client(url).completions.create(model="tiny", prompt="the lazy", max_tokens=20,
                                                        temperature=0).choices[0].text

    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}) as h:
        with h.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")  # it is running
            t = threading.Thread(target=bystander)
            t.start()
            while engine.allocator.num_used() == 0:
                time.sleep(0.01)
        # the response is closed after one chunk: the request must be aborted and its blocks freed
    t.join(timeout=60)
    deadline = time.time() + 10
    while engine.allocator.num_used() > 0 or engine.requests:
        assert time.time() < deadline, "blocks of the disconnected client were not freed"
        time.sleep(0.02)
    assert other["text"] == alone_text(model, tokenizer, tokenizer.encode("the lazy"), 20)
    # it was cut short: far fewer than its 480 tokens were generated (the bystander made <= 20)
    assert server_loop(server).tokens_generated - generated_before < 480


def server_loop(server):
    return server[4]


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server):
    url, *_ = server
    c = client(url)
    with pytest.raises(openai.BadRequestError, match="messages"):
        c.chat.completions.create(model="tiny", messages=[], max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="context"):
        c.completions.create(model="tiny", prompt="hello", max_tokens=10_000)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        c.completions.create(model="tiny", prompt="hello", temperature=-1)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        c.completions.create(model="tiny", prompt="hello", max_tokens="many")
    with pytest.raises(openai.AuthenticationError):
        client(url, key="wrong").completions.create(model="tiny", prompt="hello")
    r = httpx.post(url + "/v1/completions", content=b"{not json", headers={"Authorization": f"Bearer {KEY}",
                                                                          "Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    metrics = httpx.get(url + "/metrics").text
    assert "llm_kv_blocks_total 399" in metrics and "llm_time_to_first_token_seconds_count" in metrics
    assert c.completions.create(model="tiny", prompt="hello", max_tokens=3).choices[0].finish_reason


def test_stop_strings_n_and_seed(server):
    """A stop string ends the text before it (streamed: never sent); n samples with a seed are
    reproducible."""
    url, model, tokenizer, *_ = server
    c = client(url)
    full = alone_text(model, tokenizer, tokenizer.encode("hello world"), 30)
    stop = next(ch for ch in full[3:] if ch.strip())  # a character that occurs in the greedy text
    expected = full[:full.index(stop)]
    r = c.completions.create(model="tiny", prompt="hello world", max_tokens=30, temperature=0, stop=[stop])
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    streamed = c.completions.create(model="tiny", prompt="hello world", max_tokens=30, temperature=0, stop=stop,
                                    stream=True)
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == expected
    kw = dict(model="tiny", prompt="the quick", max_tokens=8, temperature=1.0, n=2, seed=5)
    a, b = c.completions.create(**kw), c.completions.create(**kw)
    assert [ch.text for ch in a.choices] == [ch.text for ch in b.choices] and len(a.choices) == 2
    assert a.usage.completion_tokens <= 16
