"""algos/ policy losses beyond ppo / sft: hand-computed numbers for each, and the ratio-1 property.

Convention: old_logprobs = 0, so logprobs = log r (the ratio r is chosen, logp follows).
"""

import math

import pytest
import torch

from algos import (
    ENTROPY_LOSS_FNS,
    POLICY_LOSS_FNS,
    cispo,
    dpo,
    entropy,
    gspo,
    importance_sampling,
    mix,
    mix_chord,
    opmd,
    ppo_loss,
    rec,
    sapo,
    sft_loss,
    sppo,
    topr,
)
from algos.utils import AGG_MODES, BatchError, aggregate


def batch_of(ratios, adv, mask=None):
    """logprobs (leaf, requires grad) = log(ratios), batch with old_logprobs = 0."""
    r = torch.tensor(ratios, dtype=torch.float32)
    lp = torch.log(r).requires_grad_()
    b = {
        "old_logprobs": torch.zeros_like(r),
        "advantages": torch.tensor(adv, dtype=torch.float32),
        "response_mask": torch.ones_like(r) if mask is None else torch.tensor(mask, dtype=torch.float32),
    }
    return lp, b


def close(actual, expected, atol=1e-6):
    """Nested lists / tensors equal within atol (pytest.approx does not nest)."""
    return torch.allclose(
        torch.as_tensor(actual, dtype=torch.float32), torch.tensor(expected, dtype=torch.float32), atol=atol
    )


def grad_of(fn, lp, b, cfg, mode="token-mean"):
    loss, m = fn(lp, b, cfg, mode)
    loss.backward()
    return loss.item(), m, lp.grad.tolist()


# --- GSPO


def test_gspo_ratio_value_is_sequence_ratio_gradient_is_per_token():
    # row 0: log r = [0.1, -0.3, 0.05] -> s0 = mean = -0.05, ratio value exp(-0.05) = 0.951229 on EVERY token
    # row 1: log r = [0.2, 0.0, (pad)] -> s1 = 0.1, ratio 1.105171; per-token advantages
    lp = torch.tensor([[0.1, -0.3, 0.05], [0.2, 0.0, 9.0]], requires_grad=True)
    b = {
        "old_logprobs": torch.zeros(2, 3),
        "advantages": torch.tensor([[1.0, 2.0, -1.0], [1.0, 1.0, 5.0]]),
        "response_mask": torch.tensor([[1, 1, 1], [1, 1, 0]]),
    }
    wide = gspo.Config(clip_range_low=10.0, clip_range_high=10.0)  # no clipping
    loss, m = gspo.compute(lp, b, wide, "token-mean")  # loss_agg_mode ignored: seq-mean-token-mean
    s0, s1 = math.exp(-0.05), math.exp(0.1)
    # row 0: mean_t(-A s0) = -s0 (1 + 2 - 1) / 3 = -0.634153 ; row 1: -s1 = -1.105171 ; mean = -0.869662
    assert loss.item() == pytest.approx((-s0 * 2 / 3 - s1) / 2, abs=1e-6)
    loss.backward()
    # d/dlogp_t = -A_t * s_b / (2 sequences * n_b tokens): token-level advantages survive (not sum_t A_t)
    expected = [[-s0 / 6, -2 * s0 / 6, s0 / 6], [-s1 / 4, -s1 / 4, 0.0]]
    assert torch.allclose(lp.grad, torch.tensor(expected), atol=1e-6)
    assert m["ppo_kl_seq"] == pytest.approx((0.05 - 0.1) / 2, abs=1e-6)  # mean_b(-s_b)
    assert m["ppo_kl"] == pytest.approx(-(0.1 - 0.3 + 0.05 + 0.2) / 5, abs=1e-6)  # token mean of -log r


def test_gspo_default_clip_is_sequence_level():
    # both rows have s = 0.1, ratio 1.105171, far outside [1 - 3e-4, 1 + 4e-4]
    lp, b = batch_of([[math.exp(0.1)] * 2] * 2, [[1.0, 1.0], [-1.0, -1.0]])
    loss, m, g = grad_of(gspo.compute, lp, b, gspo.Config(), "seq-mean-token-sum")
    s = math.exp(0.1)
    # A > 0: max(-s, -1.0004) = -1.0004, clipped, no gradient; A < 0: max(s, 1.0004) = s, gradient s / 4
    assert loss == pytest.approx((-1.0004 + s) / 2, abs=1e-6)
    assert close(g, [[0.0, 0.0], [s / 4, s / 4]])
    assert m["pg_clipfrac"] == 0.5 and m["ppo_kl"] == pytest.approx(-0.1, abs=1e-6)


# --- CISPO


def test_cispo_gradient_is_clipped_is_weight_per_token():
    # r = [1.5, 0.5, 1.1], A = [1, -1, 2]; eps_low 1.0 (bound 0), eps_high 0.28 -> w = [1.28, 0.5, 1.1]
    lp, b = batch_of([[1.5, 0.5, 1.1]], [[1.0, -1.0, 2.0]])
    loss, m, g = grad_of(cispo.compute, lp, b, cispo.Config())
    # token losses -A w logp: -1.28 log 1.5 = -0.518995 ; -0.5 log 2 = -0.346574 ; -2.2 log 1.1 = -0.209682
    assert loss == pytest.approx((-1.28 * math.log(1.5) - 0.5 * math.log(2) - 2.2 * math.log(1.1)) / 3, abs=1e-6)
    assert g[0] == pytest.approx([-1.28 / 3, 0.5 / 3, -2.2 / 3], abs=1e-6)  # -A * clip(r) / n
    assert m["pg_clipfrac"] == pytest.approx(1 / 3)  # only r = 1.5 is clipped
    assert m["ppo_kl"] == pytest.approx(-(math.log(1.5) + math.log(0.5) + math.log(1.1)) / 3, abs=1e-6)
    # enable_mask_clip: token 0 has A > 0 and r = 1.5 > 1.28 -> masked; token 1 (A < 0, r = 0.5 >= 0) kept
    lp, b = batch_of([[1.5, 0.5, 1.1]], [[1.0, -1.0, 2.0]])
    _, _, g = grad_of(cispo.compute, lp, b, cispo.Config(enable_mask_clip=True))
    assert g[0] == pytest.approx([0.0, 0.5 / 3, -2.2 / 3], abs=1e-6)


# --- SAPO


def test_sapo_published_objective():
    # token 0: r = 1, A = 1, tau 1: f = sigmoid(0) * 4 = 2 ; d f/d logp = 4 s (1 - s) r = 4 * 0.25 * 1 = 1
    # token 1: r = 2, A = -1, tau 1.05: s = sigmoid(1.05) = 0.740775, f = s * 4 / 1.05 = 2.822000
    #          d f/d logp = 4 s (1 - s) * 2 = 1.536216
    lp, b = batch_of([[1.0, 2.0]], [[1.0, -1.0]])
    loss, m, g = grad_of(sapo.compute, lp, b, sapo.Config())
    s = 1 / (1 + math.exp(-1.05))
    assert loss == pytest.approx((-2.0 + s * 4 / 1.05) / 2, abs=1e-6)  # mean(-A f)
    # gradient -A f'(r) r / n: on-policy token gets exactly REINFORCE's -A / n (Trinity's sg(f) form: -2 A / n)
    assert g[0] == pytest.approx([-0.5, 4 * s * (1 - s) * 2 / 2], abs=1e-6)
    assert m["avg_soft_gate"] == pytest.approx((2.0 + s * 4 / 1.05) / 2, abs=1e-6)
    assert m["avg_ratio"] == pytest.approx(1.5) and m["pos_adv_frac"] == 0.5
    with pytest.raises(ValueError, match="tau_pos <= tau_neg"):
        sapo.compute(lp, b, sapo.Config(tau_pos=2.0), "token-mean")


# --- TOPR


def test_topr_truncates_negative_examples_only():
    # r = [0.5, 2, 0.5, 2], A = [1, 1, -1, -1] -> alpha = [1, 1, clip(0.5) = 0.5, clip(2) = 1]
    lp, b = batch_of([[0.5, 2.0, 0.5, 2.0]], [[1.0, 1.0, -1.0, -1.0]])
    loss, m, g = grad_of(topr.compute, lp, b, topr.Config())
    # -alpha A logp: -log .5 = .693147 ; -log 2 = -.693147 ; .5 log .5 = -.346574 ; log 2 = .693147 -> sum .346574
    assert loss == pytest.approx(0.5 * math.log(2) / 4, abs=1e-6)
    assert g[0] == pytest.approx([-0.25, -0.25, 0.125, 0.25], abs=1e-6)  # -alpha A / 4
    assert m["pg_clipfrac"] == 0.25 and m["avg_alpha"] == pytest.approx(0.875)
    # threshold 1.0: A = 1 tokens are negatives too -> alpha = [0.5, 1, 0.5, 1]
    lp, b = batch_of([[0.5, 2.0, 0.5, 2.0]], [[1.0, 1.0, -1.0, -1.0]])
    _, m, g = grad_of(topr.compute, lp, b, topr.Config(advantage_threshold=1.0))
    assert g[0] == pytest.approx([-0.125, -0.25, 0.125, 0.25], abs=1e-6) and m["pg_clipfrac"] == 0.5


# --- sPPO


def test_sppo_band():
    # eps 0.3: band [1/1.3, 1.3] = [0.769, 1.3]; r = [1.2 in, 1.5 out, 0.7 out, 0.8 in]
    lp, b = batch_of([[1.2, 1.5, 0.7, 0.8]], [[1.0, 1.0, -1.0, 2.0]])
    loss, m, g = grad_of(sppo.compute, lp, b, sppo.Config())
    # -A log r on in-band tokens: -log 1.2 = -0.182322 ; -2 log 0.8 = 0.446287 -> / 4 = 0.065991
    assert loss == pytest.approx((-math.log(1.2) - 2 * math.log(0.8)) / 4, abs=1e-6)
    assert g[0] == pytest.approx([-0.25, 0.0, 0.0, -0.5], abs=1e-6)
    assert m["pg_clipfrac"] == 0.5


# --- REC


def rec_batch(rewards, groups, T=2):
    return {
        "rewards": torch.tensor(rewards),
        "group_index": torch.tensor(groups),
        "response_mask": torch.ones(len(rewards), T),
    }


def test_rec_advantage_hand_computed():
    b = rec_batch([1.0, 0.0, 0.0, 0.0, 3.0], [0, 0, 0, 0, 1])
    out, m = rec.advantage(b, rec.AdvantageConfig())
    # group 0: mean 0.25 -> [0.75, -0.25, -0.25, -0.25]; group 1 is a singleton: A = r = 3
    assert out["advantages"][:, 0].tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25, 3.0])
    assert m["filtered_count"] == 0.0
    # std_normalize: population std of [1,0,0,0] = sqrt((0.5625 + 3 * 0.0625) / 4) = sqrt(0.1875) = 0.433013
    out, _ = rec.advantage(b, rec.AdvantageConfig(std_normalize=True))
    sd = math.sqrt(0.1875) + 1e-6
    assert out["advantages"][:4, 0].tolist() == pytest.approx([0.75 / sd, -0.25 / sd, -0.25 / sd, -0.25 / sd], abs=1e-5)


def test_rec_advantage_drop_balance():
    b = rec_batch([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0], [0, 0, 0, 0, 1, 1, 1, 1])
    # group 0: 1 at/above mean 0.25, 3 below -> 2 dropped (A = 0); kept [1, 0] -> mean 0.5 -> A = +-0.5
    # group 1: 2 vs 2, balanced -> nothing dropped, mean 0.5 -> +-0.5
    patterns = set()
    for seed in range(8):
        out, m = rec.advantage(b, rec.AdvantageConfig(drop="balance", seed=seed))
        a = out["advantages"][:, 0].tolist()
        assert a[0] == pytest.approx(0.5) and sorted(a[1:4]) == pytest.approx([-0.5, 0.0, 0.0])
        assert a[4:] == pytest.approx([0.5, 0.5, -0.5, -0.5])
        assert m["filtered_count"] == 2.0 and m["drop_balance"] == 0.25
        assert (
            out["advantages"].tolist()
            == rec.advantage(b, rec.AdvantageConfig(drop="balance", seed=seed))[0]["advantages"].tolist()
        )
        patterns.add(tuple(a[1:4]))
    assert len(patterns) > 1  # the seed decides which negatives go
    # std_normalize after the drop: kept [1, 0], population std 0.5 -> A = +-0.5 / 0.5 = +-1
    out, _ = rec.advantage(b, rec.AdvantageConfig(drop="balance", std_normalize=True))
    assert out["advantages"][0, 0].item() == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize(
    "mode,kept",
    [
        # ratios [0.3, 0.7, 1.0, 1.5, 3.5], eps 0.2 (band [0.8, 1.2]), eps'_low 0.6 (<= 0.4), eps'_high 2 (>= 3)
        ("none", ([1, 1, 1, 1, 1], [1, 1, 1, 1, 1])),
        ("two-side", ([0, 0, 1, 0, 0], [0, 0, 1, 0, 0])),  # only r = 1.0 is in [0.8, 1.2]
        ("one-side", ([1, 1, 1, 0, 0], [0, 0, 1, 1, 1])),  # A > 0: r <= 1.2 ; A < 0: r >= 0.8
        ("ring", ([1, 0, 1, 0, 0], [0, 0, 1, 0, 1])),  # band, or A > 0 and r <= 0.4, or A < 0 and r >= 3
    ],
)
def test_rec_clip_modes(mode, kept):
    lp, b = batch_of([[0.3, 0.7, 1.0, 1.5, 3.5]] * 2, [[1.0] * 5, [-1.0] * 5])
    _, m, g = grad_of(rec.loss, lp, b, rec.LossConfig(clip_mode=mode))
    # a kept token's gradient is -A / 10 (token-mean over 10 tokens), a dropped one's is 0
    assert close(g, [[-0.1 * k for k in kept[0]], [0.1 * k for k in kept[1]]])
    assert m["pg_clipfrac"] == pytest.approx(1 - sum(kept[0] + kept[1]) / 10)


@pytest.mark.parametrize(
    "kw,expected",
    [
        ({}, [-0.5, 0.5]),  # -A / 2
        ({"weight": "importance_sampling"}, [-1.0, 0.25]),  # -A r / 2, r = [2, 0.5]
        ({"weight": "advantage"}, [-math.e / 2, math.exp(-1) / 2]),  # A' = A exp(A): [e, -1/e]
        (
            {"regularizer": "k2", "regularizer_coef": 0.1},
            [-0.5 + 0.1 * math.log(2), 0.5 - 0.1 * math.log(2)],
        ),  # + 2 c log r / 2
        ({"regularizer": "forward-kl", "regularizer_coef": 0.1}, [-0.55, 0.45]),  # - c / 2
    ],
)
def test_rec_weights_and_regularizers(kw, expected):
    lp, b = batch_of([[2.0, 0.5]], [[1.0, -1.0]])
    loss, _, g = grad_of(rec.loss, lp, b, rec.LossConfig(**kw))
    assert g[0] == pytest.approx(expected, abs=1e-6)
    if not kw:
        assert loss == pytest.approx(-math.log(2), abs=1e-6)  # mean(-log 2, -(-1) log 0.5)


# --- OPMD, importance sampling, SFT variants


def test_opmd_loss():
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    b = {"advantages": torch.tensor([[2.0, 1.0]]), "response_mask": torch.ones(1, 2)}
    loss, m = opmd.loss(lp, b, opmd.LossConfig(tau=3.0), "token-mean")
    assert loss.item() == pytest.approx(0.5) and m["opmd_loss"] == pytest.approx(0.5)  # mean(2, 2) / (1 + 3)
    loss.backward()
    assert close(lp.grad, [[-2 / 8, -1 / 8]])  # -A / (2 tokens * 4)


def test_importance_sampling_loss():
    lp, b = batch_of([[2.0, 0.5]], [[1.0, 1.0]])
    loss, m, g = grad_of(importance_sampling.compute, lp, b, importance_sampling.Config())
    assert loss == pytest.approx(-1.25, abs=1e-6)  # mean(-2, -0.5)
    assert g[0] == pytest.approx([-1.0, -0.25], abs=1e-6)  # -A r / 2
    assert m["ratio_mean"] == pytest.approx(1.25) and m["approx_kl"] == pytest.approx(0.0, abs=1e-6)


def test_sft_is_and_phi():
    p = torch.tensor([[0.5, 0.9]])
    b = {"response_mask": torch.ones(1, 2)}
    lp = torch.log(p).requires_grad_()
    loss, m = sft_loss.compute_is(lp, b, sft_loss.Config(), "token-mean")
    # -p log p: 0.346574 + 0.094824 -> mean 0.220699 ; gradient -p / 2
    assert loss.item() == pytest.approx((-0.5 * math.log(0.5) - 0.9 * math.log(0.9)) / 2, abs=1e-6)
    loss.backward()
    assert close(lp.grad, [[-0.25, -0.45]]) and m["sft_is_loss"] == pytest.approx(loss.item())
    lp = torch.log(p).requires_grad_()
    loss, _ = sft_loss.compute_phi(lp, b, sft_loss.PhiConfig(), "token-mean")
    # phi = p(1-p) = [0.25, 0.09]: 0.173287 + 0.009482 -> mean 0.091385 ; gradient -phi / 2
    assert loss.item() == pytest.approx((-0.25 * math.log(0.5) - 0.09 * math.log(0.9)) / 2, abs=1e-6)
    loss.backward()
    assert close(lp.grad, [[-0.125, -0.045]])
    lp = torch.log(p).requires_grad_()
    loss, _ = sft_loss.compute_phi(lp, b, sft_loss.PhiConfig(cutoff_prob=0.8), "token-mean")
    # p = 0.9 > 0.8: log p clamped to log 0.8 -> term -0.09 log 0.8 = 0.020083, no gradient
    assert loss.item() == pytest.approx((-0.25 * math.log(0.5) - 0.09 * math.log(0.8)) / 2, abs=1e-6)
    loss.backward()
    assert close(lp.grad, [[-0.125, 0.0]])


# --- DPO


def dpo_inputs():
    # pair 0: chosen sum -2 vs ref -3 -> +1 ; rejected sum -4 vs ref -3 -> -1 ; h0 = 0.1 * (1 - (-1)) = 0.2
    # pair 1: chosen (1 valid token) -1 vs ref -0.5 -> -0.5 ; rejected -2 vs -3 -> +1 ; h1 = 0.1 * (-1.5) = -0.15
    lp = torch.tensor([[-1.0, -1.0], [-2.0, -2.0], [-1.0, -9.0], [-1.0, -1.0]], requires_grad=True)
    b = {
        "ref_logprobs": torch.tensor([[-1.5, -1.5], [-1.5, -1.5], [-0.5, 0.0], [-1.5, -1.5]]),
        "response_mask": torch.tensor([[1, 1], [1, 1], [1, 0], [1, 1]]),
    }
    return lp, b


def test_dpo_two_pairs_hand_computed():
    lp, b = dpo_inputs()
    loss, m = dpo.compute(lp, b, dpo.Config(), "seq-mean-token-sum")  # loss_agg_mode ignored
    # -logsigmoid(0.2) = log(1 + e^-0.2) = 0.598139 ; -logsigmoid(-0.15) = log(1 + e^0.15) = 0.770957
    assert loss.item() == pytest.approx((0.598139 + 0.770957) / 2, abs=1e-5)
    assert m["chosen_reward"] == pytest.approx(0.1 * (1 - 0.5) / 2)  # 0.025
    assert m["rejected_reward"] == pytest.approx(0.0, abs=1e-7)  # 0.1 * (-1 + 1) / 2
    assert m["accuracy_mean"] == 0.5 and m["reward_margin"] == pytest.approx((0.2 - 0.15) / 2)
    loss.backward()
    # dL/dh0 = -sigmoid(-0.2) = -0.450166; / 2 pairs * beta 0.1 -> chosen tokens -0.0225083, rejected +
    g0 = 1 / (1 + math.exp(0.2)) * 0.1 / 2
    assert lp.grad[0].tolist() == pytest.approx([-g0, -g0], abs=1e-6) and lp.grad[1].tolist() == pytest.approx(
        [g0, g0], abs=1e-6
    )
    assert lp.grad[2, 1].item() == 0.0  # padding
    # Trinity's micro-batch sum would give one h = 0.1 * ((1 - 0.5) - (-1 + 1)) = 0.05: log(1 + e^-0.05) = 0.668
    assert loss.item() != pytest.approx(math.log(1 + math.exp(-0.05)), abs=1e-3)


def test_dpo_label_smoothing_and_odd_batch():
    lp, b = dpo_inputs()
    loss, _ = dpo.compute(lp, b, dpo.Config(label_smoothing=0.1), "token-mean")
    # -logsigmoid(-h) = -logsigmoid(h) + h: pair 0: 0.9 * 0.598139 + 0.1 * 0.798139 = 0.618139
    # pair 1: 0.9 * 0.770957 + 0.1 * 0.620957 = 0.755957 ; mean 0.687048
    assert loss.item() == pytest.approx((0.618139 + 0.755957) / 2, abs=1e-5)
    with pytest.raises(ValueError, match="even B"):
        dpo.compute(lp[:3], {k: v[:3] for k, v in b.items()}, dpo.Config(), "token-mean")


# --- MIX


def mix_inputs(expert_rows):
    lp = torch.log(torch.tensor([[1.1, 1.1], [0.5, 0.2]])).requires_grad_()
    b = {
        "old_logprobs": torch.zeros(2, 2),
        "advantages": torch.tensor([[1.0, 1.0], [-2.0, 3.0]]),
        "response_mask": torch.ones(2, 2),
        "expert_mask": torch.tensor([[float(r in expert_rows)] * 2 for r in range(2)]),
    }
    return lp, b


def test_mix_hand_computed():
    lp, b = mix_inputs({1})
    loss, m = mix.compute(lp, b, mix.Config(), "token-mean")
    # RL row 0: r = 1.1, A = 1 -> PPO -1.1 ; expert row 1: NLL mean(-log 0.5, -log 0.2) = (0.693147 + 1.609438) / 2
    sft = (math.log(2) + math.log(5)) / 2
    assert loss.item() == pytest.approx(0.9 * -1.1 + 0.1 * sft, abs=1e-6)
    assert m["usual/pg_loss"] == pytest.approx(-1.1) and m["expert/sft_loss"] == pytest.approx(sft) and m["mu"] == 0.1


@pytest.mark.parametrize("mode", AGG_MODES)
def test_mix_reduces_to_ppo_and_to_sft(mode):
    lp, b = mix_inputs(set())  # no expert rows: (1 - mu) * PPO
    loss, m = mix.compute(lp, b, mix.Config(), mode)
    lp_ref = lp.detach().clone().requires_grad_()
    ref, _ = ppo_loss.compute(lp_ref, b, ppo_loss.Config(), mode)
    assert loss.item() == pytest.approx(0.9 * ref.item(), abs=1e-6) and m["expert/sft_loss"] == 0.0
    loss.backward(), ref.backward()
    assert torch.allclose(lp.grad, 0.9 * lp_ref.grad, atol=1e-7)
    lp, b = mix_inputs({0, 1})  # all expert: mu * SFT, advantages / old_logprobs unused
    loss, m = mix.compute(lp, b, mix.Config(mu=0.3), mode)
    ref, _ = sft_loss.compute(lp, b, sft_loss.Config(), mode)
    assert loss.item() == pytest.approx(0.3 * ref.item(), abs=1e-6) and m["usual/pg_loss"] == 0.0


def test_mix_chord_mu_schedule_hand_computed():
    # W = 2 warm-up steps to 0.5, then a cosine over D = 4 steps to 0.1: 0.1 + 0.4 (1 + cos(pi k / 4)) / 2
    cfg = mix_chord.Config(mu_warmup_steps=2, mu_decay_steps=4, mu_peak=0.5, mu_valley=0.1)
    expected = [0.0, 0.25, 0.5, 0.1 + 0.2 * (1 + math.sqrt(0.5)), 0.3, 0.1 + 0.2 * (1 - math.sqrt(0.5)), 0.1, 0.1]
    assert [mix_chord.mu_at(s, cfg) for s in range(8)] == pytest.approx(expected)
    assert mix_chord.mu_at(5, mix_chord.Config()) == 0.1  # Trinity's defaults: a constant 0.1
    assert mix_chord.mu_at(0, mix_chord.Config(mu_decay_steps=2, mu_peak=0.3, mu_valley=0.0)) == pytest.approx(0.3)


def test_mix_chord_hand_computed():
    lp, b = mix_inputs({1})
    cfg = mix_chord.Config(mu_warmup_steps=2, mu_decay_steps=4, mu_peak=0.5, mu_valley=0.1)
    loss, m = mix_chord.compute(lp, b | {"step": torch.full((2,), 4)}, cfg, "token-mean")  # mu(4) = 0.3
    # RL row 0: r = 1.1, A = 1 -> PPO -1.1 ; expert row 1: p = (0.5, 0.2), phi = p (1 - p) = (0.25, 0.16),
    # SFT_phi = mean(0.25 log 2, 0.16 log 5)
    phi_sft = (0.25 * math.log(2) + 0.16 * math.log(5)) / 2
    assert loss.item() == pytest.approx(0.7 * -1.1 + 0.3 * phi_sft, abs=1e-6)
    assert m["mu"] == pytest.approx(0.3) and m["expert/sft_phi_loss"] == pytest.approx(phi_sft)
    loss.backward()
    # expert tokens: d/dlogp = -0.3 phi / 2 (phi is not differentiated); RL row 0: -(1 - mu) A r / 2 at r = 1.1
    assert close(lp.grad, [[-0.7 * 1.1 / 2, -0.7 * 1.1 / 2], [-0.3 * 0.25 / 2, -0.3 * 0.16 / 2]])


@pytest.mark.parametrize("mode", AGG_MODES)
def test_mix_chord_without_phi_is_mix_at_its_mu(mode):
    cfg = mix_chord.Config(mu_peak=0.4, mu_valley=0.4, enable_phi_function=False)
    lp, b = mix_inputs({1})
    loss, m = mix_chord.compute(lp, b | {"step": torch.full((2,), 9)}, cfg, mode)
    ref, rm = mix.compute(lp, b, mix.Config(mu=0.4), mode)
    assert loss.item() == pytest.approx(ref.item(), abs=1e-7) and m == rm


def test_mix_chord_needs_one_step_per_batch():
    lp, b = mix_inputs({1})
    with pytest.raises(BatchError, match="needs batch\\['step'\\]"):
        mix_chord.compute(lp, b, mix_chord.Config(), "token-mean")
    with pytest.raises(BatchError, match="one value for the whole batch"):
        mix_chord.compute(lp, b | {"step": torch.tensor([1, 2])}, mix_chord.Config(), "token-mean")


def test_entropy_mix_skips_expert_rows():
    ent = torch.tensor([[1.0, 2.0], [30.0, 40.0]])
    b = {"response_mask": torch.ones(2, 2), "expert_mask": torch.tensor([[0.0, 0.0], [1.0, 1.0]])}
    loss, m = entropy.mix(ent, b, entropy.Config(entropy_coef=0.1), "token-mean")
    assert m["entropy_loss"] == pytest.approx(1.5) and loss.item() == pytest.approx(-0.15)  # row 0 only
    assert ENTROPY_LOSS_FNS["mix"][0] is entropy.mix


# --- at ratio 1 (logprobs == old_logprobs) the gradient is REINFORCE's -A * grad logp (aggregated)

# name -> gradient scale; gspo always aggregates with seq-mean-token-mean. Holds by the math:
# ppo/gspo/importance_sampling: d r / d logp = r = 1 and no clip is active at r = 1; cispo/topr: weight
# clip(1) = 1; sapo: f'(1) * 1 = 4 sigmoid(0)(1 - sigmoid(0)) = 1; sppo/rec: r = 1 is in every band
# (rec defaults: weight none, no regulariser; k2's gradient 2c (logp - old) is 0 there too); opmd: scaled
# by 1 / (1 + tau) = 1/2; mix without expert rows: scaled by 1 - mu = 0.9.
AT_RATIO_ONE = {
    "ppo": 1.0,
    "gspo": 1.0,
    "cispo": 1.0,
    "sapo": 1.0,
    "topr": 1.0,
    "sppo": 1.0,
    "rec": 1.0,
    "opmd": 0.5,
    "importance_sampling": 1.0,
    "mix": 0.9,
    "mix_chord": 0.9,  # mu = mu_valley = 0.1 (no warm-up, no decay)
}
# Does not hold: sft, sft_is, sft_phi (ignore A: -w grad logp whatever A is), dpo (a preference loss over
# (chosen, rejected) pairs against ref_logprobs, no advantage), rec with weight "advantage" (A exp(A/temp))
# or the forward-kl regulariser (adds -coef grad logp).
NOT_AT_RATIO_ONE = {"sft", "sft_is", "sft_phi", "dpo"}


def test_ratio_one_table_covers_registry():
    assert set(AT_RATIO_ONE) | NOT_AT_RATIO_ONE == set(POLICY_LOSS_FNS)
    assert not set(AT_RATIO_ONE) & NOT_AT_RATIO_ONE


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("name", sorted(AT_RATIO_ONE))
def test_at_ratio_one_gradient_is_reinforce(name, mode):
    g = torch.Generator().manual_seed(3)
    old = -torch.rand(4, 5, generator=g)
    b = {
        "old_logprobs": old,
        "ref_logprobs": old - 0.1,
        "advantages": torch.randn(4, 5, generator=g),
        "response_mask": torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0]]),
        "expert_mask": torch.zeros(4, 5),
        "step": torch.full((4,), 7),
    }
    fn, cfg_cls = POLICY_LOSS_FNS[name]
    lp = old.clone().requires_grad_()
    fn(lp, b, cfg_cls(), mode)[0].backward()
    lp_ref = old.clone().requires_grad_()
    agg = "seq-mean-token-mean" if name == "gspo" else mode
    (AT_RATIO_ONE[name] * aggregate(-b["advantages"] * lp_ref, b["response_mask"], agg)).backward()
    assert torch.allclose(lp.grad, lp_ref.grad, atol=1e-6)
