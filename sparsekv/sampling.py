"""Sampling as small pure functions: greedy, temperature, top-k, top-p, min-p, per-request generators,
logprobs; and `LogitAdjuster`, a request's penalties, logit bias and min_tokens.

Logprobs are those of the model's raw distribution (log_softmax of the logits, before penalties,
temperature or truncation), as vLLM reports them by default.
"""
from __future__ import annotations

import torch

from .request import SamplingParams


class LogitAdjuster:
    """One request's allowed tokens, logit bias, min_tokens and repetition / frequency / presence
    penalties, applied to a row of raw fp32 logits in vLLM's order (allowed tokens and bias, min_tokens,
    then the penalties). The penalties touch only the tokens they concern (the prompt's distinct tokens,
    the output's), gathered and scattered by index: a full-vocabulary pass per row cost ~1 ms at GLM's
    155K tokens on a CPU core, this ~0.1 ms plus the seen tokens."""

    def __init__(self, params: SamplingParams, prompt_token_ids: list[int], vocab_size: int,
                 stop_token_ids: set[int]):
        self.params, self.stop_ids = params, torch.tensor(sorted(stop_token_ids), dtype=torch.long)
        self.bias = None
        if params.logit_bias or params.allowed_token_ids:
            self.bias = torch.zeros(vocab_size)
        if params.allowed_token_ids:  # every other token -inf
            self.bias.fill_(float("-inf"))
            self.bias[params.allowed_token_ids] = 0.0
        if params.logit_bias:
            self.bias[list(params.logit_bias)] += torch.tensor(list(params.logit_bias.values()), dtype=torch.float32)
        self.counts: dict[int, int] = {}  # output token -> times emitted
        self.num_output = 0
        self._prompt = None
        if params.repetition_penalty != 1.0:
            self._prompt = set(prompt_token_ids)
            self._seen = torch.tensor(sorted(self._prompt), dtype=torch.long)
        self._output: tuple[torch.Tensor, torch.Tensor] | None = None  # (ids, counts), rebuilt after note()

    def note(self, token: int) -> None:
        if self._prompt is not None and token not in self._prompt and token not in self.counts:
            self._seen = torch.cat([self._seen, torch.tensor([token])])
        self.counts[token] = self.counts.get(token, 0) + 1
        self.num_output += 1
        self._output = None

    def _output_counts(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._output is None:
            self._output = (torch.tensor(list(self.counts), dtype=torch.long),
                            torch.tensor(list(self.counts.values()), dtype=torch.float32))
        return self._output

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        p = self.params
        logits = logits + self.bias if self.bias is not None else logits.clone()
        if self.num_output < p.min_tokens and self.stop_ids.numel():
            logits[self.stop_ids] = float("-inf")
        if self._prompt is not None:
            vals = logits[self._seen]
            logits[self._seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and self.counts:
            ids, counts = self._output_counts()
            logits[ids] -= p.frequency_penalty * counts + p.presence_penalty
        return logits


def filter_logits_rows(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then min-p, top-k and top-p (nucleus), vLLM's order, for a batch of rows [R, V] of
    fp32 logits, row i with `params[i]`: each stage applied to the rows that ask for it, as whole-batch
    ops (a few launches, not a few per row). Every stage is row-wise, so a row gets what it gets alone
    (tests/test_sampling.py checks it bit for bit, ties included)."""
    column = lambda values: torch.tensor(values, dtype=logits.dtype, device=logits.device)[:, None]  # noqa: E731
    logits = logits / column([p.temperature for p in params])
    rows = [i for i, p in enumerate(params) if p.min_p > 0.0]
    if rows:
        part = logits[rows]
        probs = part.softmax(-1)
        logits[rows] = part.masked_fill(probs < column([params[i].min_p for i in rows]) * probs.max(-1, keepdim=True).values,
                                        float("-inf"))
    rows = [i for i, p in enumerate(params) if p.top_k and p.top_k < logits.shape[-1]]
    if rows:
        part = logits[rows]
        k = torch.tensor([params[i].top_k for i in rows], device=logits.device)
        kth = part.topk(int(k.max()), dim=-1).values.gather(1, (k - 1)[:, None])
        logits[rows] = part.masked_fill(part < kth, float("-inf"))
    rows = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if rows:
        part = logits[rows]
        logits[rows] = part.masked_fill(outside_nucleus(part, column([params[i].top_p for i in rows])), float("-inf"))
    return logits


TOP_P_CANDIDATES = 1024  # a nucleus is looked for among each row's most probable tokens first


def outside_nucleus(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask of the tokens outside each row's nucleus: the nucleus is the fewest most probable tokens
    whose probability reaches `top_p` [R, 1] (vLLM's and transformers' definition), and every token
    exactly as probable as the least of them (a tie at the cut is kept whole, so the set never depends
    on how a sort orders equal values). Found by a partial sort of the `TOP_P_CANDIDATES` most probable
    tokens; only rows whose nucleus is wider are sorted whole. At GLM's 155K-token vocabulary a
    whole-row sort costs ~11 ms per row on a CPU core, the partial one ~1 ms (BENCHMARKS.md)."""
    return outside_nucleus_of(logits.softmax(-1), top_p)


def outside_nucleus_of(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """`outside_nucleus` of the rows' probabilities."""
    vocab = probs.shape[-1]
    k = min(TOP_P_CANDIDATES, vocab)
    values = probs.topk(k, dim=-1).values  # descending
    size = ((values.cumsum(-1) - values) < top_p).sum(-1, keepdim=True)  # >= 1: top_p > 0
    cut = values.gather(1, size - 1)
    wide = (size[:, 0] == k).nonzero()[:, 0] if k < vocab else []  # the nucleus may be wider
    if len(wide):
        values = probs[wide].sort(dim=-1, descending=True).values
        cut[wide] = values.gather(1, ((values.cumsum(-1) - values) < top_p[wide]).sum(-1, keepdim=True) - 1)
    return probs < cut


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then min-p, top-k and top-p (nucleus), vLLM's order, on one row of fp32 logits."""
    return filter_logits_rows(logits[None], [params])[0]


def draw_rows(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row of `probs` [R, V] (non-negative, each row summing to about 1), row i drawn
    with `generators[i]`: inverse transform sampling, a uniform from the row's own generator (so a
    seeded request draws the same whatever batch it is in) searched in the row's cumulative sum, the
    whole batch at once. A zero-probability token is never drawn. `torch.multinomial` row by row cost
    ~2.7 ms a row at GLM's 155K-token vocabulary on a CPU core, this ~0.5 (BENCHMARKS.md)."""
    u = torch.cat([torch.rand(1, generator=g) for g in generators]).to(probs.device)
    cum = probs.cumsum(-1)
    picked = torch.searchsorted(cum, (u * cum[:, -1])[:, None].to(cum.dtype), right=True)[:, 0]
    return inside_support(picked, probs)


def skip_draw(generator: torch.Generator) -> None:
    """Move `generator` past one token's draw (a token sampled elsewhere with the same seed): each
    token `draw_rows` samples takes one uniform of its row's generator."""
    torch.rand(1, generator=generator)


def inside_support(picked: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """`picked`, with a pick past the end (u x total rounded up to the total: about once in 2^24
    draws) moved to the row's last token of non-zero probability."""
    vocab = probs.shape[-1]
    over = (picked >= vocab).nonzero()[:, 0]
    if len(over):
        picked[over] = vocab - 1 - (probs[over].flip(-1) > 0).to(torch.uint8).argmax(-1)
    return picked


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from one row of probabilities (`draw_rows` of a batch of one)."""
    return int(draw_rows(probs[None], [generator])[0])


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    if params.greedy:
        return int(logits.argmax())
    return draw(filter_logits(logits, params).softmax(-1), generator)


def token_logprobs(logprobs: torch.Tensor, token: int, num_top: int | None) -> dict[int, float]:
    """The sampled token's logprob plus the top `num_top` alternatives."""
    out = {token: float(logprobs[token])}
    if num_top:
        values, ids = logprobs.topk(num_top)
        out.update({int(i): float(v) for i, v in zip(ids, values)})
    return out


def token_logprobs_rows(logits: torch.Tensor, tokens: list[int], num_tops: list[int | None]) -> list[dict | None]:
    """`token_logprobs` for a batch of raw logit rows [R, V] (None where `num_tops[i]` is None), from one
    log_softmax and one top-k."""
    if all(n is None for n in num_tops):
        return [None] * len(tokens)
    logprobs = torch.log_softmax(logits, -1)
    chosen = logprobs.gather(1, torch.tensor(tokens, device=logprobs.device)[:, None])[:, 0].tolist()
    top = max(n or 0 for n in num_tops)
    values, ids = logprobs.topk(top) if top else (None, None)
    values, ids = (values.tolist(), ids.tolist()) if top else ([[]] * len(tokens), [[]] * len(tokens))
    return [None if n is None else {token: chosen[i], **dict(zip(ids[i][:n], values[i][:n]))}
            for i, (n, token) in enumerate(zip(num_tops, tokens))]


def make_generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(generator_seed(seed))


def generator_seed(seed: int) -> int:
    """The 32 bits a CPU generator keeps of `seed` (mt19937 reads only the low 32): seeds in [0, 2**32)
    as they are, any other 64-bit seed mixed down (splitmix64's finaliser), so seeds that differ only
    above bit 31 sample differently."""
    if 0 <= seed < 2 ** 32:
        return seed
    z = seed % 2 ** 64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2 ** 64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2 ** 64
    return (z ^ (z >> 31)) % 2 ** 32
