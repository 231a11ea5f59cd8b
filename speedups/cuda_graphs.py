"""The engine's decode steps (and speculation's verify steps) replayed as captured CUDA graphs,
one per key: the integers that shape the step's kernel launches.

    engine.decode_fn = GraphSteps(flat_forward, max_rows=64, fixed_width=None)
    # each decode-only step: its inputs copied into the key's static buffers, one graph launch

Why: an eager decode step launches its few hundred kernels from Python one by one; on a GPU that
can read the weights in under a millisecond, the launches are the step (benchmarks/RESULTS.md,
"The GPU check on an NVIDIA H200"). A CUDA graph records the launches once and replays them all in
one call (nano-vllm, vLLM and SGLang capture one per batch size).

A graph bakes in everything a launch was given: tensor addresses, so every input lives in a
static buffer (tokens, positions, the block table; the KV pools and weights stay where they are)
and the output is read from the static tensor the capture returned; and every integer that
shaped a kernel. Replaying a graph with a stale integer silently computes something else (a
baked-in maximum context length changed outputs in HF's continuous batching, transformers
#45323). Here those integers are, for the engine's compiled layout (step_layout.py: one group of
rows padded to a bucket):
- R, the group's rows (a bucket: 1, 2, 3, 4, 6, 8, 12, ...);
- T, tokens per row (1, or 1 + k under speculation);
- W, the block table's width (the attend width bucket), and a hybrid's two tables ([2, R, W]);
  with an attention that reads the pool in place (speedups/paged_flex.py) the width shapes no
  launch, so tables are padded to `fixed_width` and W leaves the key (fewer graphs);
- the model's own constants (block size, windows, head sizes), fixed for the engine's life.
`graph_key` computes the key; tests/test_cuda_graphs.py checks that steps differing in any of
these get different graphs and that replays equal eager steps.

Graphs are captured lazily, the first time a key is seen (each capture logged with its time), in
one memory pool. A step with more rows than max_rows runs eager, said once in the log. Out of
memory while capturing: that key and every larger one run eager from then on, with a message;
a key whose capture fails otherwise (a host sync inside its step, as a mixture of experts' grouped
path has past a few rows) runs eager from then on, said once per key. Without a GPU, `Rerun`
stands in for the capture.
"""

import time

import torch

from engine import flat_forward
from kv_cache import bucket
from runtime import log
from scheduler import blocks_for


def graph_key(groups, fixed_width=None) -> tuple:
    """The integers a decode step's launches depend on: (R, T, table shape). groups: the step's
    [(rows, tokens per row, table [R, W] or [2, R, W])], one group (the compiled layout)."""
    if len(groups) != 1:
        raise ValueError(f"a graph step is one group of rows; got {len(groups)}")
    rows, T, table = groups[0]
    shape = tuple(table.shape)
    if fixed_width is not None:
        shape = shape[:-1] + (fixed_width,)
    return (rows, T, shape)


class CudaCapture:
    """torch.cuda.graph over one memory pool: capture(fn) -> replay()."""

    def __init__(self):
        self.pool = torch.cuda.graph_pool_handle()

    def __call__(self, fn):
        stream = torch.cuda.Stream()  # warm up off the default stream, as capture requires
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA work on other threads (the KV tier's copies) may go on meanwhile
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = fn()
        return graph.replay, out


class Rerun:
    """A stand-in for CudaCapture where there is no GPU: "replay" reruns the step on the static
    buffers into the captured output. It checks buffers and keys, not what a real capture fixes."""

    def __call__(self, fn):
        out = fn()
        return (lambda: out.copy_(fn())), out


class Graph:
    """One key's static buffers and its recorded step."""

    def __init__(self, key, tokens, pos, table):
        self.key = key
        self.tokens, self.pos = torch.zeros_like(tokens), torch.zeros_like(pos)
        self.table = torch.zeros(key[2], dtype=table.dtype, device=table.device)
        self.replay, self.out, self.replays = None, None, 0

    def load(self, tokens, pos, table):
        """The step's inputs into the static buffers; table entries past its width: 0."""
        self.tokens.copy_(tokens)
        self.pos.copy_(pos)
        W = table.shape[-1]
        self.table[..., :W].copy_(table)
        if W < self.table.shape[-1]:  # a narrower table: its tail points at the null block
            self.table[..., W:].zero_()


class GraphSteps:
    """The engine's decode_fn: step(model, cache, tokens [1, N], pos [1, N]) -> logits [N, V],
    replayed per key. capture: CudaCapture() on a GPU; Rerun() where there is none (tests,
    gpu_check on CPU)."""

    def __init__(self, step, max_rows: int, fixed_width=None, capture=None):
        self.step, self.max_rows, self.fixed_width = step, max_rows, fixed_width
        self.capture = capture if capture is not None else CudaCapture()
        self.graphs, self.eager_said, self.too_big, self.failed = {}, False, None, set()
        self.stats = dict(captures=0, replays=0, eager_steps=0, capture_s=0.0)

    def __call__(self, model, cache, tokens, pos):
        rows, T, table = cache.groups[0]
        key = graph_key(cache.groups, self.fixed_width)
        wide = self.fixed_width is not None and table.shape[-1] > self.fixed_width
        if wide or rows > self.max_rows or (self.too_big is not None and rows >= self.too_big):
            return self._eager(model, cache, tokens, pos, key)
        if key in self.failed:
            return self._eager(model, cache, tokens, pos, key, quiet=True)
        graph = self.graphs.get(key)
        if graph is None:
            graph = self._capture(key, model, cache, tokens, pos, table)
            if graph is None:
                return self._eager(model, cache, tokens, pos, key, quiet=True)
        graph.load(tokens, pos, table)
        graph.replay()
        graph.replays += 1
        self.stats["replays"] += 1
        return graph.out

    def _capture(self, key, model, cache, tokens, pos, table):
        graph = Graph(key, tokens, pos, table)
        graph.load(tokens, pos, table)
        outer = cache.groups

        def run():
            cache.groups = [(key[0], key[1], graph.table)]
            try:
                return self.step(model, cache, graph.tokens, graph.pos)
            finally:
                cache.groups = outer

        start = time.perf_counter()
        try:
            graph.replay, graph.out = self.capture(run)
        except torch.OutOfMemoryError:
            self.too_big = key[0] if self.too_big is None else min(self.too_big, key[0])
            log(
                f"CUDA graphs: out of memory capturing {key[0]} rows; steps of {self.too_big} "
                "rows or more run eager (fewer buckets: a smaller --max_num_seqs)"
            )
            return None
        except Exception as e:  # a step that cannot be captured (a host sync inside)
            self.failed.add(key)
            log(f"CUDA graphs: capture of {key} failed ({type(e).__name__}: {e}); it runs eager")
            return None
        seconds = time.perf_counter() - start
        self.stats["captures"] += 1
        self.stats["capture_s"] += seconds
        rows, T, shape = key
        log(f"CUDA graph captured: {rows} rows x {T} tokens, table {shape} ({seconds:.2f} s)")
        self.graphs[key] = graph
        return graph

    def _eager(self, model, cache, tokens, pos, key, quiet=False):
        if not (self.eager_said or quiet):
            self.eager_said = True
            most = min(self.max_rows, (self.too_big or 1 << 30) - 1)
            log(
                f"CUDA graphs: a step of {key[0]} rows, table {key[2]}, is past the largest graph "
                f"({most} rows, table width {self.fixed_width or 'any'}); such steps run eager"
            )
        self.stats["eager_steps"] += 1
        return self.step(model, cache, tokens, pos)


def for_engine(engine, capture=None) -> GraphSteps:
    """The engine's decode steps as graphs: rows up to its max_num_seqs' bucket; with an in-place
    reader, tables padded to the widest a request of max_model_len (and its drafts) needs.
    capture: CudaCapture() unless given (Rerun on CPU)."""
    draft = engine.speculate.k if engine.speculate else 0
    width = bucket(blocks_for(engine.max_model_len + draft, engine.cache.block_size))
    return GraphSteps(
        flat_forward,
        bucket(engine.scheduler.max_num_seqs),
        width if engine.cache.in_place is not None else None,
        capture,
    )
