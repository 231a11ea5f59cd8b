"""Turning logits into the next token: logit bias and repetition / frequency / presence penalties,
then greedy, temperature, top-k, top-p (nucleus) and min-p sampling.

In this order, each step off at its default:
  1. logit_bias, on the raw logits: logits[j] += clamp(bias[j], -100, 100);
  2. repetition_penalty r (HF's RepetitionPenaltyLogitsProcessor; 1 is off): for each token j in
     the context so far (prompt and generated tokens), logits[j] /= r if logits[j] > 0, else *= r;
  3. frequency_penalty f and presence_penalty e (OpenAI's; 0 is off), over the GENERATED tokens
     only: logits[j] -= f * count_j + e * (count_j > 0);
  4. temperature 0 means greedy: the argmax of these logits, no randomness. Otherwise
     probs = softmax(logits / temperature), restricted to
       top-k: the k most likely tokens;
       top-p: the smallest set of most likely tokens whose probability sums to at least p
              (the most likely token is always kept);
       min-p: the tokens whose probability is at least min_p * the most likely token's
              (HF's MinPLogitsWarper; 0 is off);
     and a token is drawn from what is left.
Steps 2 and 3 need the token history, so the caller passes prompt and output tokens to `sample`,
which runs steps 1-3 through `apply_penalties` on a new tensor; with all three off, nothing is
computed for them.

Each row of a batch is sampled independently; a `torch.Generator` seeded once makes a whole run
reproducible. speculative.py reuses `probabilities` (step 4) for its accept/reject rule.

Log-probabilities reported to users (scoring.token_logprobs) are the model's own: log_softmax of
the raw logits, before bias, penalties, temperature and filtering, as HF transformers computes them.
"""

import math
from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    temperature: float = 0.0
    top_k: int = None  # None: off
    top_p: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off
    repetition_penalty: float = 1.0  # 1: off
    frequency_penalty: float = 0.0  # 0: off
    presence_penalty: float = 0.0  # 0: off
    logit_bias: dict = field(default_factory=dict)  # token id -> bias; {}: off

    def __post_init__(self):
        check_sampling(
            self.temperature,
            self.top_k,
            self.top_p,
            self.min_p,
            self.repetition_penalty,
            self.frequency_penalty,
            self.presence_penalty,
            self.logit_bias,
        )
        self.logit_bias = parse_logit_bias(self.logit_bias)  # JSON's {"123": -100} -> {123: -100.0}

    @classmethod
    def from_fields(cls, obj) -> "SamplingParams":
        """The sampling fields of any object that has them (argparse's args,
        scheduler.RequestParams)."""
        return cls(**{name: getattr(obj, name) for name in cls.__dataclass_fields__})

    @property
    def needs_history(self) -> bool:
        """Whether a penalty is on, so that sampling needs the tokens seen so far."""
        return (
            self.repetition_penalty != 1
            or self.frequency_penalty != 0
            or self.presence_penalty != 0
        )

    @property
    def adjusts_logits(self) -> bool:
        """Whether steps 1-3 (apply_penalties) change anything."""
        return self.needs_history or bool(self.logit_bias)


def is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_sampling(
    temperature,
    top_k,
    top_p,
    min_p=0.0,
    repetition_penalty=1.0,
    frequency_penalty=0.0,
    presence_penalty=0.0,
    logit_bias=None,
):
    if not (is_number(temperature) and 0 <= temperature < math.inf):  # NaN fails both
        raise ValueError(
            f"temperature must be a finite number >= 0 (0 means greedy), got {temperature}"
        )
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if not (is_number(min_p) and 0 <= min_p <= 1):
        raise ValueError(f"min_p must be in [0, 1] (0 is off), got {min_p!r}")
    if not (
        is_number(repetition_penalty) and 1e-3 <= repetition_penalty <= 1e3
    ):  # beyond, logits overflow
        raise ValueError(
            f"repetition_penalty must be in [0.001, 1000] (1 is off), got {repetition_penalty!r}"
        )
    for name, value in (
        ("frequency_penalty", frequency_penalty),
        ("presence_penalty", presence_penalty),
    ):
        if not (is_number(value) and -2 <= value <= 2):
            raise ValueError(f"{name} must be in [-2, 2] (0 is off), got {value!r}")
    parse_logit_bias(logit_bias)


def parse_logit_bias(logit_bias, vocab_size: int = None) -> dict:
    """{token id: bias} -> {int id: float bias in [-100, 100]}. Keys may be ints or integer strings
    (JSON's keys are strings), ids >= 0 (and < vocab_size when given); biases are clamped."""
    if logit_bias is None:
        return {}
    if not isinstance(logit_bias, dict):
        raise ValueError(
            f"logit_bias must be an object mapping token ids to biases, got {logit_bias!r}"
        )
    parsed = {}
    for key, bias in logit_bias.items():
        try:
            token = int(key) if isinstance(key, str) else key
        except ValueError:
            token = None
        if (
            isinstance(token, bool)
            or not isinstance(token, int)
            or not 0 <= token < (vocab_size or math.inf)
        ):
            ids = f"[0, {vocab_size})" if vocab_size else "integers >= 0"
            raise ValueError(f"logit_bias keys must be token ids in {ids}, got {key!r}")
        if not is_number(bias) or bias != bias:  # bias != bias: NaN
            raise ValueError(
                f"logit_bias values must be numbers (clamped to [-100, 100]), got {bias!r} for "
                f"{key!r}"
            )
        parsed[token] = float(
            max(-100, min(100, bias))
        )  # clamped before float(): 10**400 is a valid JSON int
    return parsed


def token_counts(tokens, batch: int, vocab: int, device) -> torch.Tensor:
    """How often each token id occurs in each row: [B, V] float32. tokens: a [B, n] tensor of ids,
    or B sequences of ids of any lengths (copied to the device here, one copy per call)."""
    if tokens is None:
        return torch.zeros(batch, vocab, device=device)
    if not isinstance(tokens, torch.Tensor):  # ragged rows: pad with id V, a column dropped below
        rows = [r.tolist() if isinstance(r, torch.Tensor) else list(r) for r in tokens]
        width = max((len(r) for r in rows), default=0)
        tokens = torch.tensor(
            [r + [vocab] * (width - len(r)) for r in rows], dtype=torch.long, device=device
        )
    tokens = tokens.reshape(batch, -1).long()  # [B, n]
    counts = torch.zeros(batch, vocab + 1, device=device)
    counts.scatter_add_(1, tokens, torch.ones(tokens.shape, device=device))
    return counts[:, :vocab]


def apply_penalties(
    logits: torch.Tensor, params: SamplingParams, prompt_tokens=None, output_tokens=None
) -> torch.Tensor:
    """Steps 1-3 of the module docstring: logits [B, V] -> a NEW tensor [B, V] (at least float32;
    `logits` itself is never written). prompt_tokens, output_tokens: per row, the prompt's and the
    generated token ids (a [B, n] tensor, or B lists / 1-D tensors); the prompt counts only for
    the repetition penalty."""
    B, V = logits.shape
    out = logits.to(torch.promote_types(logits.dtype, torch.float32), copy=True)
    if params.logit_bias:  # keys are distinct, so one indexed add; a host-to-device copy per call
        ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=out.device)
        bias = torch.tensor(
            [min(100.0, max(-100.0, b)) for b in params.logit_bias.values()], device=out.device
        )
        out[:, ids] += bias.to(out.dtype)
    if not params.needs_history:
        return out
    if output_tokens is None:
        raise ValueError(
            "repetition, frequency and presence penalties need the generated tokens (output_tokens)"
        )
    output = token_counts(output_tokens, B, V, out.device).to(out.dtype)  # [B, V]
    if params.repetition_penalty != 1:
        seen = (token_counts(prompt_tokens, B, V, out.device) + output) > 0
        r = params.repetition_penalty
        out = torch.where(seen, torch.where(out < 0, out * r, out / r), out)
    if params.frequency_penalty or params.presence_penalty:
        out -= params.frequency_penalty * output + params.presence_penalty * (output > 0).to(
            out.dtype
        )
    return out


def filter_logits(
    logits: torch.Tensor, top_k: int = None, top_p: float = 1.0, min_p: float = 0.0
) -> torch.Tensor:
    """logits [..., V] with every token outside top-k / top-p / min-p set to -inf."""
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
    if min_p > 0:  # p_j < min_p * max p; renormalising after top-k/top-p keeps these ratios
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), float("-inf"))
    return logits


def probabilities(
    logits: torch.Tensor,
    temperature: float,
    top_k: int = None,
    top_p: float = 1.0,
    min_p: float = 0.0,
) -> torch.Tensor:
    """The distribution sampled from: [..., V] float32. Temperature 0 gives a one-hot argmax."""
    logits = logits.float()
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    return filter_logits(logits / temperature, top_k, top_p, min_p).softmax(-1)


def sample(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator = None,
    prompt_tokens=None,
    output_tokens=None,
    draft_q=None,
    draft: int = None,
) -> torch.Tensor:
    """logits [B, V] -> next tokens [B]. prompt_tokens, output_tokens: the history the penalties
    need (see apply_penalties); unused when they are off. draft (B = 1): a token drawn from
    draft_q [V], kept with probability min(1, p/q) and else replaced by a draw from max(p - q, 0)
    (speculative sampling; speculative.accept applies it to a whole round, where p cannot change
    between positions): the token is distributed as p, these probs, either way."""
    if params.adjusts_logits:
        logits = apply_penalties(logits, params, prompt_tokens, output_tokens)
    if params.temperature == 0:
        return logits.argmax(-1)
    probs = probabilities(logits, params.temperature, params.top_k, params.top_p, params.min_p)
    if draft_q is not None:
        if float(torch.rand((), generator=generator)) * draft_q[draft] < probs[0, draft]:
            return torch.tensor([draft])
        probs = (probs - draft_q).clamp(min=0)  # (its sum is > 0: a rejection needs q(d) > p(d))
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


MAX_LOGPROBS = 20  # most alternatives reported per token (OpenAI's limit)
