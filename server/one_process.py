"""An engine loaded in one process from the flags batch.py and serve.py share
(server/engine_flags.py): the checkpoint (and a draft model), LoRA adapters, the KV pool's plan,
a second KV tier, how attention reads the pool, and the decode steps' fast form (the
ahead-of-time packages on CPU, CUDA graphs on a GPU). server/tp_engine.py's `load_engine` calls
it outside torchrun.

    engine, tokenizer, info = load_one_process(checkpoint=None, compile="auto")
"""

import contextlib

import torch

from engine import Engine
from formats.tokenizer import load_tokenizer
from kv_cache import bucket
from memory import gpu_kv_budget, graphs_bytes, plan_blocks, step_peak, weights_line
from runtime import DTYPES, human, log, pick_device
from speedups.draft_model import DraftModel
from speedups.prompt_lookup import PromptLookup


def load_one_process(
    checkpoint=None,
    device=None,
    dtype="bfloat16",
    compile=False,
    quantize=None,
    block_size=16,
    num_blocks=None,
    kv_cache_memory=None,
    max_num_seqs=64,
    max_num_batched_tokens=512,
    schedule_policy="fcfs",
    prefix_caching=True,
    dequantize=False,
    batch_invariant=False,
    speculate=None,
    speculate_k=4,
    prompt_lookup_min=1,
    prompt_lookup_max=3,
    draft_checkpoint=None,
    kv_tier=None,
    lora=None,
    paged_attention="auto",
    gpu_memory_utilization=0.9,
):
    """(Engine, tokenizer, load info) for a checkpoint in this process (its flags:
    engine_flags.add_engine_args; kv_tier, lora: engine_flags.tier_options', lora_options');
    logs the memory plan. Then, as generate.py, drops what only loading needed (weights.settle)."""
    proposer = lookup_proposer(speculate, speculate_k, prompt_lookup_min, prompt_lookup_max)
    model, tokenizer, info, draft, draft_info = load_models(
        checkpoint, device, dtype, quantize, dequantize, speculate, draft_checkpoint
    )
    adapters = attach_adapters(model, lora)  # (their slots before the plan: it counts them)
    sizes = dict(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    graphs = compile == "auto" and not batch_invariant  # on CUDA: the graphs' share of the plan
    sizes["graph_tokens"] = (1 + speculate_k if speculate else 1) if graphs else 0
    num_blocks, window_blocks = plan_pool(
        model, info, draft, block_size, num_blocks, kv_cache_memory, gpu_memory_utilization, **sizes
    )
    if draft is not None:
        proposer = draft_proposer(draft, draft_info, model, speculate_k, num_blocks, block_size)
    engine = Engine.for_model(
        model,
        num_blocks,
        block_size,
        max_num_seqs,
        max_num_batched_tokens,
        prefix_caching,
        schedule_policy,
        tokenizer.stop_ids,
        tokenizer,
        compile in ("jit", True),
        batch_invariant=batch_invariant,
        window_blocks=window_blocks,
        speculate=proposer,
        tier=make_tier(model, block_size, kv_tier),
    )
    load = dict(checkpoint=checkpoint, quantize=quantize, dequantize=dequantize, dtype=dtype)
    set_steps(engine, load, compile, batch_invariant, paged_attention, adapters)
    return engine, tokenizer, info


def lookup_proposer(speculate, k: int, min_n: int, max_n: int):
    """--speculate prompt_lookup's proposer, or None (a draft model's comes after the plan)."""
    return PromptLookup(k, min_n, max_n) if speculate == "prompt_lookup" else None


def set_steps(engine, load: dict, compile, batch_invariant, paged_attention, adapters):
    """The engine's LoRA adapters, how its cache reads its pool (--paged_attention,
    speedups/paged_flex.py) and its decode steps' fast form (--compile auto|aot: aot_step)."""
    from speedups import paged_flex

    engine.adapters = adapters

    paged_flex.choose(engine.cache, paged_attention)
    if engine.scheduler.tier is not None:  # (flex lays K's blocks out as V's)
        engine.scheduler.tier.expected = engine.cache.block_shapes()
    if compile in ("auto", "aot"):
        engine.decode_fn = aot_step(engine, load, compile, batch_invariant, paged_attention)


def attach_adapters(model, options):
    """The model's projections wrapped for options["slots"] adapters, those of --lora loaded:
    lora.Adapters, logged; None without adapters."""
    if not options:
        return None
    from formats.lora_files import read_adapter
    from speedups import lora

    adapters = lora.Adapters(model, options["slots"], options["rank"])
    for name, path in options["adapters"]:
        adapters.load(read_adapter(path, model.config, name))
    names = ", ".join(adapters.served()) or "none yet"
    log(
        f"LoRA: {options['slots']} adapter slots of rank <= {options['rank']} "
        f"({human(adapters.nbytes())}), loaded: {names}"
    )
    return adapters


def make_tier(model, block_size: int, options):
    """A second tier for evicted prefix blocks (speedups/kv_tier.py) as --kv_disk_cache and
    --kv_host_cache ask, logged; None without them. (A draft model's pool is not kept: it trusts
    a block only for the tokens it filled it with, so it recomputes what the tier loads.)"""
    if not options:
        return None
    from speedups.kv_disk import DiskTier
    from speedups.kv_tier import HostOverDisk, HostTier, fingerprint

    host = disk = None
    if options.get("host"):
        pin = model.norm.weight.device.type == "cuda"
        log(f"KV host tier: {human(options['host'])}" + (" (pinned)" if pin else ""))
        host = HostTier(options["host"], pin)
    if options.get("disk"):
        fp = fingerprint(model, block_size, model.norm.weight.dtype)
        disk = DiskTier(options["disk"], options["disk_size"], fp)
        held, most = human(disk.stats["tier_bytes"]), human(disk.capacity)
        log(f"KV disk tier: {disk.root}, {held} of {most} held")
    return HostOverDisk(host, disk) if host and disk else host or disk


def load_models(checkpoint, device, dtype, quantize, dequantize, speculate, draft_checkpoint):
    """(model, tokenizer, load info, draft model, its load info): the checkpoint, and with
    --speculate draft the draft checkpoint on the model's device (else None, None), both before
    the memory plan (the draft's pool takes a share of the KV memory); then what only loading
    needed is dropped (weights.settle)."""
    from formats import weights

    model, info = weights.load_for_inference(
        checkpoint, pick_device(device), DTYPES[dtype], quantize, dequantize=dequantize, log=log
    )
    tokenizer = load_tokenizer(info.source)
    draft = draft_info = None
    if speculate == "draft":
        draft, draft_info = weights.load_for_inference(
            draft_checkpoint,
            model.norm.weight.device,
            DTYPES[dtype],
            quantize,
            dequantize=dequantize,
            log=log,
        )
    weights.settle()
    return model, tokenizer, info, draft, draft_info


def plan_pool(
    model,
    info,
    draft,
    block_size,
    num_blocks,
    kv_cache_memory,
    gpu_memory_utilization,
    max_num_seqs,
    max_num_batched_tokens,
    graph_tokens=0,
):
    """(num_blocks, window_blocks) of the paged KV pool this process's memory allows (the draft's
    pool included), logged with what was loaded. On CUDA without a size given: what
    --gpu_memory_utilization leaves after the weights, a step's activations and the CUDA graphs
    (graph_tokens: tokens per row of the widest, 0: no graphs)."""
    device, gpu = model.norm.weight.device, ""
    if device.type == "cuda" and num_blocks is None and kv_cache_memory is None:
        activations = step_peak(model, max_num_batched_tokens)
        rows = bucket(max_num_seqs)
        graphs = graphs_bytes(model, rows, graph_tokens) if graph_tokens else 0
        free, total = torch.cuda.mem_get_info(device)
        held = torch.cuda.memory_allocated(device)
        kv_cache_memory, gpu = gpu_kv_budget(
            total, free, gpu_memory_utilization, held, activations, graphs
        )
    num_blocks, window_blocks, plan = plan_blocks(
        model,
        block_size,
        num_blocks,
        kv_cache_memory,
        max_tokens=max_num_seqs * model.config.max_position_embeddings,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        draft=draft,
    )
    log(
        f"loaded {info.source} in {info.load_s:.2f} s"
        + (f" (at the file's own bits: {info.own_bits})" if info.own_bits else "")
        + f"\n{weights_line(model)}{plan}"
        + (f"\n{gpu}" if gpu else "")
    )
    return num_blocks, window_blocks


def draft_proposer(draft, draft_info, model, speculate_k, num_blocks, block_size):
    """--speculate draft: the draft model as the engine's proposer (its KV pool under the target's
    block ids), logged."""
    proposer = DraftModel(draft, model, speculate_k, num_blocks, block_size)
    log(
        f"draft model {draft_info.source} loaded in {draft_info.load_s:.2f} s: "
        f"{weights_line(draft)}its KV pool {human(proposer.cache.nbytes())} (the target's "
        f"{num_blocks} block ids and scratch)"
    )
    return proposer


def aot_refusal(engine, batch_invariant, paged_attention="auto"):
    """Why the ahead-of-time compiled step cannot serve this engine, or a false value."""
    return (
        (batch_invariant and "--batch_invariant runs eager steps")
        or (engine.device.type != "cpu" and "it runs on CPU; use --compile")
        or (paged_attention != "auto" and f"--paged_attention {paged_attention} is not packaged")
        or (engine.model.lm_head is None and "the model has no output head (embeddings only)")
    )


def aot_step(engine, load: dict, compile: str, batch_invariant, paged_attention="auto"):
    """--compile auto|aot: the engine's decode-only steps (and with speculation its verify steps,
    1 + k tokens a row) as speedups/aot.py's paged packages (built once, in a child process, cached
    on disk); None (eager) where they cannot serve: quietly for what --batch_invariant rules out,
    with the reason in one line for a failed build. --compile aot raises instead. On CUDA, auto
    replays the steps as CUDA graphs (speedups/cuda_graphs.py)."""
    from speedups import aot, cuda_graphs

    if compile == "auto" and engine.device.type == "cuda" and not batch_invariant:
        return cuda_graphs.for_engine(engine)
    refusal = aot_refusal(engine, batch_invariant, paged_attention)
    if refusal:
        if compile == "aot":
            raise ValueError(f"--compile aot: {refusal}")
        return None
    # the package binds the base layers' tensors by their names: adapters' wrappers set aside
    with engine.adapters.unwrapped() if engine.adapters else contextlib.nullcontext():
        verify = 1 + engine.speculate.k if engine.speculate else 0
        step = aot.decode_step(engine.model, engine.cache, load, compile == "auto", verify)
    return step if isinstance(step, aot.AotDecode) else None
