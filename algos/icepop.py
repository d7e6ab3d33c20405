"""IcePop's token mask (Ling Team, "Every Step Evolves: Scaling Reinforcement Learning for Trillion-Scale Thinking
Model" (Ring-1T), arXiv:2510.18855, section "IcePop"): tokens whose training-vs-inference probability ratio leaves
[alpha, beta] get no gradient, so that the few tokens the two engines disagree on most do not compound over the
steps of a long run (the paper's double-sided masking and calibration).

With k_t = pi_train(y_t) / pi_infer(y_t) = exp(old_logprobs_t - rollout_logprobs_t):
    M(k) = k if alpha <= k <= beta else 0
    J    = E[ sum_t M(k_t) * min(r_t A_t, clip(r_t, 1 - eps, 1 + eps) A_t) ]       (r_t: the PPO ratio)
Defaults alpha = 0.5, beta = 5 (IcePop's published setting). The mask [alpha <= k <= beta] is this
file; the factor k is the token importance weight of algorithms.rollout_correction.rollout_is: token (truncated at
rollout_is_threshold: set it to beta or more to get M(k) exactly). The trainer multiplies each token's advantage by
both (algos/correction.py).

Deviation: none in the mask itself; the masked tokens stay in the loss's token count (as in the paper's sum over t),
and in the KL / entropy terms.
Shapes: B sequences, T response tokens.
"""

from __future__ import annotations

import dataclasses

from algos import rollout_rs


@dataclasses.dataclass
class Config:
    """The band of kept ratios: [alpha, beta] (rollout_rs_threshold_lower, rollout_rs_threshold)."""

    lower: float = 0.5
    """alpha: tokens whose ratio is below are masked."""
    upper: float = 5.0
    """beta: tokens whose ratio is above are masked."""


# M(k)'s mask is veRL's token band (algos/rollout_rs.py) with IcePop's own bounds (Config above)
mask = rollout_rs.token
