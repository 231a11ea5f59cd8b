"""serve.py with LoRA adapters (server/adapters.py) through the `openai` client: a request's
`model` picks an adapter (its text equals that adapter run alone), /v1/models lists them beside the
base, an unknown name is a 404 naming those served; vLLM's /v1/load_lora_adapter and
/v1/unload_lora_adapter while streams run, none of which fails; bad loads refused by name."""

import threading

import httpx
import openai
import pytest
import torch
from helpers import tiny_checkpoint
from lora_adapters import adapter_folders
from test_serve import AUTH, client, start_server

from engine import Engine, RequestParams
from formats import weights
from formats.lora_files import read_adapter
from formats.tokenizer import load_tokenizer
from speedups import lora

PROMPT = "hello world, the quick"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A server over a tiny llama3 with 2 adapter slots, adapter0 loaded; the three adapters'
    folders; each adapter's (and the base's) greedy text for PROMPT, from an engine alone."""
    root = tmp_path_factory.mktemp("serve-lora")
    folder = tiny_checkpoint(root / "base", arch="llama3")
    paths = [p for p, _ in adapter_folders(root)]
    model, info = weights.load_for_inference(folder, dtype=torch.float32)
    tokenizer = load_tokenizer(info.source)
    reference = weights.load_for_inference(folder, dtype=torch.float32)[0]
    ref = Engine.for_model(reference, num_blocks=64, tokenizer=tokenizer)
    ref.adapters = lora.Adapters(reference, 3, 8)
    want = {}
    for name in (None, *(p.name for p in paths)):
        if name:
            ref.adapters.load(read_adapter(root / name, reference.config))
        params = RequestParams(max_new_tokens=12, temperature=0, ignore_eos=True, adapter=name)
        want[name] = ref.run_batch([tokenizer.encode(PROMPT)], params)[0]["text"]
    engine = Engine.for_model(model, num_blocks=128, max_num_seqs=8, tokenizer=tokenizer)
    engine.adapters = lora.Adapters(model, 2, 8)
    engine.adapters.load(read_adapter(paths[0], model.config))
    url, _, stop = start_server(engine, tokenizer)
    yield url, paths, want
    stop()


def complete(url, model, **kw):
    c = client(url)
    r = c.completions.create(
        model=model, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    return r.choices[0].text


def post(url, path, body):
    return httpx.post(url + path, json=body, headers=AUTH, timeout=60)


def test_model_picks_the_adapter_and_models_lists_them(served):
    url, paths, want = served
    assert complete(url, "adapter0") == want["adapter0"]
    assert complete(url, "tiny") == want[None] != want["adapter0"]
    r = client(url).completions.create(model="adapter0", prompt=PROMPT, max_tokens=2)
    assert r.model == "adapter0"  # a reply names the adapter that wrote it
    ids = [m.id for m in client(url).models.list().data]
    assert ids[:2] == ["tiny", "adapter0"]
    assert client(url).models.retrieve("adapter0").id == "adapter0"
    with pytest.raises(openai.NotFoundError, match="this server serves 'tiny', 'adapter0'"):
        client(url).models.retrieve("nope")
    with pytest.raises(openai.NotFoundError, match="does not exist: this server serves tiny"):
        complete(url, "nope")
    chat = client(url).chat.completions.create(
        model="adapter0", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert chat.choices[0].message.content is not None


def test_load_and_unload_while_streams_run(served):
    """Streams on adapter0 and the base run while adapter1 and then adapter2 load (2 slots: one
    waits on the host, placed again when asked for): every stream's text is its text alone, and
    every adapter, evicted or not, answers as it does alone."""
    url, paths, want = served
    texts, errors = {}, []

    def stream(i, model):
        try:
            c = client(url)
            chunks = c.completions.create(
                model=model,
                prompt=PROMPT,
                max_tokens=12,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            texts[i] = (model, "".join(ch.choices[0].text for ch in chunks if ch.choices))
        except Exception as e:  # reported below
            errors.append(e)

    models = ["adapter0", "tiny"] * 3
    threads = [threading.Thread(target=stream, args=(i, m)) for i, m in enumerate(models)]
    for t in threads:
        t.start()
    for name in ("adapter1", "adapter2"):
        r = post(
            url,
            "/v1/load_lora_adapter",
            {"lora_name": name, "lora_path": str(paths[int(name[-1])])},
        )
        assert r.status_code == 200, r.text
    for t in threads:
        t.join(timeout=60)
    assert not errors
    assert all(text == want[None if model == "tiny" else model] for model, text in texts.values())
    for name in ("adapter1", "adapter2", "adapter0", "adapter1"):  # two slots, three adapters
        assert complete(url, name) == want[name]
    cards = client(url).models.list().data
    assert [m.id for m in cards] == ["tiny", "adapter0", "adapter1", "adapter2"]
    r = post(url, "/v1/unload_lora_adapter", {"lora_name": "adapter2"})
    assert r.status_code == 200 and "adapter2" not in [m.id for m in client(url).models.list().data]
    r = post(url, "/v1/unload_lora_adapter", {"lora_name": "adapter2"})
    assert r.status_code == 404 and "no adapter 'adapter2' is loaded" in r.text


def test_bad_loads_are_refused_by_name(served, tmp_path):
    url, paths, _ = served
    r = post(url, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path)})
    assert r.status_code == 400 and "no adapter_config.json" in r.text
    r = post(url, "/v1/load_lora_adapter", {"lora_name": "x"})
    assert r.status_code == 400 and "lora_path" in r.text
    r = post(url, "/v1/load_lora_adapter", {"lora_name": "tiny", "lora_path": str(paths[1])})
    assert r.status_code == 400 and "the base model's name" in r.text
    r = post(url, "/v1/load_lora_adapter", {"lora_name": "adapter0", "lora_path": str(paths[1])})
    assert r.status_code == 400 and "already loaded" in r.text
    assert complete(url, "tiny")  # nothing else affected
