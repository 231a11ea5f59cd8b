"""Checking a checkpoint before and while it loads: anything wrong is one CheckpointError naming
the file and what is wrong in it, raised where the bad value enters, never a stack trace from deep
inside a matmul.

- check_config: the sizes a config claims, before anything is built: positive integers, a context
  below MAX_CONTEXT, RoPE scaling the model can run, and no more parameters than the weight files
  can hold at 2 bits each;
- expected_tensors: ({name: shape}, {name: dtype}) the model built on the meta device expects (a
  checkpoint written by quantize.py holds its own tensors in place of its quantized layers');
- check_tensor: each tensor as it is read: a name the model expects, that shape (and dtype, for
  quantize.py's tensors), no NaN or infinite values;
- check_complete: after the last file, every expected tensor has arrived.

formats/weights.py calls them in that order, e.g. for SmolLM2-135M (dim 576):

    expected, qdtypes = expected_tensors(model, None)  # {"norm.weight": torch.Size([576]), ...}, {}
    check_tensor("model.safetensors", "norm.weight", torch.ones(575), expected, qdtypes, None)
    # CheckpointError: model.safetensors: tensor 'norm.weight' has shape (575,), expected (576,)
"""

import torch

from formats import quant_groups
from model import ModelConfig
from moe import PROJECTIONS
from rope import SUPPORTED, kind_of
from runtime import CheckpointError

MAX_CONTEXT = 2**24  # tokens; the longest context of any released model is below this


def check_config(config: ModelConfig, total_bytes: int, source):
    """Sizes a config may claim, checked before anything is built: positive integers, a context
    below MAX_CONTEXT, and no more parameters than the weight files can hold at 2 bits each (a
    config claiming 100000 layers would otherwise build 100000 layers before finding no tensors)."""
    for name in (
        "vocab_size",
        "dim",
        "n_layers",
        "n_heads",
        "n_kv_heads",
        "intermediate_size",
        "max_position_embeddings",
    ):
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise CheckpointError(f"{source}: {name} must be a positive integer, got {value!r}")
    for name in ("norm_eps", "rope_theta"):
        value = getattr(config, name)
        if (
            not isinstance(value, (int, float))
            or isinstance(value, bool)
            or not 0 < value < float("inf")
        ):
            raise CheckpointError(f"{source}: {name} must be a positive number, got {value!r}")
    if not isinstance(config.sliding_window, int) or not isinstance(config.rope_scaling, dict):
        raise CheckpointError(
            f"{source}: sliding_window {config.sliding_window!r} or rope_scaling "
            f"{config.rope_scaling!r} is not usable"
        )
    check_rope_scaling(
        config.rope_scaling,
        config.rotary_dim or config.head_dim or config.dim // config.n_heads,
        source,
    )
    if config.max_position_embeddings > MAX_CONTEXT:
        raise CheckpointError(
            f"{source}: a context of {config.max_position_embeddings} tokens is beyond "
            f"{MAX_CONTEXT}; the config is wrong"
        )
    if (
        not isinstance(config.head_dim, int)
        or config.head_dim < 0
        or config.n_heads % config.n_kv_heads
    ):
        raise CheckpointError(
            f"{source}: head_dim {config.head_dim!r}, {config.n_heads} heads and "
            f"{config.n_kv_heads} KV heads do not make a model"
        )
    head_dim = config.head_dim or config.dim // config.n_heads
    per_layer = (
        config.dim * head_dim * (2 * config.n_heads + 2 * config.n_kv_heads)
        + 3 * config.dim * config.intermediate_size
    )
    params = config.n_layers * per_layer + config.vocab_size * config.dim
    if total_bytes is not None and params / 4 > total_bytes:
        raise CheckpointError(
            f"{source}: the config describes {params:,} parameters ({config.n_layers} layers), "
            f"more than the {total_bytes:,} bytes of weights hold; it does not match them"
        )


def expected_tensors(model, quant):
    """({name: shape} the checkpoint must hold, {name: dtype} of quantize.py's tensors) for this
    model: a checkpoint written by quantize.py holds other tensors in place of its quantized layers'
    weights."""
    expected = {n: p.shape for n, p in model.state_dict().items()}
    if not quant:
        return expected, {}
    from formats import quant_files

    specs = quant_files.expected_tensors(model, quant)
    for name in quant["layers"]:  # a layer's weight, or stacked experts' projections (moe.py)
        for key in (f"{name}.weight", *(f"{name}.{p}" for p in PROJECTIONS)):
            expected.pop(key, None)
    expected.update({n: shape for n, (shape, _) in specs.items()})
    return expected, {n: dt for n, (_, dt) in specs.items()}


def check_tensor(file, name, tensor, expected, qdtypes, quant):
    """A CheckpointError unless the tensor is one the model expects, in its shape (and dtype, for
    quantize.py's)."""
    if name not in expected:
        raise CheckpointError(
            f"{file}: unexpected tensor {name!r}: this checkpoint does not match its config"
        )
    if tuple(tensor.shape) != tuple(expected[name]):
        raise CheckpointError(
            f"{file}: tensor {name!r} has shape {tuple(tensor.shape)}, "
            f"expected {tuple(expected[name])}"
        )
    if (
        name in qdtypes
        and not isinstance(tensor, quant_groups.Packed)
        and tensor.dtype != qdtypes[name]
    ):
        raise CheckpointError(
            f"{file}: tensor {name!r} is {tensor.dtype}, expected {qdtypes[name]} ({quant['mode']})"
        )
    if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and tensor.numel():
        # one pass that NaN propagates through (RESULTS.md, "NaN check")
        low, high = torch.aminmax(tensor)
        if not (torch.isfinite(low) and torch.isfinite(high)):
            raise CheckpointError(f"{file}: tensor {name!r} holds NaN or infinite values")


def check_complete(expected, state, packed, built, source):
    """A CheckpointError naming the expected tensors that never arrived."""
    missing = [
        n
        for n in expected
        if n not in state
        and n.removesuffix(".weight") not in packed.keys() | built
        and n.removesuffix(".bias") not in built
    ]  # a built layer took its bias from `state`
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise CheckpointError(f"{source}: missing tensors {', '.join(missing[:5])}{more}")


ROPE_NUMBERS = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor", "original_max_position_embeddings"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "longrope": ("original_max_position_embeddings",),
}
# numbers a type may give (null or absent: its default); each positive where given
ROPE_OPTIONAL = {"yarn": ("beta_fast", "beta_slow", "attention_factor")}


def check_rope_scaling(scaling: dict, rotary_dim: int, source):
    """Each number its RoPE scaling type needs, present and positive (high_freq_factor above
    low_freq_factor; LongRoPE's factors one per rotated pair), named if not; the type supported."""
    kind = kind_of(scaling)
    if kind not in SUPPORTED:
        raise CheckpointError(
            f"{source}: RoPE scaling type {kind!r} is not supported "
            f"(supported: {', '.join(SUPPORTED)})"
        )
    given = [k for k in ROPE_OPTIONAL.get(kind, ()) if scaling.get(k) is not None]
    for key in ROPE_NUMBERS.get(kind, ()) + tuple(given):
        value = scaling.get(key)
        if (
            not isinstance(value, (int, float))
            or isinstance(value, bool)
            or not 0 < value < float("inf")
        ):
            raise CheckpointError(
                f"{source}: {kind} RoPE scaling needs a positive number {key}, got {value!r}"
            )
    if kind == "llama3" and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise CheckpointError(
            f"{source}: llama3 RoPE scaling needs high_freq_factor above low_freq_factor, "
            f"got {scaling['high_freq_factor']} and {scaling['low_freq_factor']}"
        )
    for key in ("short_factor", "long_factor") if kind == "longrope" else ():
        value = scaling.get(key)
        if not (
            isinstance(value, list)
            and len(value) == rotary_dim // 2
            and all(isinstance(x, (int, float)) and x > 0 for x in value)
        ):
            raise CheckpointError(
                f"{source}: longrope RoPE scaling needs {key} as {rotary_dim // 2} positive "
                f"numbers (one per rotated pair), got {str(value)[:80]}"
            )
