"""Algorithm registry: presets (`algorithm_type`) and, per piece, name -> function.

A preset names the pieces an algorithm is made of, as Trinity-RFT's presets do
(../shared/reference/trinity-inventory.md §4.1). `configs.derive` fills every piece the YAML leaves
empty from the preset. The trainer only ever looks pieces up by the names in the resolved config.
"""

from __future__ import annotations

import dataclasses


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
    "sppo": Preset(2, "opmd", "sppo", "none", entropy_loss_fn="none", use_reference=False),
    "rec": Preset(2, "rec", "rec", "k2"),
    "mix": Preset(8, "grpo", "mix", "k2", entropy_loss_fn="mix", sample_strategy="mix"),
    "sft": Preset(1, "none", "sft", "none", entropy_loss_fn="none", use_reference=False, train_only=True),
    "dpo": Preset(2, "none", "dpo", "k2", entropy_loss_fn="none", train_only=True),
}
