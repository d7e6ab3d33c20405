"""llm_judge_workflow: the policy answers, an auxiliary model grades each answer (LLM as a judge; Trinity's
rubric_judge_workflow, cut down).

The group's `repeat_times` responses come from one `chat(n=...)` call; each is shown to the judge
(`explorer.auxiliary_models`, named by `workflow_args.judge`, default the first) with the question (the task's last
user message) and the reference answer, all of them in one `replies()` call (one engine batch; an external judge,
engine_type external: concurrent requests to its OpenAI-compatible endpoint), greedily; a reply must contain
`Score: N` with N in [0, max_score]. The responses whose reply has none are asked again, at temperature 0.7, up to
`judge_retries` more times; then the task fails with the judge's reply in the message (never a silent 0: an
ungraded response is no data point). An external judge that cannot be reached, times out or sends no text fails the
task too (engines.ExternalModelError), which the runner retries and then drops with that message.

Worked example (max_score 10):
    question "What is 6 x 7?", reference "#### 42", response "#### 42"
    judge: "The response states 42, which matches. Score: 10"  -> {"judge": 1.0}, reward 1.0
    judge: "Looks fine."                                        -> asked again; ungraded every time -> JudgeError

workflow_args: JudgeArgs below (judge, max_score, judge_retries, judge_max_tokens, system_prompt: the policy's).
The judge's grade is the reward: a reward function set for the taskset has no effect (a warning says so).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, ClassVar

from buffer import Experience
from configs.checks import AT_LEAST_1, NON_NEGATIVE, POSITIVE
from workflows import Workflow, WorkflowArgs, apply_reward, chat_messages, chat_options, sampling_kwargs

PROMPT = (
    "Grade the response to the question against the reference answer.\n"
    "Question: {question}\nReference answer: {reference}\nResponse: {response}\n"
    "Reply with your reasoning, then a last line `Score: N` with N from 0 to {max_score}."
)
_SCORE = re.compile(r"Score:\s*(-?\d+(?:\.\d+)?)")


class JudgeError(ValueError):
    """The judge gave no usable grade."""


def parse_grade(text: str, max_score: float = 10.0) -> float:
    """The judge's grade in [0, 1]: the last `Score: N` of `text` divided by max_score; JudgeError when there is
    none or N is outside [0, max_score]."""
    found = _SCORE.findall(text)
    if not found:
        raise JudgeError(f"no `Score: N` in the judge's reply {text[-200:]!r}")
    score = float(found[-1])
    if not 0 <= score <= max_score:
        raise JudgeError(f"the judge's score {score:g} is outside [0, {max_score:g}]")
    return score / max_score


@dataclasses.dataclass
class JudgeArgs(WorkflowArgs):
    """llm_judge_workflow's workflow_args."""

    RANGES: ClassVar = {"max_score": POSITIVE, "judge_retries": NON_NEGATIVE, "judge_max_tokens": AT_LEAST_1}
    judge: str | None = None
    """The auxiliary model that grades (explorer.auxiliary_models[].name); None: the first one."""
    max_score: float = 10.0
    """The top of the judge's scale: its `Score: N` is divided by it (reward in [0, 1])."""
    judge_retries: int = 2
    """How many more times a response whose judge's reply has no grade is asked about (sampled at 0.7)."""
    judge_max_tokens: int = 64
    """Tokens of each judge's reply at most."""


class JudgeWorkflow(Workflow):
    """llm_judge_workflow: responses graded by an auxiliary model."""

    Args = JudgeArgs
    uses_reward_fn = False

    def run(self) -> list[Experience]:
        task, args = self.task, self.args
        if not self.auxiliary_models:
            raise ValueError(f"{task.task_id}: llm_judge_workflow needs a judge in explorer.auxiliary_models")
        name = args.judge or next(iter(self.auxiliary_models))
        if name not in self.auxiliary_models:
            raise ValueError(f"{task.task_id}: no auxiliary model {name!r}; there are {list(self.auxiliary_models)}")
        messages = chat_messages(task)
        exps = self.model.chat(
            messages, n=task.repeat_times, **chat_options(task), **sampling_kwargs(task.rollout_args)
        )
        question = next((m["content"] for m in reversed(messages) if m.get("role") == "user"), task.prompt or "")
        for exp, grade in zip(exps, self.grade(self.auxiliary_models[name], question, [e.response_text for e in exps])):
            apply_reward(exp, {"judge": grade})
        return exps

    def grade(self, judge: Any, question: str, responses: list[str]) -> list[float]:
        """The judge's grade of each response: one replies() call for all (one engine batch, or concurrent requests
        to an external endpoint), then again (sampled) for those whose reply had none."""
        args, max_score = self.args, self.args.max_score
        conversations = [
            [
                {
                    "role": "user",
                    "content": PROMPT.format(
                        question=question, reference=self.task.reference, response=r, max_score=f"{max_score:g}"
                    ),
                }
            ]
            for r in responses
        ]
        grades: list[float | None] = [None] * len(responses)
        errors: dict[int, JudgeError] = {}
        tries = args.judge_retries + 1
        for attempt in range(tries):
            todo = [i for i, g in enumerate(grades) if g is None]
            if not todo:
                break
            replies = judge.replies(
                [conversations[i] for i in todo],
                temperature=0.0 if attempt == 0 else 0.7,
                max_tokens=args.judge_max_tokens,
            )
            for i, reply in zip(todo, replies):
                try:
                    grades[i] = parse_grade(reply, max_score)
                except JudgeError as e:
                    errors[i] = e
        missing = [i for i, g in enumerate(grades) if g is None]
        if missing:
            raise JudgeError(f"after {tries} replies: {errors[missing[0]]} (response {missing[0]} of {len(grades)})")
        return grades
