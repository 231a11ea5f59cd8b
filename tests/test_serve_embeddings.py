"""serve.py's /v1/embeddings and /v1/rerank (server/embeddings.py) through the clients people point
at them: the `openai` SDK (texts, token ids, `dimensions`, base64), LangChain's OpenAIEmbeddings
and LlamaIndex's OpenAILikeEmbedding, against sentence-transformers on a tiny qwen3 embedding
checkpoint built here; rerank scores against the formula computed with HF transformers on the
same weights; bad input refused by name with nothing else affected."""

import base64

import httpx
import numpy as np
import pytest
import torch
from embedding_folders import TEXTS, causal_folder, embedding_folder, reference
from test_serve import AUTH, KEY, LIMITS, client, start_server

from engine import Engine
from formats import weights
from formats.pooling import encode_input
from formats.tokenizer import load_tokenizer
from model import NO_HEAD
from server.embeddings import RERANK_INSTRUCTION, RERANK_PREFIX, RERANK_SUFFIX, embedding_spec


def serve(folder, pooling=None):
    model, info = weights.load(folder, dtype=torch.float32)
    tokenizer = load_tokenizer(info.source)
    engine = Engine.for_model(
        model, num_blocks=128, max_num_seqs=4, max_num_batched_tokens=32, tokenizer=tokenizer
    )
    url, _, stop = start_server(
        engine, tokenizer, LIMITS, embedding=embedding_spec(info.source, pooling, model)
    )
    return url, stop


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    folder = embedding_folder(tmp_path_factory.mktemp("serve-embed"), "lasttoken")
    url, stop = serve(folder)
    yield url, folder
    stop()


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    """A causal qwen3 whose tokenizer has "yes" and "no" as single tokens, and no pooling files."""
    folder = causal_folder(tmp_path_factory.mktemp("serve-rerank"), ("yes", "no"), 1024)
    url, stop = serve(folder)
    yield url, folder
    stop()


def post(url, path, body):
    return httpx.post(url + path, json=body, headers=AUTH, timeout=60)


def test_openai_embeddings_equal_sentence_transformers(embedder):
    url, folder = embedder
    c, want = client(url), reference(folder, TEXTS)
    r = c.embeddings.create(model="tiny", input=TEXTS)
    got = torch.tensor([d.embedding for d in r.data])
    assert [d.index for d in r.data] == list(range(len(TEXTS)))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    tok = load_tokenizer(folder)
    ids = [encode_input(tok, t) for t in TEXTS]
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(map(len, ids))
    one = c.embeddings.create(model="tiny", input=TEXTS[1]).data[0].embedding
    torch.testing.assert_close(torch.tensor(one), want[1], rtol=0, atol=1e-5)
    by_ids = c.embeddings.create(model="tiny", input=ids[:2]).data
    torch.testing.assert_close(
        torch.tensor([d.embedding for d in by_ids]), want[:2], atol=1e-5, rtol=0
    )
    by_one_ids = c.embeddings.create(model="tiny", input=ids[3]).data[0].embedding
    torch.testing.assert_close(torch.tensor(by_one_ids), want[3], rtol=0, atol=1e-5)
    many = c.embeddings.create(model="tiny", input=TEXTS * 26).data  # 130: three slices of 64
    got = torch.tensor([d.embedding for d in many])
    torch.testing.assert_close(got, want.repeat(26, 1), rtol=0, atol=1e-5)


def test_dimensions_cut_and_renormalize_and_base64_is_the_same_floats(embedder):
    url, folder = embedder
    want = reference(folder, TEXTS[:2])
    raw = post(url, "/v1/embeddings", {"input": TEXTS[:2], "dimensions": 16})
    cut = torch.tensor([d["embedding"] for d in raw.json()["data"]])
    torch.testing.assert_close(
        cut, torch.nn.functional.normalize(want[:, :16], dim=-1), atol=1e-5, rtol=0
    )
    b64 = post(url, "/v1/embeddings", {"input": TEXTS[:2], "encoding_format": "base64"}).json()
    decoded = [np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in b64["data"]]
    torch.testing.assert_close(torch.tensor(np.stack(decoded)), want, rtol=0, atol=1e-5)
    # the openai client asks for base64 itself and decodes it
    sdk = client(url).embeddings.create(model="tiny", input=TEXTS[:2], dimensions=16)
    torch.testing.assert_close(torch.tensor([d.embedding for d in sdk.data]), cut, rtol=0, atol=0)


def test_langchain_openai_embeddings(embedder):
    from langchain_openai import OpenAIEmbeddings

    url, folder = embedder
    lc = OpenAIEmbeddings(
        model="tiny", base_url=url + "/v1", api_key=KEY, check_embedding_ctx_length=False
    )
    want = reference(folder, TEXTS)
    torch.testing.assert_close(torch.tensor(lc.embed_documents(TEXTS)), want, rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.tensor(lc.embed_query(TEXTS[2])), want[2], rtol=0, atol=1e-5)


def test_llama_index_openai_like_embedding(embedder):
    from llama_index.embeddings.openai_like import OpenAILikeEmbedding

    url, folder = embedder
    li = OpenAILikeEmbedding(model_name="tiny", api_base=url + "/v1", api_key=KEY)
    want = reference(folder, TEXTS)
    got = torch.tensor(li.get_text_embedding_batch(TEXTS))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    query = torch.tensor(li.get_query_embedding(TEXTS[4]))
    torch.testing.assert_close(query, want[4], rtol=0, atol=1e-5)


def test_bad_embedding_requests_fail_alone_by_name(embedder):
    url, folder = embedder
    cases = [
        ({"input": []}, "input", "at least one"),
        ({"input": ["hello", ""]}, "input[1]", "is empty"),
        ({"input": ["hello", "dog " * 300]}, "input[1]", "over the model's context of 256"),
        ({"input": "hello", "dimensions": 65}, "dimensions", "exceeds the model's 64"),
        ({"input": "hello", "dimensions": 0}, "dimensions", "greater than or equal to 1"),
        ({"input": [[1, 2, 99999]]}, "input[0]", "token ids outside"),
        ({"input": "hello", "encoding_format": "int8"}, "encoding_format", "float"),
    ]
    for body, param, text in cases:
        r = post(url, "/v1/embeddings", body)
        assert r.status_code == 400 and text in r.json()["error"]["message"], (body, r.text)
        assert r.json()["error"]["param"] == param, (body, r.text)
    cut = post(url, "/v1/embeddings", {"input": ["dog " * 300], "truncate": True})
    assert cut.status_code == 200 and cut.json()["usage"]["prompt_tokens"] == 256
    want = reference(folder, ["dog " * 300], max_len=256)[0]  # its closing token kept, as here
    got = torch.tensor(cut.json()["data"][0]["embedding"])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    r = post(url, "/v1/completions", {"prompt": "hello", "max_tokens": 2})
    assert r.status_code == 400 and NO_HEAD[:40] in r.json()["error"]["message"]
    r = post(url, "/v1/rerank", {"query": "q", "documents": ["d"]})
    assert r.status_code == 400 and "output head" in r.json()["error"]["message"]
    ok = client(url).embeddings.create(model="tiny", input=TEXTS[0]).data[0].embedding
    torch.testing.assert_close(torch.tensor(ok), reference(folder, TEXTS[:1])[0], atol=1e-5, rtol=0)


def hf_rerank_scores(folder, query, docs, instruction=RERANK_INSTRUCTION) -> list:
    """Qwen3-Reranker's formula with HF transformers: P(yes) against no at the last position."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")
    head = tok.encode(RERANK_PREFIX, add_special_tokens=False)
    tail = tok.encode(RERANK_SUFFIX, add_special_tokens=False)
    scores = []
    for d in docs:
        body = f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {d}"
        ids = head + tok.encode(body, add_special_tokens=False) + tail
        logits = model(torch.tensor([ids])).logits[0, -1]
        scores.append(logits[[no, yes]].softmax(-1)[1].item())
    return scores


def test_rerank_scores_equal_the_formula_with_hf_transformers(reranker):
    url, folder = reranker
    docs = ["the quick brown fox", "hello world", "the lazy dog jumps", "world " * 10]
    want = hf_rerank_scores(folder, "where is the fox", docs)
    r = post(url, "/v1/rerank", {"query": "where is the fox", "documents": docs})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["index"] for x in results] == sorted(range(4), key=lambda i: -want[i])
    for x in results:
        assert abs(x["relevance_score"] - want[x["index"]]) < 1e-5
        assert x["document"]["text"] == docs[x["index"]]
    top = post(
        url,
        "/rerank",
        {
            "query": "where is the fox",
            "documents": [{"text": d} for d in docs],
            "top_n": 2,
            "return_documents": False,
            "instruction": "Find foxes",
        },
    )
    mine = hf_rerank_scores(folder, "where is the fox", docs, "Find foxes")
    got = top.json()["results"]
    assert len(got) == 2 and "document" not in got[0]
    assert [x["index"] for x in got] == sorted(range(4), key=lambda i: -mine[i])[:2]
    assert abs(got[0]["relevance_score"] - mine[got[0]["index"]]) < 1e-5


def test_rerank_truncates_a_long_document_and_keeps_the_prompt_format(reranker):
    """A document over the context: refused naming it, or with truncate its end is cut and the
    score is the formula's on the cut prompt (the assistant suffix kept)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    url, folder = reranker
    docs = ["the fox", "hello world " * 300]
    r = post(url, "/v1/rerank", {"query": "fox", "documents": docs})
    assert r.status_code == 400 and r.json()["error"]["param"] == "documents[1]", r.text
    r = post(url, "/v1/rerank", {"query": "fox", "documents": docs, "truncate": True})
    assert r.status_code == 200, r.text
    tok = AutoTokenizer.from_pretrained(folder)
    head = tok.encode(RERANK_PREFIX, add_special_tokens=False)
    tail = tok.encode(RERANK_SUFFIX, add_special_tokens=False)
    body = f"<Instruct>: {RERANK_INSTRUCTION}\n<Query>: fox\n<Document>: {docs[1]}"
    ids = head + tok.encode(body, add_special_tokens=False)[: 1024 - len(head) - len(tail)] + tail
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    logits = model(torch.tensor([ids])).logits[0, -1]
    yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")
    want = logits[[no, yes]].softmax(-1)[1].item()
    got = {x["index"]: x["relevance_score"] for x in r.json()["results"]}
    assert abs(got[1] - want) < 1e-5 and r.json()["usage"]["prompt_tokens"] <= 2 * 1024


def test_a_generative_model_without_pooling_files_says_how_to_serve_embeddings(reranker):
    url, folder = reranker
    r = post(url, "/v1/embeddings", {"input": "hello"})
    assert r.status_code == 400 and "give --pooling" in r.json()["error"]["message"], r.text
    r = post(url, "/v1/rerank", {"query": "q", "documents": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "documents"
    text = client(url).completions.create(model="tiny", prompt="hello", max_tokens=3)
    assert text.choices[0].finish_reason in ("stop", "length")


def test_serve_refuses_a_headless_checkpoint_without_pooling_at_load(tmp_path, capfd):
    import serve

    folder = embedding_folder(tmp_path, "lasttoken")
    (folder / "modules.json").unlink()
    assert serve.main(["--checkpoint", str(folder), "--dtype", "float32", "--port", "0"]) == 2
    assert "no modules.json" in capfd.readouterr().err
