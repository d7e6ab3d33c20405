"""tool_workflow: multi-turn episodes in which the model may call tools before it answers, and the calculator.

Each of the task's `repeat_times` episodes (workflows/episode.py) runs turn by turn, all episodes' turns sent to the
engine together: the model replies; `<tool_call>` blocks in its reply are run and their results come back as tool
messages; a reply without a tool call is the answer, scored by the reward function against the reference (an
episode that ends on a tool call, at max_turns or cut off, is scored as no answer, ""). One
experience per episode (its action mask covers the model's own tokens only), or with `workflow_args.step_wise`
one per turn, each carrying the episode's reward (for step_wise_grpo).

Worked example (tools ["calculator"], reward_fn math_reward, reference "#### 83"):
    user       What is 37 + 58 - 12?
    assistant  <tool_call>{"name": "calculator", "arguments": {"expression": "37 + 58 - 12"}}</tool_call>
    tool       83
    assistant  #### 83                       -> reward 1.1 ({"accuracy": 1.0, "format_score": 0.1}), 2 turns

workflow_args: ToolArgs below (tools, max_turns, step_wise, tool_timeout, mask_truncated, system_prompt). A tool
schema of the taskset (format.tools_key) that no registered function runs reaches the chat template; a warning names
it once, and a call to it gets an "unknown tool" error.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import ClassVar

from buffer import Experience
from configs.checks import AT_LEAST_1, SECONDS
from workflows import Workflow, WorkflowArgs, apply_reward, chat_messages, sampling_kwargs
from workflows.calculator import calculate
from workflows.episode import Episode, reply_all
from workflows.tools import Tool, parse_tool_calls, run_tool, tool_message

log = logging.getLogger("nanorft.tool_use")
_WARNED: set[str] = set()  # tool names warned about, once per process

CALCULATOR = Tool(
    "calculator",
    calculate,
    "Computes an arithmetic expression (numbers, + - * / and parentheses).",
    {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
)
TOOLS: dict[str, Tool] = {"calculator": CALCULATOR}  # name -> Tool: add a tool here, one line


@dataclasses.dataclass
class ToolArgs(WorkflowArgs):
    """tool_workflow's workflow_args."""

    RANGES: ClassVar = {
        "tools": (lambda v: set(v) <= set(TOOLS), f"names of known tools (TOOLS: {', '.join(sorted(TOOLS))})"),
        "max_turns": AT_LEAST_1,
        "tool_timeout": SECONDS,
    }
    tools: list[str] = dataclasses.field(default_factory=lambda: ["calculator"])
    """The tools the model may call, by name (TOOLS); their schemas reach the chat template."""
    max_turns: int = 4
    """Assistant turns of an episode at most."""
    step_wise: bool = False
    """One experience per turn, each with its episode's reward (for multi_step_grpo), not one per episode."""
    tool_timeout: float = 10.0
    """Seconds a tool call may take; its worker process is killed then and the model gets an error message."""
    mask_truncated: bool = True
    """An episode cut at the context limit or at a turn's max_tokens keeps its reward in the group but has no action
    tokens (DAPO's overlong filtering); metrics truncated and truncated_masked count them."""


class ToolWorkflow(Workflow):
    """tool_workflow (Trinity's multi-turn workflows, tool calls in Qwen / Hermes format)."""

    default_reward_fn = "math_reward"
    Args = ToolArgs

    def run(self) -> list[Experience]:
        task, args = self.task, self.args
        tools = [TOOLS[name] for name in args.tools]
        schemas = [*tools, *(task.tools or [])]  # the taskset's own tool schemas (format.tools_key) too
        warn_unrun(task.tools or [], tools)
        episodes = [
            Episode(self.model, chat_messages(task), schemas, args.max_turns, task.chat_template or None)
            for _ in range(task.repeat_times)
        ]
        calls = [0] * len(episodes)
        while not all(e.done for e in episodes):
            for k, (e, text) in enumerate(zip(episodes, reply_all(episodes, **sampling_kwargs(task.rollout_args)))):
                if text is None or e.done:
                    continue
                found = parse_tool_calls(text)
                if not found:
                    e.finish()  # the answer
                    continue
                calls[k] += len(found)
                e.add([tool_message(run_tool(tools, c, args.tool_timeout)) for c in found])
        return [exp for k, (e, n) in enumerate(zip(episodes, calls)) for exp in self.score(e, n, k)]

    def score(self, episode: Episode, calls: int, k: int) -> list[Experience]:
        """Episode k's experience(s), rewarded for its last reply: the answer, or "" (no answer) if the episode
        ended on a tool call (the numbers of a call are no answer); info["episode"] = k ties the turns of one episode
        together (step_wise_grpo)."""
        args, last = self.args, episode.messages_text(-1)
        components = self.reward("" if parse_tool_calls(last) else last, k)
        mask = args.mask_truncated
        exps = episode.turn_experiences(mask) if args.step_wise else [episode.experience(mask)]
        for exp in exps:
            apply_reward(exp, components)
            exp.metrics.update({"tool_calls": float(calls), "turns": float(len(episode.turns))})
            exp.info["episode"] = k
        return exps


def warn_unrun(schemas: list[dict], tools: list[Tool]) -> None:
    """Warn once per name about a taskset tool schema that reaches the template but that no function runs."""
    names = {t.name for t in tools}
    for schema in schemas:
        name = str((schema.get("function") or schema).get("name", "")) if isinstance(schema, dict) else ""
        if name and name not in names and name not in _WARNED:
            _WARNED.add(name)
            log.warning(
                "the taskset's tool %r (format.tools_key) reaches the chat template, but no registered "
                "function runs it (workflow_args.tools: %s): the model's calls to it get an 'unknown "
                "tool' error",
                name,
                sorted(names),
            )
