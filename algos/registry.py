"""The piece registries: name -> (function, Config class of its `*_args`), one line per entry (algos/__init__.py's
docstring says what each holds). algos/__init__.py gives them as its own attributes (`algos.ADVANTAGE_FNS`,
`algos.lookup`) on first use: every piece module imports torch."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from algos import (
    asymre,
    cispo,
    dpo,
    entropy,
    gae,
    geometric_rs,
    grpo,
    gspo,
    icepop,
    importance_sampling,
    jsd,
    kl,
    mix,
    mix_chord,
    on_policy_distill,
    opmd,
    ppo_loss,
    raft,
    rec,
    reinforce,
    reinforceplusplus,
    rloo,
    rollout_rs,
    sample,
    sapo,
    sft_loss,
    sppo,
    step_wise_grpo,
    topr,
    trl_is_mask,
)

ADVANTAGE_FNS: dict[str, tuple[Callable, type]] = {
    "grpo": (grpo.compute, grpo.Config),
    "step_wise_grpo": (step_wise_grpo.from_explorer, step_wise_grpo.Config),  # computed in the explorer (below)
    "ppo": (gae.compute, gae.Config),
    "reinforceplusplus": (reinforceplusplus.compute, reinforceplusplus.Config),
    "reinforce": (reinforce.compute, reinforce.Config),
    "rloo": (rloo.compute, rloo.Config),
    "opmd": (opmd.advantage, opmd.AdvantageConfig),
    "asymre": (asymre.compute, asymre.Config),
    "rec": (rec.advantage, rec.AdvantageConfig),
    "raft": (raft.compute, raft.Config),
    "on_policy_distill": (on_policy_distill.compute, on_policy_distill.Config),
    "jsd": (jsd.compute, jsd.Config),
}

# advantage fns computed in the explorer, over each task's whole group before it is written (batching.group_advantages);
# their ADVANTAGE_FNS entry is the trainer's side, which reads the result back
EXPLORER_ADVANTAGE_FNS: dict[str, Callable] = {
    "step_wise_grpo": step_wise_grpo.compute,
}

POLICY_LOSS_FNS: dict[str, tuple[Callable, type]] = {
    "ppo": (ppo_loss.compute, ppo_loss.Config),
    "sft": (sft_loss.compute, sft_loss.Config),
    "gspo": (gspo.compute, gspo.Config),
    "cispo": (cispo.compute, cispo.Config),
    "sapo": (sapo.compute, sapo.Config),
    "topr": (topr.compute, topr.Config),
    "sppo": (sppo.compute, sppo.Config),
    "rec": (rec.loss, rec.LossConfig),
    "opmd": (opmd.loss, opmd.LossConfig),
    "importance_sampling": (importance_sampling.compute, importance_sampling.Config),
    "sft_is": (sft_loss.compute_is, sft_loss.Config),
    "sft_phi": (sft_loss.compute_phi, sft_loss.PhiConfig),
    "dpo": (dpo.compute, dpo.Config),
    "mix": (mix.compute, mix.Config),
    "mix_chord": (mix_chord.compute, mix_chord.Config),
}

KL_FNS: dict[str, tuple[Callable, type]] = {
    "none": (functools.partial(kl.estimate, kind="none"), kl.Config),
    "k1": (functools.partial(kl.estimate, kind="k1"), kl.Config),
    "k2": (functools.partial(kl.estimate, kind="k2"), kl.Config),
    "k3": (functools.partial(kl.estimate, kind="k3"), kl.Config),
    "low_var_kl": (functools.partial(kl.estimate, kind="low_var_kl"), kl.Config),
    "abs": (functools.partial(kl.estimate, kind="abs"), kl.Config),
}

ENTROPY_LOSS_FNS: dict[str, tuple[Callable, type]] = {
    "default": (entropy.loss, entropy.Config),
    "none": (entropy.none, entropy.Config),
    "mix": (entropy.mix, entropy.Config),
}

SAMPLE_STRATEGIES: dict[str, tuple[Callable, type]] = {
    "default": (sample.default, sample.Config),
    "staleness_control": (sample.staleness_control, sample.Config),
    "dynamic_sampling": (sample.dynamic_sampling, sample.Config),
    "mix": (sample.mix, sample.Config),
}

# algorithm.rollout_correction.rollout_rs -> (mask fn, Config of its band [lower, upper]); "none" is no mask
ROLLOUT_RS_FNS: dict[str, tuple[Callable, type]] = {
    "token": (rollout_rs.token, rollout_rs.Config),  # veRL
    "sequence": (rollout_rs.sequence, rollout_rs.Config),  # veRL
    "geometric": (geometric_rs.mask, geometric_rs.Config),  # veRL
    "icepop": (icepop.mask, icepop.Config),  # Ring-1T
    "token_mask": (trl_is_mask.token_mask, trl_is_mask.Config),  # TRL
    "sequence_mask": (trl_is_mask.sequence_mask, trl_is_mask.Config),  # TRL's default
}

# config field (algorithm.<kind>) -> the registry its name is looked up in
REGISTRIES: dict[str, dict[str, tuple[Callable, type]]] = {
    "advantage_fn": ADVANTAGE_FNS,
    "policy_loss_fn": POLICY_LOSS_FNS,
    "kl_loss_fn": KL_FNS,
    "kl_penalty_fn": KL_FNS,
    "entropy_loss_fn": ENTROPY_LOSS_FNS,
    "sample_strategy": SAMPLE_STRATEGIES,
}
# the pieces a trainer builds from its config: kind (a REGISTRIES key) -> (function, the named piece's Config)
Pieces = dict[str, tuple[Callable, Any]]


def lookup(kind: str, name: str) -> Callable:
    """The function of piece `name` of `kind` (a REGISTRIES key: the config field that names it, e.g.
    "policy_loss_fn"). Every registry is read this way from outside its package (workflows.lookup: workflows and
    reward functions); configs.piece_config validates the name and the piece's `*_args` first."""
    if name not in REGISTRIES[kind]:
        raise KeyError(f"unknown {kind} {name!r}; known: {', '.join(REGISTRIES[kind])}")
    return REGISTRIES[kind][name][0]
