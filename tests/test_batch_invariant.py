"""batch_invariant.py: a greedy request's logits, bit for bit, and so its tokens do not depend on
what runs beside it: alone, inside batches of every size 1-32, chunked by other budgets,
preempted, or continued from its own output as a prompt."""

import argparse
import contextlib
import random
from unittest import mock

import helpers
import pytest
import torch
import torch.nn.functional as F

import batch_invariant
import quantize
from engine import Engine, Finished, RequestParams
from formats import quant_groups, weights
from kv_cache import attention, bucket, visible
from server import engine_flags
from server.tp_engine import load_engine

WORDS = (
    "the river stone cloud music paper light house garden printing press Europe history begins"
).split()


@pytest.fixture
def invariant():  # the int4 layers' route is process-wide: undone after each test
    batch_invariant.one_int4_route()
    yield
    batch_invariant.disable()


def test_the_mode_keeps_every_int4_layer_on_the_kernel(invariant):
    """one_int4_route: no int4 layer, however large, switches to dequantize + GEMM by row count."""
    for shape in ((576, 576), (16384, 2048)):
        assert quantize.int4_large_m(*shape, torch.bfloat16) > 1 << 40, shape


@pytest.mark.parametrize(
    "start, n, bs", [(0, 1, 16), (0, 700, 16), (5, 300, 16), (40, 3, 4), (127, 2, 16), (47, 1, 16)]
)
def test_pieces_cut_a_chunk_where_the_width_changes(start, n, bs):
    got = [w for m, w in batch_invariant.pieces(start, n, bs) for _ in range(m)]
    assert got == [bucket(p // bs + 1) for p in range(start, start + n)]
    widths = [w for _, w in batch_invariant.pieces(start, n, bs)]
    assert all(a != b for a, b in zip(widths, widths[1:]))  # no cut where nothing changes


def linear_layer(kind, K, N=192):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(N, K, generator=g) * 0.05
    if kind == "bf16":
        return torch.nn.Linear(K, N, bias=False).to(torch.bfloat16).requires_grad_(False)
    if kind.startswith("int8 groups"):  # a GGUF Q8_0/Q4_1 layer at its own bits: two int4 halves
        q = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8)
        missing = kind.endswith("dequantized")  # as where the int4 kernel is missing: F.linear
        with (
            mock.patch.object(
                quantize, "check_int4_device", side_effect=ValueError("no int4 kernel")
            )
            if missing
            else contextlib.nullcontext()
        ):
            layer = quant_groups.Int8GroupLinear(
                q, torch.rand(N, K // 32, generator=g) * 0.02, None, None, torch.bfloat16
            )
        assert (layer.pair is None) == missing
        return layer
    return quantize.make_layer(
        quantize.portable_tensors(w, kind, 64), None, kind, 64, torch.bfloat16, "cpu"
    )


def mode_route(layer):
    """The layer as the mode runs it: float matrices in blocks of batch_invariant.ROWS rows."""
    float_layer = batch_invariant.float_layers(layer)
    return batch_invariant.fixed_rows(layer.forward) if float_layer else layer


@pytest.mark.isa
@pytest.mark.parametrize("K", [576, 1536])  # SmolLM2's widths; 1536: its down_proj
@pytest.mark.parametrize("kind", ["bf16", "int8", "int4", "int8 groups", "int8 groups dequantized"])
def test_every_linear_route_gives_a_row_the_same_bits_at_any_row_count(kind, K, invariant):
    """Each weight format as the mode runs it, from one row: the quantized kernels as they are,
    float matrices (bf16, GGUF groups dequantized) in blocks of ROWS rows."""
    layer = linear_layer(kind, K)
    route = mode_route(layer)
    x = torch.randn(301, K, generator=torch.Generator().manual_seed(1)).bfloat16()
    with torch.no_grad():
        alone = torch.cat([route(x[i : i + 1]) for i in range(0, 300, 37)])  # rows 0, 37, ...
        for rows in (2, 3, 16, 17, 37, 127, 128, 129, 300):  # 128: the default int4 route switches
            y = route(x[:rows])
            for j, i in enumerate(range(0, rows, 37)):
                assert torch.equal(y[i], alone[j]), (kind, rows, i)


def test_fixed_rows_calls_the_layer_with_rows_blocks_only_and_equals_it():
    """Every call the mode makes has exactly ROWS rows (one shape: one oneDNN kernel on any CPU
    kind, AMX included), and the result is the layer's own, row for row."""
    layer = linear_layer("bf16", 64, N=8).double()
    shapes = []

    def spy(x):
        shapes.append(tuple(x.shape))
        return layer(x)

    x = torch.randn(2, 37, 64, dtype=torch.float64)
    with torch.no_grad():
        y = batch_invariant.fixed_rows(spy)(x)
        torch.testing.assert_close(y, layer(x), rtol=1e-12, atol=1e-12)
    assert y.shape == (2, 37, 8) and shapes == [(batch_invariant.ROWS, 64)] * 5  # 74 rows: 5 blocks


def paged_rows(positions, L, H=9, Hkv=3, D=64, dtype=torch.bfloat16, seed=0):
    """q [1, T, H, D] at `positions`, K/V [1, Hkv, L, D] and each query's mask [1, 1, T, L]."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, len(positions), H, D, generator=g).to(dtype)
    k, v = (torch.randn(1, Hkv, L, D, generator=g).to(dtype) for _ in range(2))
    return q, k, v, visible(torch.arange(L), torch.tensor([positions]))


@pytest.mark.isa
@pytest.mark.parametrize(
    "H, Hkv, L", [(9, 3, 256), (4, 4, 2048)]
)  # grouped heads; one head per KV head, long
def test_attention_gives_a_query_the_same_bits_alone_or_among_others(H, Hkv, L):
    """A query of a 100-token prefill chunk == the same query as a one-token row, alone or among 5
    others."""
    q, k, v, mask = paged_rows(list(range(L - 160, L - 60)), L, H, Hkv)
    chunk = batch_invariant.attention(q, k, v, mask)  # [1, 100, H, D]
    for t in (0, 41, 99):
        for rows in ([t], [t, 3, 50, 77, 98, 12]):  # decode rows, t first
            R = len(rows)
            y = batch_invariant.attention(
                q[0, rows][:, None],
                k.expand(R, -1, -1, -1),
                v.expand(R, -1, -1, -1),
                mask[0, :, rows].transpose(0, 1)[:, :, None],
            )
            assert torch.equal(y[0, 0], chunk[0, t]), (t, R)


@pytest.mark.parametrize("H, Hkv, T, R", [(9, 3, 100, 1), (4, 1, 1, 1), (4, 4, 1, 6)])
def test_attention_products_have_rows_rows_and_a_batch_of_two_or_more(H, Hkv, T, R, monkeypatch):
    """What keeps oneDNN on one kernel and one reduction order (batch_invariant.py): every
    product [ROWS, K] x [K, N], in a batch of at least two (a batch of one may split K)."""
    shapes, matmul = [], torch.matmul

    def spy(a, b):
        y = matmul(a, b)
        shapes.append((a.shape[-2], y.numel() // (y.shape[-2] * y.shape[-1])))  # (rows, batch)
        return y

    monkeypatch.setattr(torch, "matmul", spy)
    q, k, v, mask = paged_rows(list(range(200 - T, 200)), 256, H, Hkv)
    y = batch_invariant.attention(
        q.expand(R, -1, -1, -1),
        k.expand(R, -1, -1, -1),
        v.expand(R, -1, -1, -1),
        mask.expand(R, -1, -1, -1),
    )
    assert y.shape == (R, T, H, 64) and len(shapes) == 2
    assert all(rows == batch_invariant.ROWS and batch >= 2 for rows, batch in shapes), shapes


@pytest.mark.parametrize("softcap, sinks", [(0.0, False), (30.0, False), (0.0, True)])
def test_attention_equals_the_reference(softcap, sinks):
    q, k, v, mask = paged_rows(list(range(20, 52)), 64, dtype=torch.float64)
    s = torch.randn(9, dtype=torch.float64) if sinks else None
    ref = attention(q, k, v, mask, softcap, s)  # with softcap or sinks its softmax runs in float32
    tol = 1e-6 if softcap or sinks else 1e-10
    torch.testing.assert_close(
        batch_invariant.attention(q, k, v, mask, softcap, s), ref, rtol=tol, atol=tol
    )
    plain = F.scaled_dot_product_attention(
        q.transpose(1, 2), k, v, attn_mask=mask, enable_gqa=True
    ).transpose(1, 2)
    if not softcap and not sinks:
        torch.testing.assert_close(
            batch_invariant.attention(q, k, v, mask), plain, rtol=1e-10, atol=1e-10
        )


class Probe:
    """An engine on the embedded model (bf16 at the file's own bits, the server's default) that
    keeps the logits of the request named "probe" at each of its steps."""

    def __init__(self, batch_invariant=True, **options):
        self.engine, self.tokenizer, _ = load_engine(batch_invariant=batch_invariant, **options)
        self.logits, sample = [], self.engine._sample

        def spy(plan, done, logits, events):
            self.logits += [
                logits[i].clone() for i, s in enumerate(done) if s.request.id == "probe"
            ]
            return sample(plan, done, logits, events)

        self.engine._sample = spy

    def run(self, prompt, others=(), new=8):
        """(the probe's logits [new, V], its tokens) with `others` (prompt, max_new_tokens) beside
        it."""
        self.logits.clear()
        self.engine.add_request(
            prompt, RequestParams(max_new_tokens=new, temperature=0, ignore_eos=True), "probe"
        )
        for j, (p, n) in enumerate(others):
            self.engine.add_request(
                p, RequestParams(max_new_tokens=n, temperature=0, ignore_eos=True), f"other{j}"
            )
        tokens = None
        while self.engine.has_unfinished():
            for e in self.engine.step():
                if isinstance(e, Finished) and e.request_id == "probe":
                    tokens = e.result["tokens"]
        assert self.engine.scheduler.allocator.num_used() == 0
        return torch.stack(self.logits), tokens


def words(rng, n, tokenizer):
    return tokenizer.encode(" ".join(rng.choice(WORDS) for _ in range(n)))


def test_greedy_logits_alone_equal_inside_batches_of_every_size_1_to_32(invariant):
    """The bug it fixes: without the mode, a 200-token prompt prefilled in the same steps (over 128
    rows: the other int4 route) or a prompt cut into other chunks changed the probe's logits."""
    probe = Probe(max_num_batched_tokens=256, num_blocks=400)
    rng = random.Random(0)
    prompt = words(rng, 40, probe.tokenizer)
    ref, tokens = probe.run(prompt, new=3)
    for size in range(1, 33):
        others = [
            (words(rng, rng.randint(1, 8), probe.tokenizer), rng.randint(1, 3))
            for _ in range(size - 1)
        ]
        if size % 4 == 2:  # a long prompt beside it: steps of more than 128 rows
            others.append((words(rng, 200, probe.tokenizer), 2))
        logits, got = probe.run(prompt, others, new=3)
        assert torch.equal(logits, ref) and got == tokens, f"{len(others)} others"


@pytest.mark.parametrize("dequantize", [False, True])  # the file's own bits; dense bf16 (F.linear)
def test_greedy_logits_unchanged_by_chunking_preemption_and_own_output_as_prompt(
    dequantize, invariant, monkeypatch
):
    rows, linear = set(), F.linear  # the row counts of every float GEMM the engine makes

    def spy(x, w, b=None):
        rows.add(x.reshape(-1, x.shape[-1]).shape[0])
        return linear(x, w, b)

    monkeypatch.setattr(F, "linear", spy)
    rng = random.Random(1)
    alone = Probe(max_num_batched_tokens=512, num_blocks=40, dequantize=dequantize)
    prompt = words(rng, 150, alone.tokenizer)
    ref, tokens = alone.run(prompt, new=12)  # its decode steps have one row
    if dequantize:  # every float product in the mode has ROWS rows, whatever the step's
        assert all(
            getattr(m.forward, "fixed_rows", False)
            for m in batch_invariant.float_layers(alone.engine.model)
        )
    # 39 blocks of 16 tokens for 6 requests of ~170
    tight = Probe(max_num_batched_tokens=48, max_num_seqs=8, num_blocks=40, dequantize=dequantize)
    others = [(words(rng, 150, tight.tokenizer), 16) for _ in range(5)]
    logits, got = tight.run(prompt, others, new=12)
    assert tight.engine.scheduler.stats["preemptions"] > 0
    assert torch.equal(logits, ref) and got == tokens
    rows.discard(0)  # the head of a step that samples nothing: no row to change
    assert rows == (
        {batch_invariant.ROWS} if dequantize else set()
    )  # one shape per layer, AMX or not
    # its first 5 tokens computed as prompt rows (positions 144-154 in one chunk: the cache holds
    # only full blocks) instead of decode rows: the same K/V bits
    logits, got = alone.run(prompt + tokens[:5], new=7)
    assert torch.equal(logits, ref[5:]) and got == tokens[5:]


def test_the_flag_reaches_the_engine_and_refuses_compiled_steps(capsys):
    p = argparse.ArgumentParser()
    engine_flags.add_engine_args(p)
    args = p.parse_args(["--batch_invariant"])
    engine_flags.check_engine_args(p, args)
    assert engine_flags.engine_options(args)["batch_invariant"] is True
    with pytest.raises(SystemExit):
        engine_flags.check_engine_args(p, p.parse_args(["--batch_invariant", "--compile"]))
    assert "--batch_invariant runs eager steps" in capsys.readouterr().err


def test_without_the_mode_the_same_request_changes_beside_a_long_prompt():
    """The scenario the tests above use does reach what the mode fixes: by default it changes
    bits."""
    probe = Probe(batch_invariant=False, max_num_batched_tokens=256, num_blocks=100)
    rng = random.Random(0)
    prompt = words(rng, 40, probe.tokenizer)
    ref, _ = probe.run(prompt, new=1)
    logits, _ = probe.run(prompt, [(words(rng, 200, probe.tokenizer), 1)], new=1)
    assert not torch.equal(logits, ref)


def test_the_mode_refuses_what_it_does_not_prove(tmp_path):
    folder = helpers.tiny_checkpoint(tmp_path)
    model, _ = weights.load(folder, dtype=torch.float32)
    with pytest.raises(
        ValueError,
        match="proven on CPU in bfloat16 for dense models; this model runs on cpu in float32",
    ):
        Engine.for_model(model, num_blocks=16, batch_invariant=True)
    assert quantize.INT4_LARGE_M == 128  # refused before it changed anything
