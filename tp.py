"""Tensor parallelism: one model split across ranks with torch.distributed, Megatron-style.

    torchrun --nproc_per_node 3 generate.py --prompt "Hello"       # the embedded model, 3 ranks

Each transformer layer is two matrix pairs, and each pair needs one all-reduce:
- attention: q/k/v are split by output columns, so rank r computes heads r*H/W .. (r+1)*H/W
  (and the KV heads they read), attends locally, and o_proj, split by input rows, produces a
  partial sum of the layer output: all-reduce it. DeepSeek's latent attention splits its heads
  the same way (q_b_proj or q_proj, kv_b_proj, o_proj); its latent, one KV "head" shared by
  every head, is computed and cached whole on each rank (kv_a_proj, q_a_proj replicated).
- MLP: gate/up split by columns, down split by rows, one all-reduce. A mixture of experts
  (moe.py) splits each expert's width the same way; the router is replicated, so every rank
  picks the same experts, and one all-reduce follows the layer.
So a rank holds 1/W of every layer's weights and of the KV cache. Heads, KV heads and the FFN
width must divide by W; otherwise a clear error lists the world sizes that work.
The embedding and output head are replicated, not vocabulary-sharded: every rank computes the
same full logits with no extra communication, so sampling (with a seed shared by all ranks)
picks the same token everywhere. It costs `vocab * dim` bytes per rank (54 MiB for SmolLM2 in bf16).

Sharding happens while loading (weights.load(..., shard=(rank, world))): every tensor is sliced
before it is converted and kept, so a rank never holds more than its shard plus the replicated
parts. The model code is unchanged: it is built with the per-rank head counts, and the two
row-parallel projections per layer are wrapped in `RowParallel`, which all-reduces their output.
Backends: NCCL on GPUs, gloo on CPUs, launched by torchrun (one node or several).
"""

import dataclasses
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

# split output features (DeepSeek's q_b_proj and kv_b_proj: per-head rows of latent attention)
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "q_b_proj", "kv_b_proj")
ROW_PARALLEL = ("o_proj", "down_proj")  # split input features; outputs are partial sums


def init(timeout_s: float = 300.0):
    """(rank, world) from torchrun's environment; a process group when world > 1."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return dist.get_rank(), dist.get_world_size()


def working_world_sizes(config) -> list:
    kv_heads = [] if config.mla else [config.n_kv_heads]  # a latent is replicated, not split
    widths = [config.n_heads, *kv_heads, config.intermediate_size] + (
        config.moe.widths() if config.moe else []
    )
    return [w for w in range(1, config.n_heads + 1) if all(n % w == 0 for n in widths)]


def shard_config(config, world: int):
    """The ModelConfig of one rank's slice: 1/world of the heads, KV heads and FFN width. A latent
    attention's one latent "head" stays whole on every rank: each rank computes it (kv_a_proj,
    replicated) and caches it, then projects it up for its own heads only (kv_b_proj split)."""
    if world not in working_world_sizes(config):
        raise ValueError(
            f"tensor parallelism over {world} ranks needs the model's {config.n_heads} heads, "
            + ("" if config.mla else f"{config.n_kv_heads} KV heads ")
            + f"and FFN width {config.intermediate_size} to divide by {world}; world sizes that "
            f"work: {working_world_sizes(config)}"
        )
    return dataclasses.replace(
        config,
        n_heads=config.n_heads // world,
        n_kv_heads=config.n_kv_heads if config.mla else config.n_kv_heads // world,
        intermediate_size=config.intermediate_size // world,
        moe=config.moe and config.moe.sharded(world),
    )


def shard_tensor(name: str, tensor: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's slice of one full tensor, copied out so the full tensor can be freed."""
    parts = name.split(".")
    module, kind = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", "")
    if (
        module == "experts" and kind != "down_proj_bias"
    ):  # moe.py's gate, up [E, ff, dim], [E, ff]; down [E, dim, ff]
        return tensor.chunk(world, dim=2 if kind == "down_proj" else 1)[rank].clone(
            memory_format=torch.contiguous_format
        )
    if (
        module in COLUMN_PARALLEL or kind == "sinks"
    ):  # weight [out, in], bias [out], gpt-oss's sinks [H]: split out
        return tensor.chunk(world, dim=0)[rank].clone(memory_format=torch.contiguous_format)
    if module in ROW_PARALLEL or module == "experts":
        if kind == "weight":  # [out, in]: split in
            return tensor.chunk(world, dim=1)[rank].clone(memory_format=torch.contiguous_format)
        return (
            tensor if rank == 0 else torch.zeros_like(tensor)
        )  # bias: added once by the all-reduce
    return tensor  # norms, embedding, output head: replicated


class RowParallel(nn.Module):
    """A row-parallel linear (or a whole sparse MLP): each rank's partial product, summed across
    ranks."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.linear = linear

    def forward(self, x):
        y = self.linear(x)
        dist.all_reduce(y)  # the layer's one communication
        return y


def parallelize(model):
    """Wrap the row-parallel projections of a model loaded with shard=(rank, world)."""
    for layer in model.layers:
        layer.self_attn.o_proj = RowParallel(layer.self_attn.o_proj)
        if hasattr(layer.mlp, "experts"):  # experts and shared expert summed, then one all-reduce
            layer.mlp = RowParallel(layer.mlp)
        else:
            layer.mlp.down_proj = RowParallel(layer.mlp.down_proj)
    return model


def check_same_checkpoint(model):
    """Fail on every rank, rather than hang or compute garbage, if ranks loaded different models."""
    emb = model.embed_tokens.weight
    mine = (repr(model.config), float(emb.float().sum()), float(emb.float().square().sum()))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if any(other != everyone[0] for other in everyone):
        which = [r for r, other in enumerate(everyone) if other != everyone[0]]
        raise ValueError(
            f"ranks {which} loaded a different checkpoint from rank 0; every rank must load the "
            f"same one"
        )


def quiet_unless_rank_zero(rank: int):
    """torchrun starts one copy of the program per rank: only rank 0 talks to the terminal."""
    if rank != 0:
        sys.stdout = sys.stderr = open(os.devnull, "w")


def shared_seed(seed):
    """The seed every rank samples with: the user's, or one chosen by rank 0 and broadcast."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return seed
    value = [seed if seed is not None else int(torch.randint(0, 2**31 - 1, ()).item())]
    dist.broadcast_object_list(value, src=0)
    return value[0]
