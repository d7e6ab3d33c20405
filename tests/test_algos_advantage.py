"""algos/ advantage functions: hand-computed numbers for each, and masking / edge-case properties of every
registered one."""

import math

import pytest
import torch

from algos import (
    ADVANTAGE_FNS,
    asymre,
    gae,
    grpo,
    jsd,
    on_policy_distill,
    opmd,
    raft,
    reinforce,
    reinforceplusplus,
    rloo,
    step_wise_grpo,
)
from algos.utils import BatchError, group_mean, masked_whiten


def group_batch(rewards, groups, T=3, mask=None):
    B = len(rewards)
    return {
        "rewards": torch.tensor(rewards, dtype=torch.float32),
        "group_index": torch.tensor(groups),
        "response_mask": torch.ones(B, T) if mask is None else torch.tensor(mask, dtype=torch.float32),
    }


def test_group_mean():
    # group 0: [1, 3] -> 2 ; group 1: no member -> 0, count 0 ; group 2: [5] -> 5
    mean, count = group_mean(torch.tensor([1.0, 5.0, 3.0]), torch.tensor([0, 2, 0]))
    assert mean.tolist() == [2.0, 0.0, 5.0] and count.tolist() == [2.0, 0.0, 1.0]
    mean, count = group_mean(torch.zeros(0), torch.zeros(0, dtype=torch.long))
    assert mean.shape == (0,) and count.shape == (0,)


# --- GAE (ppo)


def test_gae_hand_computed_with_right_padding():
    # row 0: gamma 0.9, lam 0.8, r = [0, 0, 1], V = [0.5, 0.6, 0.7]
    #   t=2: delta = 1 + 0.9*0 - 0.7 = 0.3                      A2 = 0.3
    #   t=1: delta = 0 + 0.9*0.7 - 0.6 = 0.03                   A1 = 0.03 + 0.72*0.3 = 0.246
    #   t=0: delta = 0 + 0.9*0.6 - 0.5 = 0.04                   A0 = 0.04 + 0.72*0.246 = 0.21712
    #   returns = A + V = [0.71712, 0.846, 1.0]
    # row 1 (right-padded, mask [1,0,0]): r = [2, 0, 0], V = [0.5, 9, 9] -> padding values masked to 0
    #   t=2, t=1: delta = 0, A = 0 ;  t=0: delta = 2 + 0.9*0 - 0.5 = 1.5, A0 = 1.5 ; returns [2, 0, 0]
    batch = {
        "token_level_rewards": torch.tensor([[0.0, 0.0, 1.0], [2.0, 0.0, 0.0]]),
        "values": torch.tensor([[0.5, 0.6, 0.7], [0.5, 9.0, 9.0]]),
        "response_mask": torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool),
        "rewards": torch.tensor([1.0, 2.0]),
    }
    out, metrics = gae.compute(batch, gae.Config(gamma=0.9, lam=0.8))
    assert out["returns"].tolist() == [pytest.approx([0.71712, 0.846, 1.0], abs=1e-6), pytest.approx([2.0, 0.0, 0.0])]
    raw = torch.tensor([[0.21712, 0.246, 0.3], [1.5, 0.0, 0.0]])  # A before whitening (hand values above)
    assert torch.allclose(out["advantages"], masked_whiten(raw, batch["response_mask"]), atol=1e-5)
    assert out["advantages"][1, 1:].tolist() == [0.0, 0.0]
    assert metrics["reward_mean"] == pytest.approx(1.5)
    assert metrics["values/mean"] == pytest.approx((0.5 + 0.6 + 0.7 + 0.5) / 4)


def test_gae_gamma_lam_one_is_return_to_go():
    # gamma = lam = 1: returns_t = A_t + V_t = sum_{s>=t} r_s, whatever V is: r = [1, -1, 3] -> [3, 2, 3]
    batch = {
        "token_level_rewards": torch.tensor([[1.0, -1.0, 3.0]]),
        "values": torch.tensor([[0.3, -2.0, 5.0]]),
        "response_mask": torch.ones(1, 3),
        "rewards": torch.tensor([3.0]),
    }
    out, _ = gae.compute(batch, gae.Config())
    assert out["returns"][0].tolist() == pytest.approx([3.0, 2.0, 3.0])


def test_gae_mask_inside_response():
    # tool output at t=1 (mask [1,0,1]): r = [0, 0, 1], V = [0.5, 9, 0.7] -> V masked to [0.5, 0, 0.7]
    #   t=2: A = 1 - 0.7 = 0.3 ; t=1: delta = 0 + 0.7 - 0 = 0.7, A = 1.0 ; t=0: delta = 0 + 0 - 0.5, A = 0.5
    # with gamma = lam = 1 this is the same as skipping the tool token: A0 = (0 + 1) - 0.5
    batch = {
        "token_level_rewards": torch.tensor([[0.0, 0.0, 1.0]]),
        "values": torch.tensor([[0.5, 9.0, 0.7]]),
        "response_mask": torch.tensor([[1.0, 0.0, 1.0]]),
        "rewards": torch.tensor([1.0]),
    }
    out, _ = gae.compute(batch, gae.Config())
    assert out["returns"][0].tolist() == pytest.approx([1.0, 0.0, 1.0])
    raw = torch.tensor([[0.5, 0.0, 0.3]])
    assert torch.allclose(out["advantages"], masked_whiten(raw, batch["response_mask"]), atol=1e-6)


# --- REINFORCE++


def test_reinforceplusplus_hand_computed():
    # row 0: gamma 1, r = [0, -0.1, 1] -> G = [0.9, 0.9, 1.0] ; row 1 (mask [1,0,0]): r = [0.5, 0, 0] -> G = [0.5, 0, 0]
    # valid G = [0.9, 0.9, 1.0, 0.5]: mean 0.825, squared deviations sum 0.1475, unbiased var 0.1475/3
    batch = {
        "token_level_rewards": torch.tensor([[0.0, -0.1, 1.0], [0.5, 0.0, 0.0]]),
        "response_mask": torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]),
        "rewards": torch.tensor([0.9, 0.5]),
    }
    out, metrics = reinforceplusplus.compute(batch, reinforceplusplus.Config())
    assert out["returns"].tolist() == [pytest.approx([0.9, 0.9, 1.0]), pytest.approx([0.5, 0.0, 0.0])]
    std = math.sqrt(0.1475 / 3 + 1e-8)
    expected = [[(g - 0.825) / std for g in (0.9, 0.9, 1.0)], [(0.5 - 0.825) / std, 0.0, 0.0]]
    assert out["advantages"].tolist() == [pytest.approx(expected[0], abs=1e-5), pytest.approx(expected[1], abs=1e-5)]
    assert metrics["returns/mean"] == pytest.approx(0.825)


def test_reinforceplusplus_discount_and_mask_reset():
    # gamma 0.5, r = [0, 0, 1] -> G = [0.25, 0.5, 1]
    b = {
        "token_level_rewards": torch.tensor([[0.0, 0.0, 1.0]]),
        "response_mask": torch.ones(1, 3),
        "rewards": torch.ones(1),
    }
    assert reinforceplusplus.compute(b, reinforceplusplus.Config(gamma=0.5))[0]["returns"][0].tolist() == [
        0.25,
        0.5,
        1.0,
    ]
    # veRL's reset: a masked token inside the response (mask [1,0,1]) zeroes the running return,
    # so token 0 does not see the reward at token 2: G = [0, (masked) 0, 1]
    b["response_mask"] = torch.tensor([[1.0, 0.0, 1.0]])
    assert reinforceplusplus.compute(b, reinforceplusplus.Config())[0]["returns"][0].tolist() == [0.0, 0.0, 1.0]


# --- group baselines: reinforce, rloo, opmd, asymre, grpo std_cal_level


def test_reinforce_is_raw_reward():
    # A = r: rewards [1, 0, 0.5] on every valid token
    out, metrics = reinforce.compute(
        group_batch([1.0, 0.0, 0.5], [0, 0, 1], mask=[[1, 1, 0], [1, 1, 1], [1, 0, 0]]), reinforce.Config()
    )
    assert out["advantages"].tolist() == [[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.5, 0.0, 0.0]]
    assert metrics == {"reward_mean": pytest.approx(0.5)}


def test_rloo_leave_one_out_and_singleton():
    # group 0: [1, 0, 0] mean 1/3 -> 3/2 * (r - 1/3) = [1, -0.5, -0.5]  (= r - mean of the other two)
    # group 1: [2] singleton -> A = r = 2
    # group 2: [3, 1] -> 2 * (r - 2) = [2, -2]  (3 - 1, 1 - 3)
    out, _ = rloo.compute(group_batch([1.0, 0.0, 2.0, 3.0, 0.0, 1.0], [0, 0, 1, 2, 0, 2]), rloo.Config())
    assert out["advantages"][:, 0].tolist() == pytest.approx([1.0, -0.5, 2.0, 2.0, -0.5, -2.0])
    assert torch.equal(out["returns"], out["advantages"])


def test_opmd_baselines():
    # mean: rewards [1, 0] -> b = 0.5, A = [0.5, -0.5]; group 1 singleton [0.7] -> b = 0, A = 0.7
    batch = group_batch([1.0, 0.0, 0.7], [0, 0, 1])
    out, metrics = opmd.advantage(batch, opmd.AdvantageConfig())
    assert out["advantages"][:, 0].tolist() == pytest.approx([0.5, -0.5, 0.7])
    assert metrics["group_baseline"] == pytest.approx(0.25)  # mean of b over the groups: (0.5 + 0) / 2
    # logavgexp, tau 1: b = log((e^1 + e^0) / 2) = log(1.859141) = 0.620115
    b = math.log((math.e + 1) / 2)
    out, _ = opmd.advantage(batch, opmd.AdvantageConfig(opmd_baseline="logavgexp"))
    assert out["advantages"][:, 0].tolist() == pytest.approx([1 - b, -b, 0.7], abs=1e-6)
    # tau 0.5: b = 0.5 * log((e^2 + 1) / 2) = 0.716894 (closer to the max 1 than tau 1)
    b = 0.5 * math.log((math.e**2 + 1) / 2)
    out, _ = opmd.advantage(batch, opmd.AdvantageConfig(opmd_baseline="logavgexp", tau=0.5))
    assert out["advantages"][:2, 0].tolist() == pytest.approx([1 - b, -b], abs=1e-6)
    # large rewards stay finite (the group max is subtracted before exp): [1000, 999] -> b = 999 + log((e + 1) / 2)
    out, _ = opmd.advantage(group_batch([1000.0, 999.0], [0, 0]), opmd.AdvantageConfig(opmd_baseline="logavgexp"))
    assert out["advantages"][:, 0].tolist() == pytest.approx(
        [1 - math.log((math.e + 1) / 2), -math.log((math.e + 1) / 2)], abs=1e-4
    )
    with pytest.raises(ValueError, match="opmd_baseline"):
        opmd.advantage(batch, opmd.AdvantageConfig(opmd_baseline="max"))


def test_asymre_shifted_baseline():
    # group 0: [1, 0] -> b = 0.5 + (-0.1) = 0.4, A = [0.6, -0.4]; group 1 singleton [0.7] -> b = 0, A = 0.7
    out, metrics = asymre.compute(group_batch([1.0, 0.0, 0.7], [0, 0, 1]), asymre.Config())
    assert out["advantages"][:, 0].tolist() == pytest.approx([0.6, -0.4, 0.7])
    assert metrics["group_baseline"] == pytest.approx(0.2)  # (0.4 + 0) / 2
    out, _ = asymre.compute(group_batch([1.0, 0.0], [0, 0]), asymre.Config(baseline_shift=0.0))  # shift 0: A = r - mean
    assert out["advantages"][:, 0].tolist() == pytest.approx([0.5, -0.5])


def test_grpo_batch_std():
    # group 0: [1, 0] mean 0.5 ; group 1: [3, 1] mean 2
    # batch std of [1, 0, 3, 1]: mean 1.25, squared deviations 0.0625 + 1.5625 + 3.0625 + 0.0625 = 4.75, /3 -> 1.258306
    cfg = grpo.Config(std_cal_level="batch")
    out, _ = grpo.compute(group_batch([1.0, 3.0, 0.0, 1.0], [0, 1, 0, 1]), cfg)
    s = math.sqrt(4.75 / 3) + 1e-6
    assert out["advantages"][:, 0].tolist() == pytest.approx([0.5 / s, 1.0 / s, -0.5 / s, -1.0 / s], abs=1e-6)
    # singleton group 1 [2]: mean 0, divided by the batch std of [1, 0, 2] = 1 -> A = [0.5, -0.5, 2]
    out, _ = grpo.compute(group_batch([1.0, 0.0, 2.0], [0, 0, 1]), cfg)
    assert out["advantages"][:, 0].tolist() == pytest.approx([0.5, -0.5, 2.0], abs=1e-5)
    # a batch of one reward: batch std 1 (Trinity)
    out, _ = grpo.compute(group_batch([0.3], [0]), cfg)
    assert out["advantages"][0, 0].item() == pytest.approx(0.3, abs=1e-6)
    with pytest.raises(ValueError, match="std_cal_level"):
        grpo.compute(group_batch([1.0], [0]), grpo.Config(std_cal_level="global"))


def test_step_wise_grpo_normalises_over_episodes_and_gives_each_turn_its_episodes_advantage():
    # group 0: episode A (2 turns, reward 1) rows 0-1, B (1 turn, 0) row 2; group 1: C (1 turn, 2) row 3,
    # D (3 turns, 0) rows 4-6. Per group over EPISODES: [1, 0] and [2, 0] -> mean 0.5 / 1, unbiased std 0.7071 / 1.4142
    # -> A = +-0.7071 in both groups, whatever the number of turns (per-row GRPO would weigh A twice and D 3 times)
    batch = {
        "rewards": torch.tensor([1.0, 1, 0, 2, 0, 0, 0]),
        "group_index": torch.tensor([0, 0, 0, 1, 1, 1, 1]),
        "episode_index": torch.tensor([0, 0, 1, 2, 3, 3, 3]),
        "response_mask": torch.ones(7, 2, dtype=torch.bool),
    }
    a = 1 / math.sqrt(2)
    out, metrics = step_wise_grpo.compute(batch, step_wise_grpo.Config())
    assert out["advantages"][:, 0].tolist() == pytest.approx([a, a, -a, a, -a, -a, -a], abs=1e-5)
    assert out["advantages"][:, 1].tolist() == out["advantages"][:, 0].tolist() and out["keep"].all()
    assert (metrics["experience_count"], metrics["episode_count"]) == (7, 4)
    out, _ = step_wise_grpo.compute(batch, step_wise_grpo.Config(enable_step_norm=True))  # A_e / S_e
    assert out["advantages"][:, 0].tolist() == pytest.approx([a / 2, a / 2, -a, a, -a / 3, -a / 3, -a / 3], abs=1e-5)
    per_row, _ = grpo.compute(batch, grpo.Config())
    assert per_row["advantages"][0, 0].item() != pytest.approx(a, abs=1e-3)  # what counting turns would give


# --- properties of every registered advantage fn


def full_batch(mask, groups, seed=0):
    """Every key an advantage fn may read, consistent with the trainer's contract (reward on the last valid token)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.as_tensor(mask, dtype=torch.bool)
    B, T = mask.shape
    rewards = torch.randn(B, generator=g)
    last = (mask.float() * torch.arange(1, T + 1)).argmax(-1)
    token_rewards = torch.zeros(B, T)
    token_rewards[torch.arange(B), last] = rewards
    token_rewards = token_rewards * mask - 0.01 * torch.rand(B, T, generator=g) * mask  # KL penalty on valid tokens
    return {
        "rewards": rewards,
        "token_level_rewards": token_rewards,
        "response_mask": mask,
        "values": torch.randn(B, T, generator=g) * 3,  # garbage on padding: must be masked
        "group_index": torch.as_tensor(groups, dtype=torch.long),
        "episode_index": torch.arange(B),  # single-turn rows: each its own episode
        "stored_advantages": torch.randn(B, T, generator=g),  # an explorer-side fn's (step_wise_grpo)
        "has_stored_advantages": torch.ones(B, dtype=torch.bool),
        # the student's and a teacher's log-probs (on-policy distillation), garbage on padding: must be masked
        "old_logprobs": -torch.rand(B, T, generator=g) * 3,
        "teacher_logprobs": torch.where(mask, -torch.rand(B, T, generator=g) * 3, torch.full((B, T), float("nan"))),
        "has_teacher_logprobs": torch.ones(B, dtype=torch.bool),
    }


EDGE_CASES = {
    "padded": ([[1, 1, 1, 0], [1, 0, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]], [0, 0, 1, 1]),
    "all_masked": ([[0, 0, 0, 0]] * 3, [0, 0, 1]),
    "singletons": ([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], [0, 1, 2]),
    "empty_group_id": ([[1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0]], [0, 2, 2]),  # id 1 has no member
    "one_row": ([[1, 1, 1, 0]], [0]),
    "empty_batch": (torch.zeros(0, 4), []),
}


@pytest.mark.parametrize("case", list(EDGE_CASES))
@pytest.mark.parametrize("name", list(ADVANTAGE_FNS))
def test_advantage_zero_on_padding_and_finite(name, case):
    fn, cfg_cls = ADVANTAGE_FNS[name]
    mask, groups = EDGE_CASES[case]
    batch = full_batch(mask, groups)
    out, metrics = fn(batch, cfg_cls())
    B, T = batch["response_mask"].shape
    for key in ("advantages", "returns"):
        assert out[key].shape == (B, T) and torch.isfinite(out[key]).all(), key
    pad = ~batch["response_mask"]
    assert out["advantages"][pad].abs().sum().item() == 0.0
    if "keep" in out:
        assert out["keep"].shape == (B,) and out["keep"].dtype == torch.bool
    assert all(math.isfinite(v) for v in metrics.values())
    assert set(metrics) == set(fn(full_batch(*EDGE_CASES["padded"], seed=1), cfg_cls())[1])  # same keys every call


# Advantage functions whose baseline is the group's own rewards: a tied group has nothing to learn from.
GROUP_BASELINED = ("grpo", "rloo", "opmd", "rec")


@pytest.mark.parametrize("name", GROUP_BASELINED)
def test_a_tied_group_gets_exactly_zero_advantage(name):
    # eight rewards of -0.1 (every episode truncated) once gave GRPO +0.0074 each: float32 sums one member at a time
    # put the mean 9e-9 off -0.1, the std came out ~8e-9, and (r - mean) / (std + 1e-6) was not 0
    fn, cfg_cls = ADVANTAGE_FNS[name]
    for size in (3, 5, 8, 16):
        for value in (-0.1, 0.3, 1 / 3, 0.7, 1.1):
            batch = group_batch([value] * (2 * size), [0] * size + [1] * size)
            out, _ = fn(batch, cfg_cls())
            assert out["advantages"].abs().max().item() == 0.0, (size, value)


# --- on-policy distillation (on_policy_distill, jsd) and RAFT's selection


def distill_batch(old, teacher, mask=None):
    old, teacher = torch.tensor(old), torch.tensor(teacher)
    return {
        "old_logprobs": old,
        "teacher_logprobs": teacher,
        "has_teacher_logprobs": torch.ones(len(old), dtype=torch.bool),
        "response_mask": torch.ones_like(old, dtype=torch.bool) if mask is None else torch.tensor(mask).bool(),
    }


def test_on_policy_distill_hand_computed():
    # row 0: student [-0.5, -1.0, -0.2], teacher [-0.7, -0.4, -0.2] -> A = 2 x [-0.2, 0.6, 0.0]
    # row 1: one valid token, student -2, teacher -1 -> A = 2 x 1; padding (garbage) -> 0
    b = distill_batch(
        [[-0.5, -1.0, -0.2], [-2.0, -9.0, 5.0]], [[-0.7, -0.4, -0.2], [-1.0, 7.0, -3.0]], [[1, 1, 1], [1, 0, 0]]
    )
    out, m = on_policy_distill.compute(b, on_policy_distill.Config(kl_coef=2.0))
    assert torch.allclose(out["advantages"], torch.tensor([[-0.4, 1.2, 0.0], [2.0, 0.0, 0.0]]), atol=1e-6)
    assert torch.equal(out["returns"], out["advantages"])
    # sequence reverse-KL estimates sum_t (student - teacher): 0.2 - 0.6 + 0 = -0.4 ; -1.0 -> mean -0.7, std (unbiased)
    assert m["kl/mean"] == pytest.approx(-0.7) and m["kl/std"] == pytest.approx(0.3 * math.sqrt(2), abs=1e-6)


def test_distillation_refuses_rows_without_teacher_logprobs():
    b = distill_batch([[-0.5, -1.0]], [[-0.7, -0.4]])
    for fn, cfg in ((on_policy_distill.compute, on_policy_distill.Config()), (jsd.compute, jsd.Config())):
        with pytest.raises(BatchError, match="1 of 1 have none: .*on_policy_distill_workflow"):
            fn(b | {"has_teacher_logprobs": torch.tensor([False])}, cfg)
        no_key = {k: v for k, v in b.items() if k != "teacher_logprobs"}
        with pytest.raises(BatchError, match="needs teacher log-probs"):
            fn(no_key, cfg)


def test_jsd_hand_computed():
    # one token: student p 0.2, teacher 0.6. beta 0.5: m = 0.4, j = 0.5 log(0.6/0.4) + 0.5 log(0.2/0.4) = -0.143841
    b = distill_batch([[math.log(0.2)]], [[math.log(0.6)]])
    out, m = jsd.compute(b, jsd.Config(estimator="trinity"))
    assert out["advantages"].item() == pytest.approx(0.143841, abs=1e-6) and m["jsd/mean"] == pytest.approx(-0.143841)
    out, m = jsd.compute(b, jsd.Config(kl_coef=2.0))  # the default, "gradient": 2 x (1 - 0.5) log(0.4 / 0.2)
    assert out["advantages"].item() == pytest.approx(math.log(2), abs=1e-6) and m["jsd/mean"] == pytest.approx(
        -0.143841
    )
    # beta 0 (Trinity: KL(student || teacher)): j = s - t = log(1/3), A = log 3 by either estimator
    for est in ("trinity", "gradient"):
        out, _ = jsd.compute(b, jsd.Config(lambda_coef=0.0, estimator=est))
        assert out["advantages"].item() == pytest.approx(math.log(3), abs=1e-6)
    # beta 1: Trinity's j = t - s, A = -log 3; the gradient estimator's forward-KL weight p_T / p_S = 3
    assert jsd.compute(b, jsd.Config(lambda_coef=1.0, estimator="trinity"))[0]["advantages"].item() == pytest.approx(
        -math.log(3)
    )
    assert jsd.compute(b, jsd.Config(lambda_coef=1.0))[0]["advantages"].item() == pytest.approx(3)
    # temperature 2 divides both log-probs (Trinity's): beta 0 -> (t - s) / 2
    assert jsd.compute(b, jsd.Config(lambda_coef=0.0, temperature=2.0))[0]["advantages"].item() == pytest.approx(
        math.log(3) / 2, abs=1e-6
    )
    with pytest.raises(ValueError, match="estimator must be"):
        jsd.compute(b, jsd.Config(estimator="exact"))


def divergence_gradient(beta: float, student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """d D_beta / d student logits, exactly (autograd over the whole vocabulary): D_0 = KL(S||T), D_1 = KL(T||S), else
    the generalised JSD with M = beta T + (1 - beta) S."""
    z = student.clone().requires_grad_()
    ls, lt = z.log_softmax(-1), teacher.log_softmax(-1)
    if beta == 0.0:
        d = (ls.exp() * (ls - lt)).sum()
    elif beta == 1.0:
        d = (lt.exp() * (lt - ls)).sum()
    else:
        lm = torch.logaddexp(ls + math.log(1 - beta), lt + math.log(beta))
        d = beta * (lt.exp() * (lt - lm)).sum() + (1 - beta) * (ls.exp() * (ls - lm)).sum()
    return torch.autograd.grad(d, z)[0]


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
def test_jsd_gradient_estimator_is_the_divergence_gradient_and_trinitys_is_not(beta):
    """E_{y ~ S}[A(y) grad log S(y)] (the policy gradient the advantages give, summed exactly over a vocabulary of 6)
    equals -grad D_beta for estimator "gradient"; Trinity's plug-in does not, with the opposite sign in places."""
    g = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(6, generator=g), torch.randn(6, generator=g) * 2
    ls, lt = student.log_softmax(-1), teacher.log_softmax(-1)
    p = ls.exp()
    expected = -divergence_gradient(beta, student, teacher)
    pg = {}
    for est in ("gradient", "trinity"):
        out, _ = jsd.compute(distill_batch(ls[:, None].tolist(), lt[:, None].tolist()), jsd.Config(beta, estimator=est))
        A = out["advantages"][:, 0]  # [V]: each token y as a one-token row
        pg[est] = (p[:, None] * A[:, None] * (torch.eye(6) - p[None, :])).sum(0)  # sum_y p(y) A(y) grad_z log p(y)
    assert torch.allclose(pg["gradient"], expected, atol=1e-6)
    if beta not in (0.0,):  # at beta 0 both are the reverse KL's t - s
        assert (pg["trinity"] * expected < 0).any()


def test_raft_keeps_each_groups_first_best_response():
    # group 0: rewards [0.1, 1.1, 1.1, -0.1] -> the first 1.1 ; group 1: a singleton ; group 2: [0.0, 0.5] -> 0.5
    b = group_batch([0.1, 1.1, 1.1, -0.1, 0.3, 0.0, 0.5], [0, 0, 0, 0, 1, 2, 2], T=2)
    b["response_mask"][6, 1] = 0
    out, m = raft.compute(b, raft.Config())
    assert out["keep"].tolist() == [False, True, False, False, True, False, True]
    assert out["advantages"].tolist() == [[0, 0], [1, 1], [0, 0], [0, 0], [1, 1], [0, 0], [1, 0]]
    assert m["kept_fraction"] == pytest.approx(3 / 7) and m["kept_reward_mean"] == pytest.approx((1.1 + 0.3 + 0.5) / 3)
    # reward_threshold 0.4: group 1's best (0.3) is not good enough
    out, m = raft.compute(b, raft.Config(reward_threshold=0.4))
    assert out["keep"].tolist() == [False, True, False, False, False, False, True]
    assert m["kept_reward_mean"] == pytest.approx(0.8) and m["reward_mean"] == pytest.approx(
        3.0 / 7
    )  # (0.1 + 1.1 + 1.1 - 0.1 + 0.3 + 0 + 0.5) / 7
