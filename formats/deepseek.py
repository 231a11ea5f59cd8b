"""DeepSeek-V2 / V3 checkpoints' config keys: their mixture of experts as moe.MoEConfig.

    from formats.deepseek import deepseek_experts
    moe = deepseek_experts(json.load(open("DeepSeek-V2-Lite/config.json")))

The family's routed experts sit beside shared experts that every token passes through, added
without a gate; the first `first_k_dense_replace` layers (and, every `moe_layer_freq`, the layers
between) keep a dense MLP. The router is V2's (softmax scores, greedy or group-limited choice)
or V3's (sigmoid scores with a correction bias for the choice, "noaux_tc"); moe.py holds both.
Its attention (multi-head latent attention) is not read here: formats/families.py does not list
model_type deepseek_v2 / deepseek_v3, so their folders are refused by name.
"""

from moe import MoEConfig
from runtime import CheckpointError

# the published defaults of keys a config may leave out (DeepSeek-V2's, then V3's where they part)
DEFAULTS = {
    "deepseek_v2": dict(
        scoring_func="softmax",
        topk_method="greedy",
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
    ),
    "deepseek_v3": dict(
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
    ),
}


def deepseek_experts(cfg: dict) -> MoEConfig:
    """moe.MoEConfig from a DeepSeek config.json (model_type deepseek_v2 or deepseek_v3); a key
    the experts need and the config lacks is a CheckpointError naming it."""
    kind = cfg.get("model_type", "deepseek_v2")
    get = {**DEFAULTS.get(kind, DEFAULTS["deepseek_v2"]), **cfg}.get
    for key in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size"):
        if not isinstance(get(key), int):
            raise CheckpointError(f"config.json: {kind} needs {key} (an integer), got {get(key)!r}")
    n, first, freq = (
        cfg["num_hidden_layers"],
        get("first_k_dense_replace") or 0,
        get("moe_layer_freq") or 1,
    )
    try:
        return MoEConfig(
            get("n_routed_experts"),
            get("num_experts_per_tok"),
            get("moe_intermediate_size"),
            norm_topk_prob=bool(get("norm_topk_prob")),
            shared_expert_size=(get("n_shared_experts") or 0) * get("moe_intermediate_size"),
            dense_layers=tuple(i for i in range(n) if i < first or i % freq),
            shared_expert_gate=False,
            scoring=get("scoring_func"),
            topk_method=get("topk_method"),
            n_group=get("n_group") or 1,
            topk_group=get("topk_group") or 1,
            routed_scaling_factor=float(get("routed_scaling_factor")),
            correction_bias=get("topk_method") == "noaux_tc",
        )
    except ValueError as e:  # an unknown router, or groups that cannot hold k experts
        raise CheckpointError(f"config.json: {e}") from None
