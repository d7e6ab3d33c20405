"""countdown_workflow: TinyZero's countdown game. Given numbers and a target, write an arithmetic
equation that uses each number exactly once and equals the target.

The task row has `nums` (list of ints) and `target` (int), read from `task.raw`. The prompt is
`task.messages` when the taskset has a prompt column, else TinyZero's instruction built from
nums/target (PROMPT below) as the user message, after `workflow_args["system_prompt"]` if given.

countdown_reward (TinyZero's compute_score): the equation is the text inside the LAST
<answer>...</answer>.
  - 1.0 if it uses exactly the given numbers, each once, and equals the target within 1e-5;
  - 0.1 (format_score) if it is a well-formed equation but wrong (value, numbers, or / by 0);
  - 0.0 if there is no <answer>, or its content is not a well-formed equation.
Returned as {"accuracy": 1.0, "format_score": 0.0} or {"accuracy": 0.0, "format_score": 0.1 | 0.0}:
TinyZero gives the format credit instead of, not on top of, the accuracy.
"Well-formed" = at most 100 characters of integers, + - * /, unary +/- and parentheses. It is
stricter than TinyZero (whose regex check passes e.g. `2**5`, scored 0.1 there, 0.0 here) and
`(1 + 2) / 3 = 1` is not an equation here either. The equation is evaluated by walking its `ast`
over those node types only, never eval'ed, with every intermediate value bounded by 1e12.

Worked example (nums [3, 5, 2], target 16):
    "<think>3 + 5 = 8, 8 * 2 = 16</think> <answer> (3 + 5) * 2 </answer>" -> reward 1.0
    "<answer> 3 * 5 + 2 </answer>"   (17, wrong value)                      -> reward 0.1
    "<answer> (5 + 3) * 2 * 1 </answer>" (1 not given)                      -> reward 0.1
    "The answer is (3 + 5) * 2."      (no <answer>)                          -> reward 0.0
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any

from buffer import Experience
from tasksets import Task
from workflows import Workflow, WorkflowArgs, apply_reward, chat_messages, chat_options, sampling_kwargs

PROMPT = (
    "Using the numbers {nums}, create an equation that equals {target}. You can use basic arithmetic "
    "operations (+, -, *, /) and each number can only be used once. Show your work in <think> </think> "
    "tags. And return the final answer in <answer> </answer> tags, for example <answer> (1 + 2) / 3 </answer>."
)
MAX_EQUATION_CHARS = 100  # longer answers are malformed (also bounds the ast depth)
MAX_MAGNITUDE = 1e12  # any intermediate value beyond this makes the equation wrong
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_ALLOWED = (
    ast.Expression,
    ast.BinOp,
    ast.UnaryOp,
    ast.Constant,
    ast.Add,
    ast.Sub,
    ast.Mult,
    ast.Div,
    ast.USub,
    ast.UAdd,
)


# --- safe equation evaluation


def parse_equation(text: str) -> ast.Expression | None:
    """The ast of an arithmetic equation over integers, or None if `text` is anything else."""
    if len(text) > MAX_EQUATION_CHARS:
        return None
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    for node in ast.walk(tree):
        if not isinstance(node, _ALLOWED):
            return None
        # NOTE: bool is an int subclass; `True + 1` must not pass as arithmetic on integers.
        if isinstance(node, ast.Constant) and (type(node.value) is not int):
            return None
    return tree


def evaluate(node: ast.AST) -> float | None:
    """Value of a tree from `parse_equation`; None on division by zero or a value beyond MAX_MAGNITUDE."""
    if isinstance(node, ast.Expression):
        return evaluate(node.body)
    if isinstance(node, ast.Constant):
        value = float(node.value)
    elif isinstance(node, ast.UnaryOp):
        operand = evaluate(node.operand)
        if operand is None:
            return None
        value = -operand if isinstance(node.op, ast.USub) else operand
    else:  # BinOp, the only other node parse_equation lets through
        left, right = evaluate(node.left), evaluate(node.right)
        if left is None or right is None or (isinstance(node.op, ast.Div) and right == 0):
            return None
        value = _OPS[type(node.op)](left, right)
    return value if math.isfinite(value) and abs(value) <= MAX_MAGNITUDE else None


def numbers_used(tree: ast.Expression) -> list[int]:
    """The integer literals of the equation, in any order."""
    return [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)]


# --- reward


def countdown_reward(response: str, reference: dict[str, Any], *, format_score: float = 0.1) -> dict[str, float]:
    """TinyZero's countdown score; `reference` = {"target": int, "nums": list[int]}."""
    # NOTE: the last closed tag, found with rfind (a non-greedy regex is quadratic on unclosed tags).
    end = response.rfind("</answer>")
    start = response.rfind("<answer>", 0, end) if end >= 0 else -1
    tree = parse_equation(response[start + len("<answer>") : end]) if start >= 0 else None
    if tree is None:
        return {"accuracy": 0.0, "format_score": 0.0}
    value = evaluate(tree)
    correct = (
        sorted(numbers_used(tree)) == sorted(int(n) for n in reference["nums"])
        and value is not None
        and abs(value - float(reference["target"])) < 1e-5
    )
    return {"accuracy": 1.0, "format_score": 0.0} if correct else {"accuracy": 0.0, "format_score": format_score}


# --- workflow


def countdown_messages(task: Task) -> list[dict]:
    """The taskset's messages if it has a prompt column, else TinyZero's instruction from nums/target."""
    if task.messages or task.prompt:
        return chat_messages(task)
    user = {"role": "user", "content": PROMPT.format(nums=list(task.raw["nums"]), target=task.raw["target"])}
    system_prompt = task.workflow_args.get("system_prompt")
    return ([{"role": "system", "content": system_prompt}] if system_prompt is not None else []) + [user]


class CountdownWorkflow(Workflow):
    """countdown_workflow: one chat call for the group; reference = nums/target of the row.
    workflow_args: system_prompt."""

    default_reward_fn = "countdown_reward"
    Args = WorkflowArgs

    def run(self) -> list[Experience]:
        task = self.task
        reference = {"target": task.raw["target"], "nums": list(task.raw["nums"])}
        exps = self.model.chat(
            countdown_messages(task), n=task.repeat_times, **chat_options(task), **sampling_kwargs(task.rollout_args)
        )
        for run, exp in enumerate(exps):
            apply_reward(exp, self.reward_fn(exp.response_text, reference, **self.draw_args(run)))
        return exps
