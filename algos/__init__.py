"""Algorithm registry: presets (`algorithm_type`) and, per piece, name -> function.

A preset names the pieces an algorithm is made of, as Trinity-RFT's presets do. `configs.derive` fills every piece
the YAML leaves empty from the preset. The trainer only ever looks pieces up (`lookup(kind, name)`) by the names in
the resolved config.

Piece registries: name -> (function, Config class for its `*_args`), validated by `configs.piece_config`.
This package imports nothing from the rest of the project: pure tensor functions and their registries.
    ADVANTAGE_FNS     fn(batch, cfg) -> ({"advantages", "returns", ...} [B,T], metrics); EXPLORER_ADVANTAGE_FNS:
                      those computed in the explorer (step_wise_grpo), whose entry here reads them back
    POLICY_LOSS_FNS   fn(logprobs [B,T], batch, cfg, loss_agg_mode) -> (scalar loss, metrics)
    KL_FNS            fn(logprobs [B,T], ref_logprobs [B,T]) -> per-token KL [B,T]; the KL loss and
                      KL penalty are `kl.loss(..., kind=name)` / `kl.penalty(..., kind=name)`
    ENTROPY_LOSS_FNS  fn(entropy [B,T], batch, cfg, loss_agg_mode) -> (scalar loss, metrics)
    SAMPLE_STRATEGIES fn(step, cfg) -> what the step's reader does (min_version, refill, expert rows)

A piece that needs more than the default batch keys says so in its Config: `NEEDS: ClassVar =
("values",)` makes the trainer build a critic (gae.py), ("ref_logprobs",) the reference model (dpo.py;
a KL loss or penalty also does), ("old_logprobs",) old log-probs before the advantages (on_policy_distill.py,
whose "teacher_logprobs" the explorer's workflow writes). `AGG: ClassVar = "seq-mean-token-mean"` marks a loss whose
aggregation is fixed (gspo, dpo), so the trainer weighs micro-batches by sequences. The Preset's use_critic /
use_reference document Trinity's table.

Not registries (one function each, used by the trainer for every algorithm):
    correction.rollout_is_weights  truncated IS between rollout and trainer log-probs (algorithm.rollout_correction)
    correction.rollout_rs_mask     the rejection mask named by rollout_correction.rollout_rs, from ROLLOUT_RS_FNS:
                                   fn(log_r [B,T], mask [B,T], Config(lower, upper)) -> keep [B,T] bool; one file each
                                   (rollout_rs: veRL's token / sequence, geometric_rs, icepop, trl_is_mask)
    value_loss.compute             the critic's clipped value loss (trainer.critic.cliprange_value)
    overlong.penalty               DAPO's overlong reward shaping (algorithm.overlong_reward)
    kl.adapt                       the adaptive KL coefficient (kl_*_fn_args.adaptive)
"""

from __future__ import annotations

import dataclasses
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


@dataclasses.dataclass(frozen=True)
class Preset:
    repeat_times: int  # default group size n
    advantage_fn: str
    policy_loss_fn: str
    kl_loss_fn: str
    kl_penalty_fn: str = "none"
    entropy_loss_fn: str = "default"
    sample_strategy: str = "default"
    use_critic: bool = False
    use_reference: bool = True
    train_only: bool = False  # offline data (sft, dpo): no explorer, checkpoint sync only
    schema: str = "experience"  # what the trainer's input rows are: experience, sft or dpo (file data)


PRESETS: dict[str, Preset] = {
    "ppo": Preset(1, "ppo", "ppo", "k2", use_critic=True),
    "grpo": Preset(2, "grpo", "ppo", "k2"),
    "rloo": Preset(2, "rloo", "ppo", "k2"),
    "reinforceplusplus": Preset(2, "reinforceplusplus", "ppo", "k2"),
    "opmd": Preset(2, "opmd", "opmd", "k2"),
    "asymre": Preset(2, "asymre", "opmd", "none", entropy_loss_fn="none", use_reference=False),
    "topr": Preset(2, "reinforce", "topr", "k2"),
    "cispo": Preset(2, "grpo", "cispo", "k2"),
    "gspo": Preset(2, "grpo", "gspo", "k2"),
    "sapo": Preset(2, "grpo", "sapo", "k2"),
    "sppo": Preset(2, "opmd", "sppo", "none", entropy_loss_fn="none", use_reference=False),
    "rec": Preset(2, "rec", "rec", "k2"),
    "multi_step_grpo": Preset(8, "step_wise_grpo", "ppo", "k2"),  # one experience per turn (step_wise)
    "mix": Preset(8, "grpo", "mix", "k2", entropy_loss_fn="mix", sample_strategy="mix"),
    "mix_chord": Preset(8, "grpo", "mix_chord", "k2", entropy_loss_fn="mix", sample_strategy="mix"),  # CHORD
    # RAFT: best-of-K by reward, then SFT (Trinity leaves repeat_times unset; best-of-K needs K > 1)
    "raft": Preset(4, "raft", "sft", "none", entropy_loss_fn="none", use_reference=False),
    # on-policy distillation: the teacher's log-probs come from the explorer (workflows/distill.py)
    "on_policy_distill": Preset(8, "on_policy_distill", "ppo", "none", entropy_loss_fn="none", use_reference=False),
    "jsd": Preset(8, "jsd", "ppo", "none", entropy_loss_fn="none", use_reference=False),
    "sft": Preset(1, "none", "sft", "none", entropy_loss_fn="none", use_reference=False, train_only=True, schema="sft"),
    "dpo": Preset(2, "none", "dpo", "k2", entropy_loss_fn="none", train_only=True, schema="dpo"),
}


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
