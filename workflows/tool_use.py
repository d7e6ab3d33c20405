"""tool_workflow: multi-turn episodes in which the model may call tools before it answers, and the calculator.

Each of the task's `repeat_times` episodes (workflows/episode.py) runs turn by turn, all episodes' turns sent to the
engine together: the model replies; `<tool_call>` blocks in its reply are run and their results come back as tool
messages; a reply without a tool call is the answer, scored by the reward function against the reference. One
experience per episode (its action mask covers the model's own tokens only), or with `workflow_args.step_wise`
one per turn, each carrying the episode's reward (for step_wise_grpo).

Worked example (tools ["calculator"], reward_fn math_reward, reference "#### 83"):
    user       What is 37 + 58 - 12?
    assistant  <tool_call>{"name": "calculator", "arguments": {"expression": "37 + 58 - 12"}}</tool_call>
    tool       83
    assistant  #### 83                       -> reward 1.1 ({"accuracy": 1.0, "format_score": 0.1}), 2 turns

workflow_args: tools (names in TOOLS, default ["calculator"]), max_turns (assistant turns, default 4),
step_wise (bool), system_prompt (str), tool_timeout (seconds per call, default 10).
"""

from __future__ import annotations

import ast
import operator

from buffer import Experience
from workflows import Workflow, apply_reward, chat_messages, sampling_kwargs
from workflows.episode import Episode, Tool, parse_tool_calls, reply_all, run_tool, tool_message

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression: str) -> str:
    """The value of an arithmetic expression of numbers, + - * / and parentheses, read with `ast.parse` and
    computed node by node (never evaluated as Python): "37 + 58 - 12" -> "83", "7 / 2" -> "3.5"."""
    if len(expression) > 200:
        raise ValueError("the expression is longer than 200 characters")

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            return _BINARY[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](value(node.operand))
        raise ValueError(f"not arithmetic: {ast.unparse(node)!r}")

    try:
        result = value(ast.parse(expression.strip(), mode="eval").body)
    except SyntaxError as e:
        raise ValueError(f"not an expression: {expression!r}") from e
    return str(int(result)) if float(result).is_integer() else f"{result:.6g}"


CALCULATOR = Tool("calculator", calculate, "Computes an arithmetic expression (numbers, + - * / and parentheses).",
                  {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]})
TOOLS: dict[str, Tool] = {"calculator": CALCULATOR}  # name -> Tool: add a tool here, one line


class ToolWorkflow(Workflow):
    """tool_workflow (Trinity's multi-turn workflows, tool calls in Qwen / Hermes format)."""

    default_reward_fn = "math_reward"

    def run(self) -> list[Experience]:
        task, args = self.task, self.task.workflow_args
        unknown = sorted(set(args.get("tools", ["calculator"])) - set(TOOLS))
        if unknown:
            raise ValueError(f"{task.task_id}: unknown tool(s) {unknown}; known: {sorted(TOOLS)}")
        tools = [TOOLS[name] for name in args.get("tools", ["calculator"])]
        schemas = [*tools, *(task.tools or [])]  # the taskset's own tool schemas (format.tools_key) too
        episodes = [Episode(self.model, chat_messages(task), schemas, int(args.get("max_turns", 4)),
                            task.chat_template or None) for _ in range(task.repeat_times)]
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
                e.add([tool_message(run_tool(tools, c, float(args.get("tool_timeout", 10)))) for c in found])
        return [exp for k, (e, n) in enumerate(zip(episodes, calls))
                for exp in self.score(e, n, bool(args.get("step_wise")), k)]

    def score(self, episode: Episode, calls: int, step_wise: bool, k: int) -> list[Experience]:
        """Episode k's experience(s), rewarded for its last reply (the answer; a tool call if it never answered);
        info["episode"] = k ties the turns of one episode together (step_wise_grpo)."""
        components = self.reward_fn(episode.messages_text(-1), self.task.reference)
        exps = episode.turn_experiences() if step_wise else [episode.experience()]
        for exp in exps:
            apply_reward(exp, components)
            exp.metrics.update({"tool_calls": float(calls), "turns": float(len(episode.turns))})
            exp.info["episode"] = k
        return exps
