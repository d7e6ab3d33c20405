"""The built-in operators: name -> "module:attr", one line per entry, imported on first use (pipelines.build).
Adding one = a class with process(items) in a pipelines/ file + one line here + its test."""

from __future__ import annotations

# Over taskset rows (dicts), before the explorer reads them. Any other name without ":" is a Data-Juicer operator.
TASK_OPERATORS: dict[str, str] = {
    "llm_difficulty_score_filter": "pipelines.scoring:DifficultyScoreFilter",  # a model rates each task's difficulty
    "pass_rate_filter": "pipelines.scoring:PassRateFilter",  # a model's pass rate on each task, its own workflow
}

# Over each explore step's scored experiences (buffer.Experience), before they are written.
EXPERIENCE_OPERATORS: dict[str, str] = {
    "reward_filter": "pipelines.experience_ops:RewardFilter",  # drop experiences whose reward < threshold
    "reward_std_filter": "pipelines.experience_ops:RewardStdFilter",  # drop groups whose reward std <= threshold
    "invalid_reward_filter": "pipelines.experience_ops:InvalidRewardFilter",  # drop None / NaN rewards
    "reward_shaping_mapper": "pipelines.experience_ops:RewardShapingMapper",  # reward op= weight x a stat
    "pass_rate_calculator": "pipelines.experience_ops:PassRateCalculator",  # each group's mean reward as a stat
    "data_juicer": "pipelines.data_juicer:ExperienceDataJuicer",  # Data-Juicer stats / filters over the texts
}
