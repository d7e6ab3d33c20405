"""simple_workflow: prompt in, `repeat_times` responses out, each scored by the configured reward
function against `task.reference`. Nothing task-specific: the reward function carries all of it.

Worked example (reward_fn = "math_reward", reference "#### 42"):
    messages  = [{"role": "user", "content": "What is 6 * 7?"}]
    responses = ["6 * 7 = 42.\\n#### 42", "I think it is 41."]
    rewards   = [1.1 ({"accuracy": 1.0, "format_score": 0.1}), -0.1 ({"accuracy": 0.0, "format_score": -0.1})]
"""

from __future__ import annotations

from buffer import Experience
from workflows import Workflow, WorkflowArgs, apply_reward, chat_messages, chat_options, sampling_kwargs


class SimpleWorkflow(Workflow):
    """simple_workflow (Trinity's SimpleWorkflow without reply_prefix). workflow_args: system_prompt."""

    Args = WorkflowArgs

    def run(self) -> list[Experience]:
        task = self.task
        if self.reward_fn is None:
            raise ValueError(f"{task.task_id}: simple_workflow needs a reward function (reward_fn)")
        exps = self.model.chat(
            chat_messages(task), n=task.repeat_times, **chat_options(task), **sampling_kwargs(task.rollout_args)
        )
        for run, exp in enumerate(exps):
            apply_reward(exp, self.reward(exp.response_text, run))
        return exps
