"""Mixture of experts: a router picks k of E feed-forward experts for each token.

In place of one MLP, a sparse layer holds E small SwiGLU experts and a router, a linear map
dim -> E. Each token goes to the k experts with the largest router probabilities, and its output
is their outputs weighted by those probabilities (renormalised over the k when the config says
so); Qwen2-MoE adds a shared expert every token passes through, scaled by a sigmoid gate:

    p = softmax(router(x))                          [T, E]
    w, idx = topk(p, k)                             [T, k]   (w / w.sum() if norm_topk_prob)
    y = sum_j w[:, j] * expert[idx[:, j]](x)        [T, dim] (+ sigmoid(gate(x)) * shared(x))

DeepSeek's routers (MoEConfig.scoring, topk_method) choose within groups of experts and scale:
V2 scores by softmax and, group-limited, keeps the topk_group groups of the highest score; V3
("noaux_tc") scores by sigmoid, adds a per-expert correction bias for the choice only (its
balance without an auxiliary loss), ranks groups by the sum of their two best, weights by the
unbiased scores (renormalised); both multiply by routed_scaling_factor; shared experts are
added ungated.

Per token only k experts' weights are read, so decode is bound by the *active* bytes, not the
total (Qwen3-30B-A3B: 3B of 30B parameters per token). Two ways to run the chosen experts:

- gather (under torch.compile, whose graphs cannot hold a host-side loop): index the stacked
  weights by the chosen ids, then one batched matmul (gpt-fast's trick). It stands for T * k
  copies of an expert's weights per projection; Inductor on CPU fuses the gather into the
  multiply at batch 1 (RESULTS.md), but a large compiled batch may materialise them: measured on
  CPU at batch 1 only;
- grouped (eager, any number of tokens): sort the (token, expert) pairs by expert, one matmul per
  expert hit over its tokens, scatter-add back. On CPU it beats an eager gather even for one
  token (no copies). Never a pass of every token through every expert.

Experts are stored stacked: gate_proj, up_proj [E, ff, dim], down_proj [E, dim, ff], so that a
gather is one index. `Int8Experts` (a scale per expert row) and `GroupExperts` (scales per group:
quantize.py's int4, a GGUF file's own blocks) hold them at 8 or 4 bits and dequantize only the
experts a step uses.
tests/test_moe.py checks both paths against a plain loop over experts and the model against HF.
"""

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

ROUTERS = {  # MoEConfig's names and what each may be
    "scoring": ("softmax", "sigmoid"),
    "topk_method": ("greedy", "group_limited_greedy", "noaux_tc"),
}


@dataclass
class MoEConfig:
    n_experts: int  # E experts in each sparse layer
    n_experts_per_tok: int  # k of them chosen per token
    intermediate_size: int  # each expert's FFN width
    norm_topk_prob: bool = True  # renormalise the k chosen probabilities to sum to 1
    shared_expert_size: int = 0  # Qwen2-MoE: the width of an expert every token also passes through
    dense_layers: tuple = ()  # layers that keep a dense MLP (decoder_sparse_step, mlp_only_layers)
    router_bias: bool = False  # gpt-oss: a bias on the router's logits
    expert_bias: bool = False  # gpt-oss: a bias on every expert projection
    glu_limit: float = 0.0  # gpt-oss's clamped SwiGLU (Experts.glu); 0: plain act(gate) * up
    glu_alpha: float = 1.702  # its sigmoid's slope
    shared_expert_gate: bool = True  # Qwen2-MoE's sigmoid gate on it; DeepSeek adds it as it is
    scoring: str = "softmax"  # DeepSeek-V3: "sigmoid"
    topk_method: str = "greedy"  # DeepSeek: "group_limited_greedy" (V2), "noaux_tc" (V3)
    n_group: int = 1  # groups of experts, of which topk_group are chosen from
    topk_group: int = 1
    routed_scaling_factor: float = 1.0  # the routed experts' weights multiplied by it
    correction_bias: bool = False  # noaux_tc's e_score_correction_bias
    router_fp32: bool = False  # DeepSeek: the router's logits computed in float32

    def __post_init__(self):
        if not 0 < self.n_experts_per_tok <= self.n_experts or self.intermediate_size <= 0:
            raise ValueError(
                f"a mixture of experts needs 1 <= experts per token ({self.n_experts_per_tok}) <= "
                f"experts ({self.n_experts}) and a positive expert width ({self.intermediate_size})"
            )
        for name, value in (("scoring", self.scoring), ("topk_method", self.topk_method)):
            if value not in ROUTERS[name]:
                raise ValueError(f"{name} {value!r} is not supported: {', '.join(ROUTERS[name])}")
        grouped = self.topk_method != "greedy"
        size = self.n_experts // max(1, self.n_group)
        if grouped and not (
            self.n_experts % self.n_group == 0
            and 0 < self.topk_group <= self.n_group
            and self.n_experts_per_tok <= self.topk_group * size
            and (size >= 2 or self.topk_method != "noaux_tc")  # (a group's two best)
        ):
            raise ValueError(
                f"{self.topk_method} needs n_group ({self.n_group}) to divide the "
                f"{self.n_experts} experts and topk_group ({self.topk_group}) groups, at most "
                f"n_group, to hold the {self.n_experts_per_tok} experts per token (noaux_tc: "
                "groups of two or more)"
            )

    def widths(self) -> list:
        """The widths tensor parallelism splits: each expert's, and the shared expert's."""
        return [self.intermediate_size, self.shared_expert_size]

    def parameter_counts(self, c) -> tuple:
        """(total, active per token) parameters of ModelConfig c, norms and biases left out: what a
        name like Qwen3-30B-A3B states (30.5B and 3.3B by this count)."""
        attention = c.dim * c.head_dim * (2 * c.n_heads + 2 * c.n_kv_heads)
        if c.mla:  # DeepSeek's latent attention (model.MLAttention)
            attention = latent_attention_parameters(c)
        sparse, expert = c.n_layers - len(self.dense_layers), 3 * c.dim * self.intermediate_size
        gate = c.dim * (bool(self.shared_expert_size) and self.shared_expert_gate)
        shared = 3 * c.dim * self.shared_expert_size + gate
        common = (
            c.vocab_size * c.dim * (1 if c.tie_word_embeddings else 2)
            + c.n_layers * attention
            + len(self.dense_layers) * 3 * c.dim * c.intermediate_size
            + sparse * (c.dim * self.n_experts + shared)
        )
        return (
            common + sparse * self.n_experts * expert,
            common + sparse * self.n_experts_per_tok * expert,
        )

    def sharded(self, world: int) -> "MoEConfig":
        """One rank's slice (tp.py): every expert keeps its router slot with 1/world of its
        width."""
        return replace(
            self,
            intermediate_size=self.intermediate_size // world,
            shared_expert_size=self.shared_expert_size // world,
        )


def latent_attention_parameters(c) -> int:
    """One layer's MLAttention projections, of ModelConfig c (whose mla is set)."""
    m, H = c.mla, c.n_heads
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    q = m.q_lora_rank * (c.dim + H * qk) if m.q_lora_rank else c.dim * H * qk
    kv = c.dim * (m.kv_lora_rank + m.qk_rope_head_dim)
    up = m.kv_lora_rank * H * (m.qk_nope_head_dim + m.v_head_dim)
    return q + kv + up + H * m.v_head_dim * c.dim


PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class Experts(nn.Module):
    """E SwiGLU experts, each down(glu(gate(x), up(x))), with their weights stacked (and gpt-oss's
    biases)."""

    def __init__(self, n_experts: int, dim: int, ff: int, act, bias=False, limit=0.0, alpha=1.702):
        super().__init__()
        self.n_experts, self.act, self.limit, self.alpha = n_experts, act, limit, alpha
        self.gate_proj = nn.Parameter(torch.empty(n_experts, ff, dim))
        self.up_proj = nn.Parameter(torch.empty(n_experts, ff, dim))
        self.down_proj = nn.Parameter(torch.empty(n_experts, dim, ff))
        for name, width in zip(PROJECTIONS, (ff, ff, dim)):  # [E, out] or None
            self.register_parameter(
                f"{name}_bias", nn.Parameter(torch.zeros(n_experts, width)) if bias else None
            )

    def like(self, experts: "Experts"):
        """A quantized twin's start: the activation of `experts`, and its float biases (moved)."""
        nn.Module.__init__(self)
        self.n_experts, self.act, self.limit, self.alpha = (
            experts.n_experts,
            experts.act,
            experts.limit,
            experts.alpha,
        )
        for name in PROJECTIONS:
            self.register_parameter(f"{name}_bias", getattr(experts, f"{name}_bias"))

    def glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """act(gate) * up; gpt-oss's clamped form: gate clamped above at the limit, up on both
        sides, then (up + 1) * gate * sigmoid(alpha * gate)."""
        if not self.limit:
            return self.act(gate) * up
        gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return (up + 1) * gate * torch.sigmoid(gate * self.alpha)

    def weights(self, name: str, ids: torch.Tensor, dtype) -> torch.Tensor:
        """The weights of experts `ids` [n] for projection `name` -> [n, out, in] (a gather)."""
        return getattr(self, name)[ids].to(dtype)

    def linear(self, name: str, x: torch.Tensor, e: int) -> torch.Tensor:
        """x [n, in] through expert e's projection `name` -> [n, out]."""
        return F.linear(x, getattr(self, name)[e])

    def biased(self, name: str, y: torch.Tensor, ids) -> torch.Tensor:
        """y plus the biases of the experts that made it, if any: y [n, out] from expert ids (an
        int), or y [n, 1, out] from experts ids [n]."""
        bias = getattr(self, f"{name}_bias")
        if bias is None:
            return y
        return y + (bias[ids][:, None] if y.dim() == 3 else bias[ids]).to(y.dtype)

    def forward(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [T, dim], idx and w [T, k] -> [T, dim]."""
        # eager: grouped even for one token; its matmuls on views beat the gathered copies on CPU
        # (benchmarks/RESULTS.md, "Mixtures of experts")
        if torch.compiler.is_compiling():
            return self.gathered(x, idx, w)
        return self.grouped(x, idx, w)

    def gathered(self, x, idx, w):
        T, k = idx.shape
        ids = idx.reshape(-1)  # [T*k]
        xs = x.repeat_interleave(k, dim=0)[:, None, :]  # [T*k, 1, dim]

        def project(name, h):  # h [T*k, 1, in] through each row's expert -> [T*k, 1, out]
            return self.biased(
                name, torch.bmm(h, self.weights(name, ids, x.dtype).transpose(1, 2)), ids
            )

        y = project(
            "down_proj", self.glu(project("gate_proj", xs), project("up_proj", xs))
        )  # [T*k, 1, dim]
        return (y.view(T, k, -1) * w[..., None].to(y.dtype)).sum(dim=1)

    def grouped(self, x, idx, w):
        T, k = idx.shape
        order = idx.reshape(-1).argsort(stable=True)  # (token, choice) pairs sorted by expert
        counts = torch.bincount(
            idx.reshape(-1), minlength=self.n_experts
        ).tolist()  # the one host sync
        tokens, weight = order // k, w.reshape(-1)[order].to(x.dtype)
        out, start = torch.zeros_like(x), 0
        for e, n in enumerate(counts):
            if n:
                rows = tokens[start : start + n]
                xe = x[rows]  # [n, dim]
                gate, up = (
                    self.biased(p, self.linear(p, xe, e), e) for p in ("gate_proj", "up_proj")
                )
                y = self.biased("down_proj", self.linear("down_proj", self.glu(gate, up), e), e)
                out.index_add_(0, rows, y * weight[start : start + n, None])
                start += n
        return out

    def int4_refusal(self, groupsize: int):
        """Why int4 groups of `groupsize` cannot hold these experts' input channels, or None."""
        bad = [k for k in (self.gate_proj.shape[2], self.down_proj.shape[2]) if k % groupsize]
        return (
            f"{bad[0]} input channels are not a multiple of the group size {groupsize}"
            if bad
            else None
        )

    def expert_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state_dict().values())


class Int8Experts(Experts):
    """Each expert's rows int8 with one scale per row: w[e, n, :] ~= q[e, n, :] * scale[e, n]."""

    def __init__(self, experts: Experts, portable: dict, dtype):
        self.like(experts)
        for name, (q, scales) in portable.items():  # q int8 [E, N, K], scales [E, N]
            self.register_buffer(name, q.contiguous())
            self.register_buffer(f"{name}_scales", scales.to(dtype))

    def weights(self, name, ids, dtype):
        return getattr(self, name)[ids].to(dtype) * getattr(self, f"{name}_scales")[ids][
            ..., None
        ].to(dtype)

    def linear(self, name, x, e):
        q, scales = getattr(self, name)[e], getattr(self, f"{name}_scales")[e]
        if (
            x.device.type == "cpu" and x.dtype != torch.float32
        ):  # the CPU int8 kernel (quantize.Int8Linear)
            return torch.ops.aten._weight_int8pack_mm(x, q, scales)
        return F.linear(x, q.to(x.dtype)) * scales.to(x.dtype)


# MXFP4's 4-bit floats (formats/mxfp4.py) by code: sign bit, 2 exponent bits, 1 mantissa bit
E2M1 = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
)


def nibbles(q: torch.Tensor) -> torch.Tensor:
    """[..., K/2] bytes -> [..., K] 4-bit codes: byte j holds code 2j (low nibble) and 2j + 1
    (high)."""
    return torch.stack([q & 15, q >> 4], dim=-1).flatten(-2)


def e2m1_weights(q: torch.Tensor, scales: torch.Tensor, values=E2M1) -> torch.Tensor:
    """MXFP4: codes q [..., K/2] (nibbles) and powers of two scales [..., K/32] -> float32 [...,
    K]."""
    w = values.float()[nibbles(q).long()]  # [..., K]
    return (w.unflatten(-1, (scales.shape[-1], -1)) * scales[..., None].float()).flatten(-2)


class GroupExperts(Experts):
    """Each projection in groups of G input channels, a scale and an offset per group, at 4 bits
    (two values a byte in row order: quantize.py's portable int4, GGUF's Q4_*), at 8 bits (GGUF's
    Q8_0, Q5_*, Q6_K), or float (a GGUF type read as float); each projection its own kind:

        w[e, n, k] = (q[e, n, k] - c) * scale[e, n, k // G] + offset[e, n, k // G]
        c = 8 at 4 bits, else 0

    e2m1 (MXFP4, gpt-oss): 4-bit floats (E2M1 above) times a power of two per group of 32, stored
    here as that power in float32 (float16 holds too few of them), the product made in float32.
    Only the experts a step uses are dequantized, in the activations' dtype."""

    def __init__(self, experts: Experts, parts: dict, dtype):
        """experts: the float (or meta) module this stands for; parts: {projection: ("int4", q uint8
        [E, N, K/2], scales, offsets [E, N, K/G]), ("e2m1", q uint8 [E, N, K/2], scales [E, N,
        K/32]), ("int8", q int8 [E, N, K], scales, offsets or None) or ("float", w [E, N, K])}."""
        self.like(experts)
        self.kinds = {}
        for name, (kind, q, *groups) in parts.items():
            self.kinds[name] = kind
            self.register_buffer(name, q.to(dtype) if kind == "float" else q.contiguous())
            keep = torch.float32 if kind == "e2m1" else dtype
            for suffix, t in zip(("scales", "offsets"), (*groups, None, None)):
                self.register_buffer(f"{name}_{suffix}", None if t is None else t.to(keep))
            if (
                kind == "e2m1"
            ):  # the value of each code, on the weights' device (moved with the module)
                self.register_buffer("e2m1_values", E2M1.to(q.device), persistent=False)

    def weights(self, name, ids, dtype):
        q, kind = getattr(self, name)[ids], self.kinds[name]  # [n, N, K] (or [n, N, K/2] at 4 bits)
        if kind == "float":
            return q.to(dtype)
        scales, offsets = (
            getattr(self, f"{name}_scales")[ids],
            getattr(self, f"{name}_offsets"),
        )  # [n, N, K/G]
        if kind == "e2m1":
            return e2m1_weights(q, scales, self.e2m1_values).to(dtype)
        if kind == "int4":
            q = nibbles(q).to(dtype) - 8
        w = q.to(dtype).unflatten(-1, (scales.shape[-1], -1)) * scales[..., None].to(
            dtype
        )  # [n, N, K/G, G]
        if offsets is not None:
            w = w + offsets[ids][..., None].to(dtype)
        return w.flatten(-2)

    def linear(self, name, x, e):
        return F.linear(x, self.weights(name, slice(e, e + 1), x.dtype)[0])


def portable(experts: Experts, quantize_weight) -> dict:
    """{projection: {"weight", "scales"(, "zeros")}}: quantize_weight(w [N, K]) gives quantize.py's
    portable tensors of one expert's projection, stacked here over the experts."""
    out = {}
    for name in PROJECTIONS:
        parts = [quantize_weight(w) for w in getattr(experts, name)]  # one expert at a time
        out[name] = {k: torch.stack([p[k] for p in parts]) for k in parts[0]}
    return out


def quantized(experts: Experts, mode: str, quantize_weight) -> Experts:
    """The experts at 8 bits (Int8Experts) or 4 (GroupExperts), quantized by quantize_weight
    (above)."""
    return from_portable(experts, mode, portable(experts, quantize_weight), experts.gate_proj.dtype)


def from_portable(experts: Experts, mode: str, portable: dict, dtype) -> Experts:
    """Int8Experts or (int4) GroupExperts from portable() tensors, as quantize.py's checkpoints
    store them."""
    if mode == "int8":
        return Int8Experts(
            experts, {k: (v["weight"], v["scales"]) for k, v in portable.items()}, dtype
        )
    parts = {k: ("int4", v["weight"], v["scales"], v["zeros"]) for k, v in portable.items()}
    return GroupExperts(experts, parts, dtype)


def portable_shapes(experts: Experts, mode: str, groupsize: int) -> dict:
    """{projection: {tensor: (shape, dtype)}} of quantized experts in a checkpoint
    (formats/quant_files.py)."""
    out = {}
    for name in PROJECTIONS:
        E, N, K = getattr(experts, name).shape
        if mode == "int8":
            out[name] = {"weight": ((E, N, K), torch.int8), "scales": ((E, N), torch.float32)}
        else:
            G = ((E, N, K // groupsize), torch.float32)
            out[name] = {"weight": ((E, N, K // 2), torch.uint8), "scales": G, "zeros": G}
    return out


class SparseMoE(nn.Module):
    """The router and the experts of one layer (and a shared expert: Qwen2-MoE's with its gate,
    DeepSeek's without)."""

    def __init__(self, config, act, shared_expert=None):
        super().__init__()
        moe = self.moe = config.moe
        self.top_k, self.norm_topk_prob = moe.n_experts_per_tok, moe.norm_topk_prob
        self.gate = nn.Linear(config.dim, moe.n_experts, bias=moe.router_bias)  # the router
        # noaux_tc: added to the scores for the choice only (on the router, where HF keeps it)
        bias = torch.zeros(moe.n_experts) if moe.correction_bias else None
        self.gate.register_buffer("e_score_correction_bias", bias)
        self.experts = Experts(
            moe.n_experts,
            config.dim,
            moe.intermediate_size,
            act,
            moe.expert_bias,
            moe.glu_limit,
            moe.glu_alpha,
        )
        self.shared_expert = shared_expert  # a dense MLP, scaled by a sigmoid gate (Qwen2-MoE)
        gated = shared_expert is not None and moe.shared_expert_gate
        self.shared_expert_gate = nn.Linear(config.dim, 1, bias=False) if gated else None

    @classmethod
    def for_layer(cls, config, layer: int, mlp, act):
        """The layer's sparse MLP, or None where the config keeps it dense; `mlp` builds a dense
        one."""
        moe = config.moe
        if moe is None or layer in moe.dense_layers:
            return None
        return cls(
            config, act, mlp(config, moe.shared_expert_size) if moe.shared_expert_size else None
        )

    def route(self, x: torch.Tensor):
        """x [T, dim] -> the chosen experts idx [T, k] and their weights w [T, k] (float32)."""
        moe = self.moe  # DeepSeek's routers in float32, as HF computes them
        logits = (
            self.gate(x).float()
            if not moe.router_fp32
            else F.linear(
                x.float(),
                self.gate.weight.float(),
                None if self.gate.bias is None else self.gate.bias.float(),
            )
        )  # [T, E]
        scores = logits.sigmoid() if moe.scoring == "sigmoid" else F.softmax(logits, dim=-1)
        choice = scores
        if self.gate.e_score_correction_bias is not None:
            choice = scores + self.gate.e_score_correction_bias.float()
        if moe.topk_method != "greedy":  # only the experts of the topk_group best groups
            groups = choice.unflatten(-1, (moe.n_group, -1))  # [T, G, E / G] (T symbolic)
            if moe.topk_method == "noaux_tc":
                best = groups.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
            else:
                best = groups.amax(dim=-1)
            kept = torch.zeros_like(best).scatter_(1, best.topk(moe.topk_group, dim=-1)[1], 1)
            choice = groups.masked_fill(kept[..., None] == 0, float("-inf")).view_as(choice)
        idx = torch.topk(choice, self.top_k, dim=-1).indices
        w = scores.gather(1, idx)
        if self.norm_topk_prob:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return idx, w * moe.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [B*T, dim]
        y = self.experts(x, *self.route(x))
        if self.shared_expert_gate is not None:
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        elif self.shared_expert is not None:
            y = y + self.shared_expert(x)
        return y.reshape(shape)

    def inactive_bytes(self) -> int:
        """Bytes of the experts a token does not use: what a decode step need not read."""
        return (
            self.experts.expert_bytes()
            * (self.experts.n_experts - self.top_k)
            // self.experts.n_experts
        )
