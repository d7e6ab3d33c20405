"""TRL's masked importance sampling: GRPOConfig.vllm_importance_sampling_mode "sequence_mask" (TRL's default since
1.x) and "token_mask" (TRL docs, GRPOTrainer; the masked IS of Liu, Li et al. 2025, "When Speed Kills Stability:
Demystifying RL Collapse from the Training-Inference Mismatch"): the importance ratio between the trainer and vLLM is
set to 0 where it leaves [C_min, C_max], per token or for the whole sequence.

With log r_t = old_logprobs_t - rollout_logprobs_t (TRL: old_per_token_logps - sampling_per_token_logps):
    token_mask:    rho_b,t = r_t            if C_min <= r_t <= C_max            else 0
    sequence_mask: rho_b,t = prod_t' r_t'   if C_min <= prod_t' r_t' <= C_max   else 0   (every token of b)
C_max = rollout_rs_threshold (TRL's vllm_importance_sampling_clip_max, default 3.0), C_min =
rollout_rs_threshold_lower (clip_min, default none: 0). This file is the [C_min <= . <= C_max] part; the factor r
is algorithms.rollout_correction.rollout_is (token or sequence, rollout_is_threshold >= C_max to leave r uncut):
TRL's default is rollout_is: sequence, rollout_is_threshold: 3.0, rollout_rs: sequence_mask.

Deviation: none in the mask; masked tokens stay in the aggregation's count, as in TRL (it multiplies the per-token
loss by rho). Shapes: B sequences, T response tokens.
"""

from __future__ import annotations

import dataclasses

from algos import rollout_rs


@dataclasses.dataclass
class Config:
    """[C_min, C_max] (rollout_rs_threshold_lower, rollout_rs_threshold)."""

    lower: float = 0.0
    """C_min: ratios below are masked (0 = none, TRL's default)."""
    upper: float = 3.0
    """C_max: ratios above are masked."""


# the bands are veRL's (algos/rollout_rs.py), with TRL's own bounds (Config above)
token_mask = rollout_rs.token
sequence_mask = rollout_rs.sequence
