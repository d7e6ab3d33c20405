"""math_workflow: GSM8K-style math word problems, scored by final-answer equivalence.

The workflow sends `task.messages` (system prompt from `workflow_args["system_prompt"]` if given),
samples `task.repeat_times` responses in one `chat(n=...)` call with `task.rollout_args`, and
scores each with the reward function (default `math_reward`).

Final answer of a response, first form found wins (the last occurrence of that form):
  1. `#### N` (GSM8K's own format; a markdown heading such as `#### Step 1` does not count),
  2. `\\boxed{...}` (nested braces matched),
  3. `<answer>...</answer>`,
  4. the last number in the text, if `last_number_fallback` (default True).
The reference goes through 1-3, else is used whole (GSM8K's `answer` ends with `#### N`).

Equivalence: both sides as exact `Fraction`s when both read as numbers ("1,234" == "1234",
"72.0" == "72", "3/4" == "\\frac{3}{4}" == "0.75", "$18" == "18", "18." == "18", "25%" == "25"
because GSM8K writes percentages as bare numbers, "18 dollars" == "18"). Otherwise symbolic, via
math_verify, under length and power-tower guards and, off the main thread, without its signal
timeouts (which only work there). Model output is never eval'ed.

Rewards (Trinity's names): accuracy_reward = {"accuracy": 1.0 | 0.0}; format_reward =
{"format_score": +0.1 if the response states a final answer in forms 1-3, else -0.1}; math_reward =
both. Trinity's format check is `<think>..</think><answer>..</answer>`; for GSM8K-style prompts any
recognised final-answer form counts. 0.1 keeps accuracy dominant: correct >= 0.9 > wrong <= 0.1.

Worked example (GSM8K test row 0, reference "Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 ... #### 18"):
    "She sells 9 eggs and makes 9 * 2 = $18.\\n#### 18"  -> {"accuracy": 1.0, "format_score": 0.1}, reward 1.1
    "She makes 18 dollars every day."                    -> {"accuracy": 1.0, "format_score": -0.1}, reward 0.9
    "The answer is \\boxed{17}"                           -> {"accuracy": 0.0, "format_score": 0.1}, reward 0.1
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import random
import re
import threading
from fractions import Fraction
from typing import Any

from buffer import Experience
from workflows import Workflow, WorkflowArgs, apply_reward, chat_messages, chat_options, sampling_kwargs

MAX_ANSWER_CHARS = 200  # longer final answers are judged wrong without parsing (no model writes them)
MAX_NUMBER_CHARS = 40  # longer numerals are not read as numbers (Fraction would be slow / refuse them)

_HASH = re.compile(r"####[ \t]*(\$?-?\.?\d[^\n]*)")
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+")
_NUMERAL = re.compile(r"-?(?:\d+/\d+|\d+(?:\.\d*)?|\.\d+)")
_FRAC = re.compile(r"(-?)\\[dt]?frac\{(-?\d+)\}\{(\d+)\}")
# "18 dollars" -> "18". NOTE: no nested quantifiers here, they backtrack exponentially on "aaaa...!".
_UNITS = re.compile(r"([^a-zA-Z]*\d)\s*[a-zA-Z][a-zA-Z\s.]*")
# Inputs that make sympy compute astronomically large numbers: long exponents or factorials, and
# power towers (9^{9^{9}}).
_RISKY = re.compile(r"\^\s*\{?\s*[-(]?\s*\d{3,}|\d{3,}\s*!|\^\s*\{?\s*\(?\s*\w+\s*\^")


# --- extraction


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`), braces matched; None if absent or unclosed."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def last_answer_tag(text: str) -> str | None:
    """Content of the last `<answer>...</answer>`, or None.

    NOTE: rfind, not a `<answer>(.*?)</answer>` regex: that one is quadratic on many unclosed tags."""
    end = text.rfind("</answer>")
    start = text.rfind("<answer>", 0, end) if end >= 0 else -1
    return text[start + len("<answer>") : end] if start >= 0 else None


def extract_answer(text: str, last_number_fallback: bool = False) -> str | None:
    """The final answer stated in `text` (forms 1-4 of the module docstring), stripped; None if none.
    An empty form (`\\boxed{}`, `<answer> </answer>`) states nothing and is skipped."""
    hashed = _HASH.findall(text)
    for found in (hashed[-1] if hashed else None, last_boxed(text), last_answer_tag(text)):
        if found is not None and found.strip():
            return found.strip()
    if last_number_fallback and (numbers := _NUMBER.findall(text)):
        return numbers[-1]
    return None


def extract_reference(reference: Any) -> str:
    """The reference answer as a string: a bare number, or forms 1-3 of a solution text, or the text."""
    if isinstance(reference, (int, float)) and not isinstance(reference, bool):
        return str(reference)
    text = str(reference)
    answer = extract_answer(text)
    return text.strip() if answer is None else answer


# --- equivalence


def to_number(answer: str) -> Fraction | None:
    """`answer` as an exact number, or None if it is not a plain number (after the normalisation
    listed in the module docstring)."""
    s = answer.strip()
    if len(s) > MAX_NUMBER_CHARS:
        return None
    s = s.replace("\\$", "").replace("$", "").replace("\\!", "").replace("\\%", "%").strip()
    s = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", s)  # thousands separators only: "1,234" but not "1,2"
    s = s.rstrip(".").removesuffix("%").strip()
    if m := _FRAC.fullmatch(s):
        s = f"{m[1]}{m[2]}/{m[3]}"
    if not _NUMERAL.fullmatch(s):
        if (m := _UNITS.fullmatch(answer.strip())) and m[1] != answer.strip():
            return to_number(m[1])
        return None
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


@functools.cache
def _quiet_math_verify() -> None:
    """Drop math_verify's 'Timeout is disabled' warning, which it logs on every call off the main thread."""
    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(lambda record: "Timeout is disabled" not in record.getMessage())


def symbolic_equal(answer: str, reference: str) -> bool:
    """math_verify equivalence of two LaTeX / plain expressions; False on any error or guard."""
    if not answer or any(len(s) > MAX_ANSWER_CHARS or _RISKY.search(s) for s in (answer, reference)):
        return False
    # NOTE: math_verify's timeouts use SIGALRM, which only the main thread may set; in a runner
    # thread they must be off (None), and the guards above are what keeps it from running long.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    _quiet_math_verify()
    try:
        from math_verify import parse, verify  # imported lazily: it pulls in sympy (~1 s)

        gold = parse(f"${reference}$", parsing_timeout=timeout)
        pred = parse(f"${answer}$", parsing_timeout=timeout)
        return bool(gold and pred and verify(gold, pred, timeout_seconds=timeout))
    except Exception:  # a crash in the checker must never crash the workflow: judged wrong
        return False


def is_equivalent(answer: str, reference: str) -> bool:
    """Exact numeric equality if both sides are numbers, else symbolic equivalence."""
    a, b = to_number(answer), to_number(reference)
    if a is not None and b is not None:
        return a == b
    return symbolic_equal(answer, reference)


# --- reward components


def accuracy_reward(response: str, reference: Any, *, last_number_fallback: bool = True) -> dict[str, float]:
    """{"accuracy": 1.0} if the response's final answer equals the reference's, else 0.0."""
    answer = extract_answer(response, last_number_fallback)
    correct = answer is not None and is_equivalent(answer, extract_reference(reference))
    return {"accuracy": 1.0 if correct else 0.0}


def format_reward(response: str, reference: Any = None, *, format_score: float = 0.1) -> dict[str, float]:
    """{"format_score": +format_score} if the response states a final answer (#### N, \\boxed{},
    <answer>), else -format_score. The reference is not used."""
    ok = extract_answer(response, last_number_fallback=False) is not None
    return {"format_score": format_score if ok else -format_score}


def math_reward(
    response: str, reference: Any, *, last_number_fallback: bool = True, format_score: float = 0.1
) -> dict[str, float]:
    """accuracy_reward + format_reward, as two components."""
    return {
        **accuracy_reward(response, reference, last_number_fallback=last_number_fallback),
        **format_reward(response, format_score=format_score),
    }


def random_reward(
    response: str, reference: Any, *, p: float = 0.5, seed: int = 0, draw_key: str = ""
) -> dict[str, float]:
    """The control for a learning claim: {"accuracy": 1.0} with probability `p`, whatever the response. A run
    trained on it that gains as much as one trained on the real reward was not taught by the reward.
    The draw is seeded by (seed, draw_key, reference, response): the workflows pass draw_key =
    "<taskset>/<epoch>/<task index>/<run>" (Workflow.reward), so a rerun of a control draws the same rewards."""
    return {"accuracy": float(random.Random(f"{seed}/{draw_key}/{reference}/{response}").random() < p)}


# --- workflow


@dataclasses.dataclass
class MathArgs(WorkflowArgs):
    """math_workflow's workflow_args."""

    last_number_fallback: bool | None = None
    """Passed to the reward function at each call (so it must be one that takes it: math_reward, accuracy_reward):
    whether the last number of a response without a stated answer counts as its answer. None: the reward
    function's own default (or its reward_fn_args)."""


class MathWorkflow(Workflow):
    """math_workflow: one chat call for the whole group, each response scored against task.reference."""

    default_reward_fn = "math_reward"
    Args = MathArgs

    def run(self) -> list[Experience]:
        task, args = self.task, self.args
        exps = self.model.chat(
            chat_messages(task), n=task.repeat_times, **chat_options(task), **sampling_kwargs(task.rollout_args)
        )
        extra = {} if args.last_number_fallback is None else {"last_number_fallback": args.last_number_fallback}
        for run, exp in enumerate(exps):
            apply_reward(exp, self.reward(exp.response_text, run, **extra))
        return exps
