"""Floating-point tolerances for tests that compare two computations of the same outputs.

The rule (docs/numerics.md): two runs that apply the same operations to the same values in the same
shapes are compared exactly (tiering on/off, a prefix hit computed in the original row groups). Two
runs that group a reduction differently (a batch of 1 row vs 3 in a matrix product, a verification
step's 1 + K rows vs a decode's 1, chunked prefill, another library's formula) round differently,
and how they round depends on the kernels the CPU's capabilities select (oneDNN/MKL choose them by
shape). Those comparisons get a bound derived here from the model, never one read off a run.

Derivation. A length-n sum in a precision with unit roundoff u = eps / 2 is off by at most
gamma_n = n u / (1 - n u) times the sum of its terms' magnitudes (Higham, Accuracy and Stability of
Numerical Algorithms, 2nd ed., §3.1), and in practice, rounding errors being independent, by about
sqrt(n) u times that, rarely more than LAMBDA = 3 times as much (Higham & Mary, SIAM J. Sci. Comput.
41(5), 2019); n: the longest reduction of a layer (`reduction_length`). A layer runs about m = 9
reductions one after another (q_a, q_b, kv_a, the scores, the attention's sum, o_proj, the MLP's
up and down projections, the norms), and each run of the comparison has its own errors: independent,
they add up to sqrt(2 m L) times one reduction's over L layers (the lm_head counted as one), which
for L >= 5 is at most 2 L. So two runs are taken to be L LAMBDA sqrt(n) eps apart, relative to the
residual stream, linear in L, which also leaves a layer a little room to amplify what it receives.
The final hidden state is g * n, n RMS-normed (entries of size 1) and g the norm's weight; a
relative error r of n, not aligned with any row W_t of the lm_head (rounding noise projects like a
random vector), moves logit t by about r ||W_t * g|| (`logit_scale`). A logprob is a logit minus
logsumexp, both perturbed: twice that.

The worst case (gamma_n instead of sqrt(n) u) would be sqrt(n) / LAMBDA times looser (4-8x on the
test models) and would still catch a wrong token, a missing layer or a wrong scale, but hide smaller
bugs.

Discrete decisions (the indexer's top-k, MoE routing, the greedy argmax, a value rounded to e4m3 or
bf16 for storage) are not covered by a tolerance: where the two values sit a rounding apart on
either side of a boundary, the outcomes differ by a whole step. `assert_same_greedy` checks that the
inputs leave a clear top-1 lead before it requires equal tokens; FP8 latents are compared as stored
rows instead (tests/test_kv_cache_dtype.py), FP8 indexer keys by their selections (tests/test_tiers.py).
"""
from __future__ import annotations

import math

import torch

LAMBDA = 3.0
EPS32 = torch.finfo(torch.float32).eps
U32 = EPS32 / 2  # float32's unit roundoff: one correctly rounded operation is off by at most U32 relative


def gamma(n: int, eps: float = EPS32) -> float:
    """Higham's gamma_n = n u / (1 - n u), u = eps / 2: a length-n sum or dot product, computed in any
    order, is off by at most gamma_n times the sum of its terms' magnitudes (products included). For
    one-sided checks that must hold on every input (a bound that must stay a bound)."""
    return n * eps / 2 / (1 - n * eps / 2)


EPS64 = torch.finfo(torch.float64).eps
# Two float64 evaluations of one closed-form expression (a formula of the planner and the same formula
# written out by hand in another order), each at most 32 rounded operations deep: 2 gamma_32 apart,
# relative (no cancellation: every term is positive).
REGROUPED64 = 2 * gamma(32, EPS64)


def chain_tolerance(magnitude: float, n: int, eps: float = EPS32) -> float:
    """Two computations of one value in the same precision that round differently (another grouping
    or another formula), each at most n rounded operations deep (a sum's terms count one each), on
    terms whose magnitudes add up to `magnitude`: LAMBDA sqrt(n) eps x magnitude, the module's bound
    (each side about sqrt(n) u, rarely LAMBDA times more; two sides: 2 u = eps)."""
    return LAMBDA * math.sqrt(n) * eps * magnitude


def e4m3_error(values: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """Elementwise bound (float64) of |fl(e4m3(values / scale) * scale) - values| as float32 computes
    it: half a step of e4m3 (3 mantissa bits: at most 2^-4 of the value in the normal range; below it
    the subnormal spacing 2^-9, so 2^-10 of the scale), plus the division, the multiplication back
    and the test's subtraction, each rounded to float32 (U32 relative: 3 U32 = 1.5 eps of the value,
    and the factor 1 + eps on the rest)."""
    v = values.double().abs()
    s = scale.double() if isinstance(scale, torch.Tensor) else float(scale)
    return torch.maximum(v / 16, s * 2 ** -10 * torch.ones_like(v)) * (1 + EPS32) + 1.5 * EPS32 * v


def _parts(model):
    """(config, lm_head weight, final norm weight) of an LLM, a sparsekv DSAModel or a transformers model."""
    model = getattr(getattr(model, "engine", None), "model", model)  # an LLM: its engine's model
    if isinstance(getattr(model, "lm_head", None), torch.Tensor):    # sparsekv DSAModel
        return model.cfg, model.lm_head, model.norm
    return model.config, model.lm_head.weight, model.model.norm.weight  # transformers


def reduction_length(cfg, attended: int | None = None) -> int:
    """The longest sum inside one layer: hidden (q_a, kv_a, MLP up), MLP down (intermediate), q_b
    (q_lora_rank), o_proj (heads x v_head_dim), a query-key score (kv_lora_rank + rope), and the
    attention's sum over the keys it reads (at most index_topk, or `attended`)."""
    return max(cfg.hidden_size, cfg.intermediate_size, cfg.moe_intermediate_size, cfg.q_lora_rank or 0,
               cfg.num_attention_heads * cfg.v_head_dim, cfg.kv_lora_rank + cfg.qk_rope_head_dim,
               attended if attended is not None else cfg.index_topk)


def logit_scale(model) -> float:
    """max_t ||W_t * g||: the size of a logit's error per unit relative error of the normed final
    hidden state (see the module docstring)."""
    _, head, norm = _parts(model)
    return float((head.detach().float() * norm.detach().float()).norm(dim=-1).max())


def logit_tolerance(model, attended: int | None = None, extra_layers: int = 0, eps: float = EPS32) -> float:
    """Two float32 computations of the same logits that group their reductions differently:
    (layers + lm_head) x LAMBDA sqrt(n) eps x logit_scale. extra_layers: more layers on the way (the
    MTP layer after the target's)."""
    cfg = _parts(model)[0]
    layers = cfg.num_hidden_layers + 1 + extra_layers
    return layers * LAMBDA * math.sqrt(reduction_length(cfg, attended)) * eps * logit_scale(model)


def logprob_tolerance(model, attended: int | None = None, extra_layers: int = 0, eps: float = EPS32) -> float:
    """The same for logprobs: a logit and the logsumexp it is normalised by, each off by logit_tolerance."""
    return 2 * logit_tolerance(model, attended, extra_layers, eps)


def max_logprob_gap(want: list[dict], got: list[dict]) -> float:
    """The largest difference of a token's logprob listed on both sides."""
    return max((abs(x[t] - y[t]) for x, y in zip(want, got, strict=True) for t in x.keys() & y.keys()), default=0.0)


def assert_logprobs_close(want: list[dict], got: list[dict], tol: float) -> float:
    """Every logprob listed on both sides within tol. The lists are top-k sets: where rounding swaps
    a near-tie at the list's edge, a token listed on one side only must be within 2 tol of the other
    side's last listed value (it could have been listed there too). Returns the largest difference."""
    for step, (x, y) in enumerate(zip(want, got, strict=True)):
        for a, b in ((x, y), (y, x)):
            for t in a.keys() - b.keys():
                assert a[t] <= min(b.values()) + 2 * tol, f"step {step}: token {t} listed on one side only ({a[t]})"
    worst = max_logprob_gap(want, got)
    assert worst <= tol, f"logprobs differ by {worst:.3g} > tolerance {tol:.3g}"
    return worst


def assert_clear_lead(out, tol: float) -> None:
    """Greedy tokens only need to agree where the chosen token leads every other listed one by more
    than 2 tol (two runs within tol of each other cannot swap them). A test whose inputs fail this
    has a near-tie: change the prompt or the length, not the tolerance."""
    for step, (token, d) in enumerate(zip(out.token_ids, out.logprobs)):
        rival = max((v for t, v in d.items() if t != token), default=-math.inf)
        assert d[token] - rival > 2 * tol, (f"not a robust test input: greedy token {token} at step {step} "
                                            f"leads by {d[token] - rival:.3g}, within 2 x {tol:.3g}")


def assert_same_greedy(want, got, tol: float, lead: bool = True) -> float:
    """Greedy outputs of two computations that round differently: a clear top-1 lead at every step of
    `want` (unless lead=False: the logprobs are raw while penalties decided), the same tokens, and
    logprobs within tol. Returns the largest logprob difference."""
    worst = 0.0
    for a, b in zip(want, got, strict=True):
        if lead:
            assert_clear_lead(a, tol)
        assert a.token_ids == b.token_ids
        worst = max(worst, assert_logprobs_close(a.logprobs, b.logprobs, tol))
    return worst
