"""on_policy_distill_workflow: the policy (the student) answers, a teacher (an auxiliary model) scores the student's
own tokens: on-policy distillation (Agarwal et al., GKD, arXiv 2306.13649; Thinking Machines' "On-Policy
Distillation", 2025, as Trinity-RFT's on_policy_distill_workflow).

The group's `repeat_times` responses come from one `chat(n=...)` call. The teacher (`explorer.auxiliary_models`, named
by `workflow_args.teacher`, default the first; it must share the student's tokenizer) scores every whole sequence,
prompt + response, in one `score()` call (vLLM: prompt_logprobs), and each experience keeps the teacher's log-probs of
its response tokens, `exp.teacher_logprobs` [R] = log_softmax(teacher logits / temperature) at the student's tokens
(`workflow_args.temperature`, default 1.0; vLLM scores at 1.0 only). The trainer's advantage fn turns them into
per-token advantages (algos/on_policy_distill.py: kl_coef * (teacher - student); algos/jsd.py).

Reward: the taskset's reward function when one is set (e.g. math_reward, so that accuracy is logged; the distillation
losses do not read it), else 0, as Trinity's (its on_policy_distill_math_workflow is this with math accuracy).
Metrics of each response (logged as rollout/<name>/mean): kl_divergence = sum over its tokens of student - teacher
log-prob (Trinity's; a Monte-Carlo estimate of the sequence's reverse KL), kl_per_token = that / R, teacher_logprob =
the teacher's mean log-prob of the student's tokens. Eval tasks are not scored by the teacher (nothing trains on them).

Worked example (R = 3 response tokens, student log-probs [-0.5, -1.0, -0.2], teacher's [-0.7, -0.4, -0.2]):
    teacher_logprobs = [-0.7, -0.4, -0.2]; kl_divergence = 0.2 - 0.6 + 0 = -0.4, kl_per_token = -0.133,
    teacher_logprob = -0.433; on_policy_distill's advantages (kl_coef 1): [-0.2, 0.6, 0.0]

workflow_args: DistillArgs below (teacher, temperature, system_prompt).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from buffer import Experience
from configs.checks import POSITIVE
from workflows import Workflow, WorkflowArgs, apply_reward, chat_messages, chat_options, sampling_kwargs


@dataclasses.dataclass
class DistillArgs(WorkflowArgs):
    """on_policy_distill_workflow's workflow_args."""

    RANGES: ClassVar = {"temperature": POSITIVE}
    teacher: str | None = None
    """The auxiliary model that scores (explorer.auxiliary_models[].name: its folder's name); None: the first one."""
    temperature: float = 1.0
    """The teacher's log-probs are log_softmax(logits / temperature) (Trinity's workflow_args.temperature)."""


class DistillWorkflow(Workflow):
    """on_policy_distill_workflow: the student's responses, each with its teacher's log-probs."""

    Args = DistillArgs

    def run(self) -> list[Experience]:
        task = self.task
        exps = self.model.chat(
            chat_messages(task), n=task.repeat_times, **chat_options(task), **sampling_kwargs(task.rollout_args)
        )
        if not task.is_eval:
            self.score(self.teacher(), exps)
        for run, exp in enumerate(exps):  # no reward function: reward 0 (the sum of no components)
            apply_reward(exp, self.reward(exp.response_text, run) if self.reward_fn is not None else {})
        return exps

    def teacher(self) -> Any:
        """The teacher's handle: workflow_args.teacher, or the first auxiliary model; ValueError naming the problem."""
        task, name = self.task, self.args.teacher
        if not self.auxiliary_models:
            raise ValueError(f"{task.task_id}: on_policy_distill_workflow needs a teacher in explorer.auxiliary_models")
        name = name or next(iter(self.auxiliary_models))
        if name not in self.auxiliary_models:
            raise ValueError(f"{task.task_id}: no auxiliary model {name!r}; there are {list(self.auxiliary_models)}")
        teacher = self.auxiliary_models[name]
        mine, theirs = getattr(self.model, "tokenizer", None), getattr(teacher, "tokenizer", None)
        if mine is not None and theirs is not None and len(mine) != len(theirs):
            raise ValueError(
                f"{task.task_id}: the teacher {name!r} has a vocabulary of {len(theirs)} tokens, the student "
                f"{len(mine)}: it must score the student's token ids, so they must share a tokenizer"
            )
        return teacher

    def score(self, teacher: Any, exps: list[Experience]) -> None:
        """exp.teacher_logprobs [R] of each experience (one score() call for the group) and its metrics."""
        scored = teacher.score([exp.tokens for exp in exps], temperature=self.args.temperature)
        for exp, lp in zip(exps, scored):
            exp.teacher_logprobs = lp[exp.prompt_length - 1 :].float()  # [R]: the state before token t scores it
            R = exp.response_length
            if len(exp.teacher_logprobs) != R:
                raise ValueError(f"the teacher returned {len(lp)} log-probs for a sequence of {len(exp.tokens)}")
            gap = (exp.logprobs - exp.teacher_logprobs).sum().item() if exp.logprobs is not None else 0.0
            exp.metrics["kl_divergence"] = gap
            exp.metrics["kl_per_token"] = gap / max(R, 1)
            exp.metrics["teacher_logprob"] = exp.teacher_logprobs.mean().item() if R else 0.0
