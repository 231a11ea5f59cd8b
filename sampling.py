"""Turning logits into the next token: greedy, temperature, top-k and top-p (nucleus) sampling.

    probs = softmax(logits / temperature), restricted to
      top-k: the k most likely tokens;
      top-p: the smallest set of most likely tokens whose probability sums to at least p
             (the most likely token is always kept).
    temperature 0 means greedy: argmax, no randomness.

Each row of a batch is sampled independently; a `torch.Generator` seeded once makes a whole run
reproducible. speculative.py reuses `probabilities` for its accept/reject rule.

Log-probabilities reported to users (`token_logprobs`) are the model's own: log_softmax of the
raw logits, before temperature and filtering, as HF transformers computes them.
"""
from dataclasses import dataclass

import torch


@dataclass
class SamplingParams:
    temperature: float = 0.0
    top_k: int = None  # None: off
    top_p: float = 1.0  # 1: off

    def __post_init__(self):
        check_sampling(self.temperature, self.top_k, self.top_p)


def check_sampling(temperature, top_k, top_p):
    if temperature is None or temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 means greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def filter_logits(logits: torch.Tensor, top_k: int = None, top_p: float = 1.0) -> torch.Tensor:
    """logits [..., V] with every token outside top-k / top-p set to -inf."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens strictly before it already reach top_p
        drop = (probs.cumsum(-1) - probs) >= top_p
        drop[..., 0] = False
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def probabilities(logits: torch.Tensor, temperature: float, top_k: int = None, top_p: float = 1.0) -> torch.Tensor:
    """The distribution sampled from: [..., V] float32. Temperature 0 gives a one-hot argmax."""
    logits = logits.float()
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    return filter_logits(logits / temperature, top_k, top_p).softmax(-1)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator = None) -> torch.Tensor:
    """logits [B, V] -> next tokens [B]."""
    if params.temperature == 0:
        return logits.argmax(-1)
    probs = probabilities(logits, params.temperature, params.top_k, params.top_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


MAX_LOGPROBS = 20  # most alternatives reported per token (OpenAI's limit)


def token_logprobs(logits: torch.Tensor, tokens, top: list) -> list:
    """logits [R, V], tokens [R] ids, top [R] counts -> per row (log-probability of its token,
    [(id, log-probability)] of the top[r] most likely tokens, most likely first)."""
    logp = logits.float().log_softmax(-1)  # [R, V]
    chosen = logp.gather(-1, torch.as_tensor(tokens, device=logp.device)[:, None])[:, 0].tolist()
    k = max(top, default=0)
    values, ids = logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())  # [R, k]
    values, ids = values.tolist(), ids.tolist()
    return [(c, list(zip(i[:n], v[:n]))) for c, i, v, n in zip(chosen, ids, values, top)]
