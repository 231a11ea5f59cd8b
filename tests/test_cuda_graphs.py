"""speedups/cuda_graphs.py without a GPU: which integers key a graph, and the engine's steps
through GraphSteps' static buffers equal its eager steps (tokens as each request gets alone),
with a stand-in for the capture that reruns the step on the static buffers into the captured
output (what a replay does, minus the launch). Steps past the largest graph and captures out of
memory run eager, said once. A GPU run of the same (benchmarks/gpu_check.py) counts real graph
launches."""

import pytest
import torch
from helpers import alone, tiny_checkpoint

from engine import Engine, RequestParams, flat_forward
from formats import weights
from speedups.cuda_graphs import GraphSteps, Rerun, graph_key
from speedups.paged_flex import PagedFlex


class Recording(Rerun):
    """cuda_graphs.Rerun (each replay refills the captured output from the static buffers, as a
    CUDA graph's does) that records what it captured, and fails from a row count on."""

    def __init__(self, fail_from_rows=None, error=torch.OutOfMemoryError):
        self.fail_from_rows, self.error, self.captured = fail_from_rows, error, []

    def __call__(self, fn):
        replay, out = super().__call__(fn)
        rows = out.shape[0]  # (logits of every row: rows x T)
        if self.fail_from_rows is not None and rows >= self.fail_from_rows:
            raise self.error("stand-in: this graph cannot be captured")
        self.captured.append(rows)
        return replay, out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tiny_checkpoint(tmp_path_factory.mktemp("graphs-tiny"), max_position_embeddings=512)
    model, _ = weights.load(folder, dtype=torch.float64)
    return model


def greedy(n):
    return RequestParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


PROMPTS = [[5 + i, 9, 11 + 2 * i, 4] * (1 + i % 3) for i in range(6)]
NEWS = [12, 7, 15, 9, 11, 6]


@pytest.fixture(scope="module")
def reference(tiny):
    return [alone(tiny, p, n) for p, n in zip(PROMPTS, NEWS)]


def test_the_key_holds_every_integer_that_shapes_a_launch():
    table = torch.zeros(4, 8, dtype=torch.long)
    key = graph_key([(4, 1, table)])
    assert graph_key([(4, 1, table + 3)]) == key  # block ids are data, not launch shapes
    others = [
        graph_key([(6, 1, torch.zeros(6, 8, dtype=torch.long))]),  # rows
        graph_key([(4, 5, table)]),  # tokens per row (speculation's verify steps)
        graph_key([(4, 1, torch.zeros(4, 12, dtype=torch.long))]),  # attend width
        graph_key([(4, 1, torch.zeros(2, 4, 8, dtype=torch.long))]),  # a hybrid's two tables
    ]
    assert len({key, *others}) == 5
    # a reader whose launches do not depend on the width: tables padded, one key for all widths
    assert graph_key([(4, 1, table)], 32) == graph_key([(4, 1, torch.zeros(4, 12))], 32)
    with pytest.raises(ValueError, match="one group"):
        graph_key([(1, 1, table[:1]), (1, 3, table[:1])])


@pytest.mark.parametrize("reader", ["gather", "flex"])
def test_graph_steps_equal_eager_steps(tiny, reference, reader):
    engine = Engine.for_model(tiny, num_blocks=80, block_size=4, max_num_seqs=8)
    width = None
    if reader == "flex":  # eager FlexAttention: the reference path, so exact in float64
        engine.cache.read_in_place(PagedFlex(compiled=False, cuda=False))
        width = 32
    capture = Recording()
    engine.decode_fn = graphs = GraphSteps(flat_forward, 8, width, capture)
    out = engine.run_batch(PROMPTS, [greedy(n) for n in NEWS])
    assert [o["tokens"] for o in out] == reference
    s = graphs.stats
    assert s["captures"] == len(graphs.graphs) == len(capture.captured) >= 2  # rows buckets
    assert s["replays"] >= 10 and s["eager_steps"] == 0
    assert all(g.replays for g in graphs.graphs.values())
    if width:
        assert {g.key[2][-1] for g in graphs.graphs.values()} == {width}


def test_steps_past_the_largest_graph_run_eager_and_say_so_once(tiny, reference, capsys):
    engine = Engine.for_model(tiny, num_blocks=80, block_size=4, max_num_seqs=8)
    engine.decode_fn = graphs = GraphSteps(flat_forward, 2, None, Recording())
    out = engine.run_batch(PROMPTS, [greedy(n) for n in NEWS])
    assert [o["tokens"] for o in out] == reference
    assert graphs.stats["eager_steps"] > 0 and graphs.stats["replays"] > 0
    said = [x for x in capsys.readouterr().err.splitlines() if "past the largest graph" in x]
    assert len(said) == 1, said


def test_out_of_memory_at_capture_leaves_those_buckets_eager(tiny, reference, capsys):
    engine = Engine.for_model(tiny, num_blocks=80, block_size=4, max_num_seqs=8)
    capture = Recording(fail_from_rows=3)
    engine.decode_fn = graphs = GraphSteps(flat_forward, 8, None, capture)
    out = engine.run_batch(PROMPTS, [greedy(n) for n in NEWS])
    assert [o["tokens"] for o in out] == reference
    assert capture.captured and max(capture.captured) < 3
    assert graphs.too_big is not None and graphs.stats["eager_steps"] > 0
    assert "out of memory capturing" in capsys.readouterr().err


def test_a_step_that_cannot_be_captured_runs_eager(tiny, reference, capsys):
    engine = Engine.for_model(tiny, num_blocks=80, block_size=4, max_num_seqs=8)
    capture = Recording(fail_from_rows=1, error=RuntimeError)
    engine.decode_fn = graphs = GraphSteps(flat_forward, 8, None, capture)
    out = engine.run_batch(PROMPTS, [greedy(n) for n in NEWS])
    assert [o["tokens"] for o in out] == reference
    assert graphs.stats["replays"] == 0 and graphs.stats["eager_steps"] > 0
    err = capsys.readouterr().err
    assert err.count("failed (RuntimeError") == len(graphs.failed) > 0  # once per key
    assert "past the largest" not in err


def test_verify_steps_replay_graphs_of_their_own(tiny):
    """Prompt lookup's verify steps (1 + k tokens a row) replay graphs keyed by that T, and the
    tokens stay each request's alone-run tokens (repetitive prompts: drafts are accepted)."""
    from speedups.prompt_lookup import PromptLookup

    prompts = [[5, 6, 7, 8] * 4, [9, 10, 11] * 5, [12, 13] * 6]
    news = [12, 10, 9]
    engine = Engine.for_model(
        tiny, num_blocks=80, block_size=4, max_num_seqs=8, speculate=PromptLookup(k=3)
    )
    engine.decode_fn = graphs = GraphSteps(flat_forward, 8, None, Recording())
    out = engine.run_batch(prompts, [greedy(n) for n in news])
    assert [o["tokens"] for o in out] == [alone(tiny, p, n) for p, n in zip(prompts, news)]
    verify = [g for g in graphs.graphs.values() if g.key[1] == 4]
    assert verify and all(g.replays for g in verify)
    assert engine.drafted["draft_tokens_accepted"] > 0
