"""Algorithm registry: presets (`algorithm_type`) and, per piece, name -> function.

A preset names the pieces an algorithm is made of, as Trinity-RFT's presets do. `configs.derive` fills every piece
the YAML leaves empty from the preset. The trainer only ever looks pieces up (`lookup(kind, name)`) by the names in
the resolved config.

Piece registries (algos/registry.py, this package's attributes on first use: every piece module imports torch,
which the presets and configs/ do without): name -> (function, Config class for its `*_args`), validated by
`configs.piece_config`.
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
import importlib
from typing import Any


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


def __getattr__(name: str) -> Any:
    """The registries (algos/registry.py), and any piece module, on first use. NOTE: they import torch (~2 s): the
    presets above do not, so that configs/ and the entry scripts' --help load without it (tests/test_config.py
    test_help_imports_no_torch)."""
    if name.startswith("__"):
        raise AttributeError(name)
    registry = importlib.import_module("algos.registry")  # NOTE: not `from algos import`: that asks this function
    if hasattr(registry, name):
        return getattr(registry, name)
    try:
        return importlib.import_module(f"algos.{name}")
    except ModuleNotFoundError:
        raise AttributeError(f"module 'algos' has no attribute {name!r}") from None
