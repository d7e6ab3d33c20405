"""algos/: hand-computed numbers for every piece, registry-wide properties, their configs (configs.piece_config)."""

import math

import pytest
import torch

import algos
from algos import (
    ADVANTAGE_FNS,
    ENTROPY_LOSS_FNS,
    KL_FNS,
    POLICY_LOSS_FNS,
    correction,
    entropy,
    grpo,
    kl,
    overlong,
    ppo_loss,
    sample,
    sft_loss,
    value_loss,
)
from algos.utils import AGG_MODES, aggregate, masked_mean, masked_whiten
from configs import ConfigError, piece_config

# --- aggregation


def test_aggregate_modes_hand_computed():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, -100.0]])  # masked entries are 100 / -100
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    # token-mean: (1+2+3+4)/4 = 2.5
    assert aggregate(loss, mask, "token-mean").item() == pytest.approx(2.5)
    # seq-mean-token-mean: ((1+2+3)/3 + 4/1)/2 = (2+4)/2 = 3
    assert aggregate(loss, mask, "seq-mean-token-mean").item() == pytest.approx(3.0)
    # seq-mean-token-sum: ((1+2+3) + 4)/2 = 5
    assert aggregate(loss, mask, "seq-mean-token-sum").item() == pytest.approx(5.0)
    # seq-mean-token-sum-norm: mean over sequences of (token sum / T), T = mask.shape[-1] = 3: (6/3 + 4/3)/2 = 5/3
    assert aggregate(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx(5 / 3)
    with pytest.raises(ValueError, match="unknown loss_agg_mode"):
        aggregate(loss, mask, "token-sum")


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregate_empty_rows_are_finite(mode):
    loss = torch.tensor([[1.0, 2.0], [float("nan"), float("inf")]])
    mask = torch.tensor([[1, 1], [0, 0]])
    out = aggregate(loss, mask, mode)
    assert torch.isfinite(out)
    # an empty row changes nothing in the seq-mean modes (it is not counted) nor in the sums
    assert out.item() == pytest.approx(aggregate(loss[:1], mask[:1], mode).item())
    assert aggregate(loss, torch.zeros_like(mask), mode).item() == 0.0


def test_masked_helpers():
    x = torch.tensor([[1.0, 3.0, 99.0]])
    m = torch.tensor([[1, 1, 0]])
    assert masked_mean(x, m).item() == 2.0
    w = masked_whiten(x, m)  # mean 2, unbiased var 2 -> (+-1)/sqrt(2)
    assert w[0, :2].tolist() == pytest.approx([-1 / math.sqrt(2), 1 / math.sqrt(2)], abs=1e-6)
    assert w[0, 2].item() == 0.0


# --- GRPO


def grpo_batch(rewards, groups, T=3, mask=None):
    B = len(rewards)
    return {
        "rewards": torch.tensor(rewards, dtype=torch.float32),
        "group_index": torch.tensor(groups),
        "response_mask": torch.ones(B, T) if mask is None else torch.tensor(mask, dtype=torch.float32),
    }


def test_grpo_unbiased_std():
    mask = [[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]]
    out, metrics = grpo.compute(grpo_batch([1.0, 0.0, 0.0, 1.0], [0, 0, 0, 0], mask=mask), grpo.Config())
    # mean 0.5, torch.std (unbiased) = sqrt(4 * 0.25 / 3) = 0.5774 -> +-0.5 / 0.5774 = +-0.8660
    a = 0.5 / math.sqrt(1 / 3)
    expected = torch.tensor([[a, a, 0], [-a, 0, 0], [-a, -a, -a], [a, a, 0]])
    assert torch.allclose(out["advantages"], expected, atol=1e-5)
    assert torch.equal(out["returns"], out["advantages"])
    assert metrics["filtered_count"] == 0.0


def test_grpo_no_std_and_two_groups():
    cfg = grpo.Config(norm_adv_by_std_in_grpo=False)
    # group 0: [1,0] mean 0.5 -> +-0.5 ; group 1: [3,1] mean 2 -> +-1 (Dr.GRPO: no std division)
    out, _ = grpo.compute(grpo_batch([1.0, 3.0, 0.0, 1.0], [0, 1, 0, 1]), cfg)
    assert out["advantages"][:, 0].tolist() == pytest.approx([0.5, 1.0, -0.5, -1.0])


def test_grpo_singleton_group_is_raw_reward():
    # group 1 has one member: baseline 0, std 1 -> A = 0.7 / (1 + 1e-6)
    out, _ = grpo.compute(grpo_batch([1.0, 0.0, 0.7], [0, 0, 1]), grpo.Config())
    assert out["advantages"][2].tolist() == pytest.approx([0.7] * 3, abs=1e-5)
    assert out["keep"].all()


def test_grpo_std_threshold_filters_groups():
    # group 0: [1,0] std 0.707 kept; group 1: [2,2] std 0 <= 0.1 dropped; group 2: singleton dropped
    out, metrics = grpo.compute(grpo_batch([1.0, 0.0, 2.0, 2.0, 5.0], [0, 0, 1, 1, 2]), grpo.Config(std_threshold=0.1))
    assert out["keep"].tolist() == [True, True, False, False, False]
    assert metrics["filtered_count"] == 3.0
    assert out["advantages"][2:].abs().sum().item() == 0.0
    a = 0.5 / math.sqrt(0.5)  # unbiased std of [1,0] = sqrt(0.5)
    assert out["advantages"][:2, 0].tolist() == pytest.approx([a, -a], abs=1e-5)


# --- PPO


def test_ppo_hand_computed_clip_and_dual_clip():
    # ratios 1.1 (inside), 1.5 (A>0: clipped to 1.2), 5.0 (A<0: dual clip at c=3)
    logprobs = torch.log(torch.tensor([[1.1, 1.5, 5.0]]))
    batch = {
        "old_logprobs": torch.zeros(1, 3),
        "advantages": torch.tensor([[1.0, 1.0, -1.0]]),
        "response_mask": torch.ones(1, 3),
    }
    loss, m = ppo_loss.compute(logprobs, batch, ppo_loss.Config(), "token-mean")
    # token losses: max(-1.1,-1.1) = -1.1 ; max(-1.5,-1.2) = -1.2 ; min(max(5.0,1.2), 3.0) = 3.0
    assert loss.item() == pytest.approx((-1.1 - 1.2 + 3.0) / 3, abs=1e-6)
    assert m["pg_loss"] == pytest.approx(loss.item())
    assert m["pg_clipfrac"] == pytest.approx(1 / 3)  # token 1 only
    assert m["pg_clipfrac_lower"] == pytest.approx(1 / 3)  # token 2 only
    assert m["ppo_kl"] == pytest.approx(-math.log(1.1 * 1.5 * 5.0) / 3, abs=1e-6)  # mean(old - new)


def test_ppo_asymmetric_clip():
    # eps_low 0.2, eps_high 0.28: r=1.5, A=1 -> -1.28 ; r=0.5, A=-1 -> max(0.5, 0.8) = 0.8
    logprobs = torch.log(torch.tensor([[1.5, 0.5]]))
    batch = {
        "old_logprobs": torch.zeros(1, 2),
        "advantages": torch.tensor([[1.0, -1.0]]),
        "response_mask": torch.ones(1, 2),
    }
    cfg = ppo_loss.Config(clip_range_high=0.28)
    loss, m = ppo_loss.compute(logprobs, batch, cfg, "seq-mean-token-sum")
    assert loss.item() == pytest.approx(-1.28 + 0.8, abs=1e-6)  # one sequence: token sum
    assert m["pg_clipfrac"] == 1.0 and m["pg_clipfrac_lower"] == 0.0


def test_sft_is_mean_nll():
    logprobs = torch.tensor([[-1.0, -2.0, -30.0]])
    loss, m = sft_loss.compute(logprobs, {"response_mask": torch.tensor([[1, 1, 0]])}, sft_loss.Config(), "token-mean")
    assert loss.item() == pytest.approx(1.5) and m["sft_loss"] == pytest.approx(1.5)  # (1+2)/2


# --- KL and entropy


def test_kl_estimators_hand_computed():
    logp = torch.tensor([[0.0, -1.0, -30.0]])
    ref = torch.tensor([[-1.0, 0.0, 0.0]])  # d = logp - ref = [1, -1, -30]
    e1, e = math.exp(-1), math.e
    assert kl.estimate(logp, ref, "k1").tolist() == [[1.0, -1.0, -30.0]]
    assert kl.estimate(logp, ref, "k2").tolist() == [[0.5, 0.5, 450.0]]  # d^2/2
    assert kl.estimate(logp, ref, "abs").tolist() == [[1.0, 1.0, 30.0]]
    assert kl.estimate(logp, ref, "none").tolist() == [[0.0, 0.0, 0.0]]
    k3 = kl.estimate(logp, ref, "k3")[0]  # exp(-d) - 1 + d: e^-1 - 1 + 1 ; e - 1 - 1 ; e^30 - 31
    assert k3[:2].tolist() == pytest.approx([e1, e - 2], abs=1e-6)
    assert k3[2].item() == pytest.approx(math.exp(30) - 31, rel=1e-4)
    lv = kl.estimate(logp, ref, "low_var_kl")[0]  # same as k3, but clamped to 10
    assert lv.tolist() == pytest.approx([e1, e - 2, 10.0], abs=1e-6)


def test_kl_loss_and_penalty():
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    batch = {
        "ref_logprobs": torch.tensor([[-1.0, 0.0, 5.0]]),
        "old_logprobs": torch.zeros(1, 3),
        "rewards": torch.tensor([1.0]),
        "response_mask": mask,
    }
    # loss: k2 of d = [1, 0] -> [0.5, 0] -> token-mean 0.25 -> x beta 0.1 = 0.025
    loss, m = kl.loss(torch.zeros(1, 3), batch, kl.Config(kl_coef=0.1), "token-mean", kind="k2")
    assert loss.item() == pytest.approx(0.025) and m["kl_loss"] == pytest.approx(0.25)
    # penalty: k1 = [1, 0, (masked)]; reward 1 on the last valid token (t=1) -> [0 - 0.1, 1 - 0, 0]
    rewards, m = kl.penalty(batch, kl.Config(kl_coef=0.1), kind="k1")
    assert rewards[0].tolist() == pytest.approx([-0.1, 1.0, 0.0])
    assert m["kl"] == pytest.approx(0.5)


def test_entropy_loss():
    ent = torch.tensor([[1.0, 2.0, 3.0]])
    loss, m = entropy.loss(ent, {"response_mask": torch.ones(1, 3)}, entropy.Config(entropy_coef=0.01), "token-mean")
    assert loss.item() == pytest.approx(-0.02) and m["entropy_loss"] == pytest.approx(2.0)  # -0.01 * mean(1,2,3)
    loss, m = entropy.none(None, {}, entropy.Config(), "token-mean")
    assert loss.item() == 0.0 and m == {}


# --- properties over every registry entry

POLICY_METRICS = {
    "ppo": {"pg_loss", "pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"},
    "sft": {"sft_loss"},
    "gspo": {"pg_loss", "pg_clipfrac", "ppo_kl", "ppo_kl_seq"},
    "cispo": {"pg_loss", "pg_clipfrac", "ppo_kl"},
    "sapo": {"pg_loss", "avg_soft_gate", "avg_ratio", "pos_adv_frac"},
    "topr": {"pg_loss", "ppo_kl", "pg_clipfrac", "avg_alpha"},
    "sppo": {"pg_loss", "pg_clipfrac"},
    "rec": {"pg_loss", "pg_clipfrac"},
    "opmd": {"opmd_loss"},
    "importance_sampling": {"pg_loss", "ratio_mean", "approx_kl"},
    "sft_is": {"sft_is_loss"},
    "sft_phi": {"sft_phi_loss"},
    "dpo": {"dpo_loss", "chosen_reward", "rejected_reward", "accuracy_mean", "reward_margin"},
    "mix": {"usual/pg_loss", "usual/pg_clipfrac", "usual/ppo_kl", "usual/pg_clipfrac_lower", "expert/sft_loss", "mu"},
    "mix_chord": {
        "usual/pg_loss",
        "usual/pg_clipfrac",
        "usual/ppo_kl",
        "usual/pg_clipfrac_lower",
        "expert/sft_phi_loss",
        "mu",
    },
}
# zero advantage -> zero gradient (default configs; mix: random_batch has no expert rows). Not: sft, sft_is,
# sft_phi (no advantage), dpo (preference pairs, no advantage)
NEEDS_ADVANTAGE = {
    "ppo",
    "gspo",
    "cispo",
    "sapo",
    "topr",
    "sppo",
    "rec",
    "opmd",
    "importance_sampling",
    "mix",
    "mix_chord",
}
ENTROPY_METRICS = {"default": {"entropy_loss"}, "none": set(), "mix": {"entropy_loss"}}
POLICY_B = 4  # the policy-loss tests use 4 rows: dpo needs interleaved (chosen, rejected) pairs, B even


def random_batch(seed=0, B=3, T=5):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, T)
    mask[0, 3:] = 0
    mask[2, 1:] = 0
    return {
        "old_logprobs": -torch.rand(B, T, generator=g),
        "ref_logprobs": -torch.rand(B, T, generator=g),
        "advantages": torch.randn(B, T, generator=g),
        "response_mask": mask,
        "rewards": torch.rand(B, generator=g),
        "group_index": torch.arange(B) // 2,  # [0, 0, 1] for B = 3
        "episode_index": torch.arange(B),  # single-turn rows: each its own episode
        "expert_mask": torch.zeros(B, T),  # no expert SFT rows (mix)
        # an explorer-side advantage fn's (step_wise_grpo), as batching.step_batch lays them out
        "stored_advantages": torch.randn(B, T, generator=g),
        "has_stored_advantages": torch.ones(B, dtype=torch.bool),
        # a teacher's log-probs of the response tokens (on-policy distillation), as batching.step_batch lays them out
        "teacher_logprobs": -torch.rand(B, T, generator=g) * 2,
        "has_teacher_logprobs": torch.ones(B, dtype=torch.bool),
        "step": torch.full((B,), 3),  # the train step (mix_chord's mu schedule)
    }


def policy_terms():
    """(name, callable(logprobs, batch) -> (loss, metrics), expected metric keys) for every loss-like entry."""
    out = [
        (f"policy/{n}", lambda lp, b, f=f, c=c: f(lp, b, c(), "token-mean"), POLICY_METRICS[n])
        for n, (f, c) in POLICY_LOSS_FNS.items()
    ]
    out += [
        (f"kl/{n}", lambda lp, b, n=n: kl.loss(lp, b, kl.Config(), "token-mean", kind=n), {"kl_loss", "kl_coef"})
        for n in KL_FNS
    ]
    out += [
        (f"entropy/{n}", lambda lp, b, f=f, c=c: f(-lp, b, c(entropy_coef=0.1), "token-mean"), ENTROPY_METRICS[n])
        for n, (f, c) in ENTROPY_LOSS_FNS.items()
    ]  # -logprobs stands in for a per-token entropy
    return out


TERMS = policy_terms()


def test_registries_cover_expected_names():
    assert set(POLICY_LOSS_FNS) == set(POLICY_METRICS)
    assert set(ENTROPY_LOSS_FNS) == set(ENTROPY_METRICS)
    assert set(KL_FNS) == set(kl.KINDS)
    assert set(ADVANTAGE_FNS) == {
        "grpo",
        "ppo",
        "reinforceplusplus",
        "reinforce",
        "rloo",
        "opmd",
        "asymre",
        "rec",
        "step_wise_grpo",
        "raft",
        "on_policy_distill",
        "jsd",
    }


@pytest.mark.parametrize("name", list(POLICY_LOSS_FNS))
@pytest.mark.parametrize("mode", AGG_MODES)
def test_policy_loss_finite_and_metrics(name, mode):
    fn, cfg_cls = POLICY_LOSS_FNS[name]
    b = random_batch(B=POLICY_B)
    lp = (b["old_logprobs"] + 0.3 * torch.randn(POLICY_B, 5)).requires_grad_()
    loss, metrics = fn(lp, b, cfg_cls(), mode)
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert set(metrics) == POLICY_METRICS[name] and all(math.isfinite(v) for v in metrics.values())
    loss.backward()
    assert torch.isfinite(lp.grad).all()


@pytest.mark.parametrize("name", sorted(NEEDS_ADVANTAGE))
def test_zero_advantage_zero_gradient(name):
    fn, cfg_cls = POLICY_LOSS_FNS[name]
    b = random_batch(B=POLICY_B) | {"advantages": torch.zeros(POLICY_B, 5)}
    lp = (b["old_logprobs"] + 0.5 * torch.randn(POLICY_B, 5)).requires_grad_()
    fn(lp, b, cfg_cls(), "token-mean")[0].backward()
    assert lp.grad.abs().max().item() == 0.0


@pytest.mark.parametrize("name,term,keys", TERMS, ids=[t[0] for t in TERMS])
def test_masked_tokens_have_no_effect(name, term, keys):
    b1 = random_batch(B=POLICY_B)
    lp1 = b1["old_logprobs"] + 0.2
    pad = b1["response_mask"] == 0
    b2 = {k: v.clone() for k, v in b1.items()}
    for k in ("old_logprobs", "ref_logprobs", "advantages"):
        b2[k][pad] = torch.randn(int(pad.sum())) * 5
    lp2 = torch.where(pad, torch.randn(POLICY_B, 5) * 5 - 3, lp1)
    grads, losses = [], []
    for lp, b in ((lp1, b1), (lp2, b2)):
        lp = lp.clone().requires_grad_()
        loss, metrics = term(lp, b)
        assert set(metrics) == keys and all(math.isfinite(v) for v in metrics.values())
        assert loss.dim() == 0 and torch.isfinite(loss)
        losses.append(loss.item())
        if loss.requires_grad:
            loss.backward()
        grads.append(torch.zeros(POLICY_B, 5) if lp.grad is None else lp.grad)
    assert losses[0] == pytest.approx(losses[1], abs=1e-6)
    assert torch.allclose(grads[0], grads[1], atol=1e-7)
    assert grads[0][pad].abs().max().item() == 0.0


@pytest.mark.parametrize("mode", AGG_MODES)
def test_ppo_at_ratio_one_is_reinforce(mode):
    b = random_batch()
    lp = b["old_logprobs"].clone().requires_grad_()
    ppo_loss.compute(lp, b, ppo_loss.Config(), mode)[0].backward()
    lp_ref = b["old_logprobs"].clone().requires_grad_()
    aggregate(-b["advantages"] * lp_ref, b["response_mask"], mode).backward()  # REINFORCE: -A * logp
    assert torch.allclose(lp.grad, lp_ref.grad, atol=1e-6)


@pytest.mark.parametrize("name", list(ADVANTAGE_FNS))
def test_advantage_fns_finite_masked(name):
    fn, cfg_cls = ADVANTAGE_FNS[name]
    keys = []
    for seed in (0, 1):
        b = random_batch(seed)
        g = torch.Generator().manual_seed(seed + 10)
        # the trainer's extra keys: per-token rewards (0 on padding) and critic values (garbage on padding)
        b["token_level_rewards"] = torch.randn(3, 5, generator=g) * b["response_mask"]
        b["values"] = torch.randn(3, 5, generator=g)
        out, metrics = fn(b, cfg_cls())
        assert out["advantages"].shape == (3, 5) and torch.isfinite(out["advantages"]).all()
        assert out["advantages"][b["response_mask"] == 0].abs().sum().item() == 0.0
        assert all(math.isfinite(v) for v in metrics.values())
        keys.append(set(metrics))
    assert keys[0] == keys[1]  # the same metric keys every call


@pytest.mark.parametrize("name", list(KL_FNS))
def test_kl_fns_finite_and_penalty(name):
    fn, cfg_cls = KL_FNS[name]
    b = random_batch()
    est = fn(b["old_logprobs"], b["ref_logprobs"])
    assert est.shape == (3, 5) and torch.isfinite(est).all()
    assert fn(b["ref_logprobs"], b["ref_logprobs"]).abs().max().item() == 0.0  # KL(p||p) = 0
    rewards, metrics = kl.penalty(b, cfg_cls(), kind=name)
    assert torch.isfinite(rewards).all() and set(metrics) == {"kl", "kl_coef"}
    assert rewards[b["response_mask"] == 0].abs().sum().item() == 0.0


# --- piece configs (configs.piece_config)


@pytest.mark.parametrize("kind", list(algos.REGISTRIES))
def test_piece_config_defaults(kind):
    for name, (_, cfg_cls) in algos.REGISTRIES[kind].items():
        assert piece_config(kind, name, {}, f"algorithm.{kind}_args") == cfg_cls()
        assert piece_config(kind, name, None, f"algorithm.{kind}_args") == cfg_cls()


def test_lookup_gives_each_registered_function_and_refuses_unknown_names():
    for kind, registry in algos.REGISTRIES.items():
        for name, (fn, _) in registry.items():
            assert algos.lookup(kind, name) is fn
    with pytest.raises(KeyError, match="unknown policy_loss_fn 'ppx'; known: ppo"):
        algos.lookup("policy_loss_fn", "ppx")


def test_piece_config_values_and_errors():
    cfg = piece_config(
        "policy_loss_fn", "ppo", {"clip_range_high": "0.28", "clip_ratio_c": 4}, "algorithm.policy_loss_fn_args"
    )
    assert cfg.clip_range_high == pytest.approx(0.28) and cfg.clip_ratio_c == 4.0 and cfg.clip_range == 0.2
    assert piece_config("advantage_fn", "grpo", {"std_threshold": 0.0}, "a").std_threshold == 0.0
    with pytest.raises(
        ConfigError, match=r"^algorithm\.policy_loss_fn_args\.clip_rnage: unknown key; did you mean clip_range\?"
    ):
        piece_config("policy_loss_fn", "ppo", {"clip_rnage": 0.3}, "algorithm.policy_loss_fn_args")
    with pytest.raises(ConfigError, match=r"unknown policy_loss_fn 'ppx'; known: ppo, sft"):
        piece_config("policy_loss_fn", "ppx", {}, "algorithm.policy_loss_fn_args")
    with pytest.raises(ConfigError, match="unknown piece kind"):
        piece_config("critic_fn", "ppo", {}, "algorithm")


# --- rollout correction and sample strategies


def test_rollout_is_weights_hand_computed():
    old = torch.tensor([[-1.0, -2.0, 0.0]])  # [B=1,T=3]
    rollout = torch.tensor([[-1.5, -1.0, -9.0]])
    mask = torch.tensor([[True, True, False]])
    # log r = [0.5, -1.0]; r = [1.6487, 0.3679]
    w, m = correction.rollout_is_weights(old, rollout, mask, "token", 1.5)
    assert torch.allclose(w, torch.tensor([[1.5, math.exp(-1.0), 1.0]]))
    assert m["rollout_corr/rollout_is_clip_frac"] == pytest.approx(0.5)
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx((1.5 + math.exp(-1)) / 2)
    assert m["rollout_corr/kl"] == pytest.approx(0.25)  # mean(rollout - old) = mean(-0.5, 1.0)
    assert m["rollout_corr/k3_kl"] == pytest.approx(((math.exp(0.5) - 1.5) + math.exp(-1)) / 2)
    assert m["rollout_corr/abs_diff"] == pytest.approx(0.75)
    assert m["rollout_corr/ratio_mean"] == pytest.approx((math.exp(0.5) + math.exp(-1)) / 2)
    w, m = correction.rollout_is_weights(old, rollout, mask, "sequence", 1.5)  # prod r = exp(-0.5)
    assert torch.allclose(w, torch.tensor([[math.exp(-0.5), math.exp(-0.5), 1.0]]))
    assert m["rollout_corr/rollout_is_clip_frac"] == 0.0
    long = torch.full((1, 200), 1.0)  # prod r = exp(200): overflows unless clamped in log space
    w, m = correction.rollout_is_weights(
        long, torch.zeros(1, 200), torch.ones(1, 200, dtype=torch.bool), "sequence", 3.0
    )
    assert torch.allclose(w, torch.full((1, 200), 3.0)) and m["rollout_corr/rollout_is_clip_frac"] == 1.0
    w, m = correction.rollout_is_weights(old, rollout, mask, "none", 1.5)
    assert (
        torch.equal(w, torch.ones(1, 3))
        and "rollout_corr/rollout_is_mean" not in m
        and m["rollout_corr/kl"] == pytest.approx(0.25)
    )
    with pytest.raises(ValueError, match="unknown 'tokens'"):
        correction.rollout_is_weights(old, rollout, mask, "tokens", 1.5)


def test_rollout_is_weights_scale_the_ppo_gradient():
    """The trainer applies the weights by scaling the advantages: each token's gradient is w_t times the
    uncorrected one (PPO clip, at ratio 1)."""
    b = random_batch(B=3, T=5)
    logp = b["old_logprobs"].clone().requires_grad_(True)
    w, _ = correction.rollout_is_weights(
        b["old_logprobs"], b["old_logprobs"] - torch.randn(3, 5), b["response_mask"], "token", 2.0
    )
    assert (w != 1).any()
    ppo_loss.compute(logp, b, ppo_loss.Config(), "token-mean")[0].backward()
    plain = logp.grad.clone()
    logp.grad = None
    ppo_loss.compute(logp, {**b, "advantages": b["advantages"] * w}, ppo_loss.Config(), "token-mean")[0].backward()
    assert torch.allclose(logp.grad, plain * w)


def test_sample_strategies():
    assert sample.default(10, sample.Config()) == {}
    assert sample.staleness_control(10, sample.Config(max_staleness=2)) == {
        "min_version": 7
    }  # staleness <= 2 at step 10
    assert sample.staleness_control(2, sample.Config(max_staleness=4)) == {"min_version": 0}
    with pytest.raises(ValueError, match="max_staleness must be >= 0"):
        sample.staleness_control(3, sample.Config(max_staleness=-1))
    assert sample.dynamic_sampling(3, sample.Config(refill_rounds=2)) == {"max_num_gen_batches": 10, "refill_rounds": 2}
    assert sample.mix(3, sample.Config(expert_data_ratio=0.25)) == {"expert": ("sft_dataset", 0.25)}
    with pytest.raises(ValueError, match="expert_data_ratio must be in"):
        sample.mix(3, sample.Config(expert_data_ratio=1.0))
    # groups a (1, 1: tied), b (0, 1), c (one experience: never "tied"), d (0, 0: tied)
    assert sample.tied_groups(["a", "a", "b", "b", "c", "d", "d"], [1, 1, 0, 1, 1, 0, 0]) == {"a", "d"}


# --- the pieces the trainer applies to every algorithm: value loss, overlong shaping, adaptive KL


def test_value_loss_hand_computed():
    # old values 0, returns 1, cliprange 0.5: v = 0.2 (inside: (0.2-1)^2 = 0.64), v = 0.9 (clipped to 0.5:
    # max(0.01, 0.25) = 0.25), v = -1 (clipped to -0.5: max(4, 2.25) = 4); token-mean, times 0.5
    values = torch.tensor([[0.2, 0.9, -1.0, 7.0]], requires_grad=True)
    batch = {"values": torch.zeros(1, 4), "returns": torch.ones(1, 4), "response_mask": torch.tensor([[1, 1, 1, 0]])}
    loss, m = value_loss.compute(values, batch, value_loss.Config(cliprange_value=0.5), "token-mean")
    assert loss.item() == pytest.approx(0.5 * (0.64 + 0.25 + 4.0) / 3)
    assert m["vf_clipfrac"] == pytest.approx(1 / 3) and m["vpred_mean"] == pytest.approx((0.2 + 0.9 - 1.0) / 3)
    loss.backward()
    # d/dv: token 0: 0.5 * 2 * (0.2 - 1) / 3; token 1: the clipped term wins and is flat in v: 0; token 2:
    # the unclipped term wins: 0.5 * 2 * (-1 - 1) / 3; padding: 0
    assert values.grad[0].tolist() == pytest.approx([-0.8 / 3, 0.0, -2.0 / 3, 0.0])


def test_overlong_penalty_hand_computed():
    cfg = overlong.Config(enable=True, buffer_len=4, penalty_factor=1.0)
    lengths = torch.tensor([10.0, 16.0, 17.0, 20.0, 21.0])  # L_max 20, L_cache 4: free up to 16
    assert overlong.penalty(lengths, 20, cfg).tolist() == pytest.approx([0.0, 0.0, -0.25, -1.0, -1.0])
    assert overlong.penalty(lengths, 20, overlong.Config(buffer_len=4, penalty_factor=0.5))[3].item() == -0.5
    with pytest.raises(ValueError, match="buffer_len must be in 1..20"):
        overlong.penalty(lengths, 20, overlong.Config(buffer_len=0))


def test_adaptive_kl_coefficient_and_place_scores():
    cfg = kl.Config(kl_coef=0.1, adaptive=True, target_kl=0.05, horizon=100)
    # KL 0.1 = 2x target: error clipped to +0.2 -> beta x (1 + 0.2 * 10 / 100) = 0.1 x 1.02
    assert kl.adapt(0.1, 0.1, 10, cfg) == pytest.approx(0.102)
    # KL 0.045: error -0.1 -> beta x (1 - 0.1 * 50 / 100) = 0.1 x 0.95
    assert kl.adapt(0.1, 0.045, 50, cfg) == pytest.approx(0.095)
    scores = kl.place_scores(torch.tensor([2.0, -1.0]), torch.tensor([[1, 1, 0], [1, 0, 1]]))
    assert scores.tolist() == [[0.0, 2.0, 0.0], [0.0, 0.0, -1.0]]  # on the last valid token of each row


@pytest.mark.parametrize("name", list(algos.PRESETS))
def test_preset_table_matches_what_the_trainer_builds(name):
    """Preset.use_critic / use_reference (Trinity's table) agree with what the trainer derives from the
    pieces: a critic when the advantage fn NEEDS values, a reference model for a KL term or a loss that
    NEEDS ref_logprobs."""
    p = algos.PRESETS[name]
    adv = ADVANTAGE_FNS[p.advantage_fn][1] if p.advantage_fn != "none" else None
    policy = POLICY_LOSS_FNS[p.policy_loss_fn][1]
    assert p.use_critic == ("values" in getattr(adv, "NEEDS", ()))
    assert p.use_reference == (
        p.kl_loss_fn != "none" or p.kl_penalty_fn != "none" or "ref_logprobs" in getattr(policy, "NEEDS", ())
    )
