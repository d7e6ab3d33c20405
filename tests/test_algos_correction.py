"""algos/: the rollout-correction masks (rollout_rs: ROLLOUT_RS_FNS, one file each) on a small [B,T] example whose
ratios are chosen by hand, their metrics, and the trainer's use of them (advantages x IS weight x keep)."""

import math

import pytest
import torch

from algos import ROLLOUT_RS_FNS, correction, geometric_rs, icepop, ppo_loss, rollout_rs, trl_is_mask

# [B=3,T=3]; log r = old - rollout, chosen by hand (row 2's last token is padding: its huge ratio must not count)
LOG_R = torch.tensor(
    [
        [math.log(0.4), math.log(1.5), math.log(6.0)],  # r = 0.4, 1.5, 6.0: prod 3.6, geometric mean 3.6 ** (1/3)
        [math.log(1.004), math.log(1.0), math.log(1.008)],  # prod ~1.012, geometric mean ~1.004
        [math.log(2.5), math.log(0.9), 50.0],  # valid: r = 2.5, 0.9: prod 2.25, geometric mean 1.5
    ]
)
MASK = torch.tensor([[True, True, True], [True, True, True], [True, True, False]])
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -4.0, -1.2], [-2.0, -1.0, -0.7]])  # [B,T] any old log-probs
ROLLOUT = OLD - LOG_R  # [B,T] so that old - rollout = LOG_R


def keep(name: str, **band) -> list[list[bool]]:
    return (correction.rollout_rs_mask(OLD, ROLLOUT, MASK, name, band.get("upper"), band.get("lower"))[0] > 0).tolist()


def test_verl_token_and_sequence_rejection_hand_computed():
    """veRL's rollout_rs token: each valid token with r outside [0.5, 2] dropped (0.4, 6.0, 2.5); sequence: the
    product (3.6, 1.012, 2.25) outside [0.5, 2] drops rows 0 and 2 whole; padding is always kept."""
    assert keep("token") == [[False, True, False], [True, True, True], [False, True, True]]
    assert keep("sequence") == [[False] * 3, [True] * 3, [False, False, True]]
    assert keep("sequence", upper=4.0) == [[True] * 3, [True] * 3, [True] * 3]  # 3.6 and 2.25 <= 4
    assert keep("token", upper=7.0, lower=0.3) == [[True] * 3] * 3
    assert rollout_rs.Config() == rollout_rs.Config(lower=0.5, upper=2.0)  # veRL: lower = 1 / upper


def test_geometric_mean_rejection_hand_computed():
    """geometric: the mean log-ratio over valid tokens: row 0 3.6 ** (1/3) = 1.533, row 1 (1.004 * 1.008) ** (1/3) =
    1.004, row 2 (2.25) ** (1/2) = 1.5 (the padding's 50 not counted); band [1 / 1.01, 1.01] keeps row 1 only."""
    assert keep("geometric") == [[False] * 3, [True] * 3, [False, False, True]]
    assert keep("geometric", upper=1.51, lower=0.9) == [[False] * 3, [True] * 3, [True] * 3]  # 1.5 in, 1.533 out
    assert keep("geometric", upper=1.003, lower=0.9) == [[False] * 3, [False] * 3, [False, False, True]]
    assert geometric_rs.Config().upper == 1.01 and geometric_rs.Config().lower == pytest.approx(1 / 1.01)


def test_icepop_token_band_hand_computed():
    """IcePop: k outside [alpha 0.5, beta 5] masked: 0.4 and 6.0; 2.5 (inside) kept, unlike veRL's token [0.5, 2]."""
    assert keep("icepop") == [[False, True, False], [True, True, True], [True, True, True]]
    assert (icepop.Config().lower, icepop.Config().upper) == (0.5, 5.0)
    # IcePop's M(k) = k in the band, else 0: the mask times the token IS weight at a threshold >= beta
    w, _ = correction.rollout_is_weights(OLD, ROLLOUT, MASK, "token", 5.0)
    k_in_band = w * correction.rollout_rs_mask(OLD, ROLLOUT, MASK, "icepop")[0]  # [B,T]
    want = torch.tensor([[0.0, 1.5, 0.0], [1.004, 1.0, 1.008], [2.5, 0.9, 1.0]])  # padding: weight 1 (no token)
    torch.testing.assert_close(k_in_band, want)


def test_trl_token_and_sequence_mask_hand_computed():
    """TRL's *_mask: ratios above C_max (3.0; no C_min) set to 0: token_mask drops 6.0 only; sequence_mask drops row
    0 (prod 3.6) only (2.25 and 1.012 <= 3). With C_min 0.5 token_mask also drops 0.4."""
    assert keep("token_mask") == [[True, True, False], [True] * 3, [True] * 3]
    assert keep("sequence_mask") == [[False] * 3, [True] * 3, [True] * 3]
    assert keep("token_mask", lower=0.5) == [[False, True, False], [True] * 3, [True] * 3]
    assert (trl_is_mask.Config().lower, trl_is_mask.Config().upper) == (0.0, 3.0)


def test_masked_fractions_are_logged_and_none_masks_nothing():
    """rollout_corr/rollout_rs_masked_frac: dropped valid tokens / valid tokens (padding not counted);
    rollout_corr/rollout_rs_seq_masked_frac: sequences with a dropped token / sequences."""
    _, m = correction.rollout_rs_mask(OLD, ROLLOUT, MASK, "token")
    assert m["rollout_corr/rollout_rs_masked_frac"] == pytest.approx(3 / 8)  # 0.4, 6.0, 2.5 of 8 valid tokens
    assert m["rollout_corr/rollout_rs_seq_masked_frac"] == pytest.approx(2 / 3)
    _, m = correction.rollout_rs_mask(OLD, ROLLOUT, MASK, "sequence")
    assert m["rollout_corr/rollout_rs_masked_frac"] == pytest.approx(5 / 8)  # rows 0 (3) and 2 (2 valid)
    k, m = correction.rollout_rs_mask(OLD, ROLLOUT, MASK, "none")
    assert torch.equal(k, torch.ones(3, 3)) and m == {}
    with pytest.raises(ValueError, match="unknown 'tokens'; known: none, token, sequence"):
        correction.rollout_rs_mask(OLD, ROLLOUT, MASK, "tokens")


@pytest.mark.parametrize("name", sorted(ROLLOUT_RS_FNS))
def test_every_mask_keeps_padding_and_ratio_one(name):
    """Registry-wide: identical log-probs (ratio 1 everywhere) keep every token; padding is kept whatever its ratio;
    the mask is 0/1 and has no gradient."""
    fn, cfg = ROLLOUT_RS_FNS[name]
    assert fn(torch.zeros(3, 3), MASK, cfg()).all()
    pad = torch.where(MASK, 0.0, 80.0)  # [B,T] a huge ratio on the padding only
    assert fn(pad, MASK, cfg()).all()
    k, _ = correction.rollout_rs_mask(OLD, ROLLOUT.requires_grad_(True), MASK, name)
    assert set(k.unique().tolist()) <= {0.0, 1.0} and not k.requires_grad


def test_a_dropped_token_has_no_policy_gradient():
    """The trainer multiplies the advantages by the IS weight and keep: a dropped token's PPO gradient is 0, a kept
    one's is unchanged."""
    logp = OLD.clone().requires_grad_(True)
    batch = {"old_logprobs": OLD, "advantages": torch.ones(3, 3), "response_mask": MASK}
    ppo_loss.compute(logp, batch, ppo_loss.Config(), "token-mean")[0].backward()
    plain = logp.grad.clone()
    logp.grad = None
    k, _ = correction.rollout_rs_mask(OLD, ROLLOUT, MASK, "token")
    ppo_loss.compute(logp, {**batch, "advantages": batch["advantages"] * k}, ppo_loss.Config(), "token-mean")[
        0
    ].backward()
    assert torch.equal(logp.grad == 0, ~torch.tensor(keep("token")) | ~MASK)
    assert torch.allclose(logp.grad, plain * k)
