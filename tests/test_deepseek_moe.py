"""DeepSeek's mixtures of experts (moe.py's routers, formats/deepseek.py's config keys) against HF
transformers' own DeepseekV2Moe and DeepseekV3MoE blocks in float32: V2's softmax router greedy
and group-limited, V3's sigmoid router with a correction bias (noaux_tc), shared experts added
ungated, the routed scaling factor; both expert paths; the dense layers a config keeps; bad
configs named."""

from dataclasses import replace

import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV3Config
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

from formats.deepseek import deepseek_experts
from model import MLP, ModelConfig
from moe import SparseMoE
from runtime import CheckpointError

SIZES = dict(hidden_size=64, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=3,
             n_shared_experts=2, num_hidden_layers=2, num_attention_heads=4)  # fmt: skip
CASES = {
    "v2 greedy": (DeepseekV2Config, DeepseekV2Moe, dict(routed_scaling_factor=1.5)),
    "v2 group-limited": (
        DeepseekV2Config,
        DeepseekV2Moe,
        dict(topk_method="group_limited_greedy", n_group=4, topk_group=2),
    ),
    "v3 noaux_tc": (
        DeepseekV3Config,
        DeepseekV3MoE,
        dict(n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True),
    ),
}


def pair(case: str):
    """(HF's block with random weights, ours with the same, our MoEConfig)."""
    config_class, block_class, extra = CASES[case]
    hf_config = config_class(**SIZES, **extra)
    torch.manual_seed(0)
    hf = block_class(hf_config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(0.3 * torch.randn_like(p))
        if hasattr(hf.gate, "e_score_correction_bias"):  # large enough to move choices
            hf.gate.e_score_correction_bias.copy_(0.5 * torch.randn(8))
    cfg = {**hf_config.to_dict(), "model_type": hf_config.model_type}
    moe = deepseek_experts(cfg)
    config = ModelConfig(256, 64, 2, 4, 4, intermediate_size=96, moe=moe)
    ours = SparseMoE(config, torch.nn.functional.silu, MLP(config, moe.shared_expert_size)).eval()
    with torch.no_grad():
        ours.gate.weight.copy_(hf.gate.weight)
        if moe.correction_bias:
            ours.gate.e_score_correction_bias.copy_(hf.gate.e_score_correction_bias)
        gate, up = hf.experts.gate_up_proj.chunk(2, dim=1)
        ours.experts.gate_proj.copy_(gate)
        ours.experts.up_proj.copy_(up)
        ours.experts.down_proj.copy_(hf.experts.down_proj)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(ours.shared_expert, name).weight.copy_(getattr(hf.shared_experts, name).weight)
    return hf, ours, moe


@pytest.mark.parametrize("case", CASES)
def test_the_block_equals_hf(case):
    hf, ours, moe = pair(case)
    x = torch.randn(2, 20, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = hf(x), ours(x)
        flat = x.reshape(-1, 64)
        idx, w = ours.route(flat)
        gathered = ours.experts.gathered(flat, idx, w) + ours.shared_expert(flat)
    assert ours.shared_expert_gate is None and moe.shared_expert_size == 64
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gathered.view_as(want), want, atol=1e-4, rtol=1e-4)  # (sum order)


def test_groups_and_the_correction_bias_change_the_choice():
    """The switch bites: without the group limit some token picks other experts; with it, every
    token's experts lie in at most topk_group (2) groups of 8 / 4 = 2."""
    for case in ("v2 group-limited", "v3 noaux_tc"):
        _, ours, moe = pair(case)
        x = torch.randn(40, 64, generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            idx = ours.route(x)[0].sort(dim=-1).values
            ours.moe = replace(moe, topk_method="greedy")
            free = ours.route(x)[0].sort(dim=-1).values
        assert not torch.equal(idx, free), case
        assert all(len(set((row // 2).tolist())) <= 2 for row in idx), case


def test_dense_layers_follow_first_k_dense_replace_and_moe_layer_freq():
    cfg = dict(model_type="deepseek_v2", num_hidden_layers=6, n_routed_experts=8,
               num_experts_per_tok=2, moe_intermediate_size=16, first_k_dense_replace=1,
               moe_layer_freq=2)  # fmt: skip
    moe = deepseek_experts(cfg)
    assert moe.dense_layers == (0, 1, 3, 5)  # MoE where i >= 1 and i % 2 == 0
    v3 = deepseek_experts({**cfg, "model_type": "deepseek_v3", "n_group": 2, "topk_group": 1})
    assert (v3.scoring, v3.topk_method, v3.correction_bias) == ("sigmoid", "noaux_tc", True)
    assert v3.routed_scaling_factor == 2.5 and v3.norm_topk_prob


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(topk_method="best"), "topk_method 'best' is not supported: greedy, group_limited"),
        (dict(scoring_func="relu"), "scoring 'relu' is not supported: softmax, sigmoid"),
        (dict(n_routed_experts=None), "needs n_routed_experts"),
        (dict(topk_method="noaux_tc", n_group=3, topk_group=1), "n_group \\(3\\) to divide"),
        (dict(topk_method="noaux_tc", n_group=4, topk_group=1), "to hold the 3 experts"),
    ],
)
def test_bad_router_configs_are_named(change, message):
    with pytest.raises(CheckpointError, match=message):
        deepseek_experts({"model_type": "deepseek_v2", **SIZES, **change})
