"""tool_workflow: multi-turn episodes in which the model may call tools before it answers, and the calculator.

Each of the task's `repeat_times` episodes (workflows/episode.py) runs turn by turn, all episodes' turns sent to the
engine together: the model replies; the tool calls in its reply, in its chat template's format (Hermes / Qwen
`<tool_call>`, Llama 3, Mistral, gpt-oss, Qwen3-Coder: workflows/tool_parsers.py), are run and their results come
back as tool messages; a reply without a tool call is the answer, scored by the reward function against the
reference (an episode that ends on a tool call, at max_turns or cut off, is scored as no answer, ""). One
experience per episode (its action mask covers the model's own tokens only), or with `workflow_args.step_wise`
one per turn, each carrying the episode's reward (for step_wise_grpo).

A tool is a name in TOOLS below, or a function of your own named in the YAML, `path/file.py:function` or
`module:function`, with no edit here: its name, description and parameters' JSON schema come from its signature
and docstring (transformers.utils.get_json_schema: a type hint on each parameter, a Google-style docstring with
an `Args:` line for each):

    def get_weather(city: str, days: int = 1) -> str:      # my_tools.py, anywhere
        '''Gets the weather forecast.

        Args:
            city: The city's name.
            days: How many days ahead.
        '''
    workflow_args: {tools: [calculator, my_tools.py:get_weather]}

Worked example (tools ["calculator"], reward_fn math_reward, reference "#### 83"):
    user       What is 37 + 58 - 12?
    assistant  <tool_call>{"name": "calculator", "arguments": {"expression": "37 + 58 - 12"}}</tool_call>
    tool       83
    assistant  #### 83                       -> reward 1.1 ({"accuracy": 1.0, "format_score": 0.1}), 2 turns

workflow_args: ToolArgs below (tools, tool_parser, max_turns, step_wise, tool_timeout, mask_truncated,
system_prompt). A tool schema of the taskset (format.tools_key) that no registered function runs reaches the chat
template; a warning names it once, and a call to it gets an "unknown tool" error.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
from typing import Any, ClassVar

import workflows  # NOTE: the package, still being initialised when it imports this module: load_object at call time
from buffer import Experience
from configs.checks import AT_LEAST_1, SECONDS
from workflows import Workflow, WorkflowArgs, apply_reward, chat_messages, sampling_kwargs
from workflows.calculator import calculate
from workflows.episode import Episode, reply_all
from workflows.tool_parsers import FORMATS, file_template, known_parser, tool_parser
from workflows.tools import Tool, ToolCall, ToolError, run_tool, tool_message

log = logging.getLogger("nanorft.tool_use")
_WARNED: set[str] = set()  # tool names warned about, once per process

CALCULATOR = Tool(
    "calculator",
    calculate,
    "Computes an arithmetic expression (numbers, + - * / and parentheses).",
    {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
)
TOOLS: dict[str, Tool] = {"calculator": CALCULATOR}  # name -> Tool (or name a function in the YAML: no edit here)


@dataclasses.dataclass
class ToolArgs(WorkflowArgs):
    """tool_workflow's workflow_args."""

    RANGES: ClassVar = {
        "tools": (
            lambda v: all(name in TOOLS or ":" in name for name in v),
            f"names of known tools (TOOLS: {', '.join(sorted(TOOLS))}) or functions, 'module:function' / "
            "'path/file.py:function'",
        ),
        "tool_parser": (known_parser, f"auto, {', '.join(FORMATS)} or a response template's .json file"),
        "max_turns": AT_LEAST_1,
        "tool_timeout": SECONDS,
    }
    tools: list[str] = dataclasses.field(default_factory=lambda: ["calculator"])
    """The tools the model may call: names in TOOLS, or functions of your own, `module:function` or
    `path/file.py:function` (the schema from the signature and docstring); their schemas reach the chat template."""
    tool_parser: str = "auto"
    """How tool calls are read from a reply (workflows/tool_parsers.py): auto (the tokenizer's response template, else
    the chat template's family), hermes, llama3_json, mistral, openai (gpt-oss), qwen3_coder, or a .json file of a
    response template (transformers' format)."""
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
    """tool_workflow (Trinity's multi-turn workflows, tool calls in the chat template's format)."""

    default_reward_fn = "math_reward"
    Args = ToolArgs

    @classmethod
    def load_user_code(cls, args: ToolArgs) -> None:
        """The tools' functions and the tool_parser file, loaded when the explorer starts (a ToolError naming them)."""
        load_tools(tuple(args.tools))
        if args.tool_parser.endswith(".json"):
            file_template(args.tool_parser)

    def run(self) -> list[Experience]:
        task, args = self.task, self.args
        tools = load_tools(tuple(args.tools))
        schemas = [*(t.schema() for t in tools), *(task.tools or [])]  # the taskset's own (format.tools_key) too
        warn_unrun(task.tools or [], tools)
        parser = tool_parser(self.model.tokenizer, task.chat_template or None, args.tool_parser, schemas)
        episodes = [
            Episode(self.model, chat_messages(task), schemas, args.max_turns, task.chat_template or None)
            for _ in range(task.repeat_times)
        ]
        calls, answers = [0] * len(episodes), [""] * len(episodes)
        while not all(e.done for e in episodes):
            for k, (e, text) in enumerate(zip(episodes, reply_all(episodes, **sampling_kwargs(task.rollout_args)))):
                if text is None:
                    continue
                reply = parser.parse_turn(e)
                answers[k] = "" if reply.calls else reply.content  # the numbers of a call are no answer
                if e.done:  # at max_turns or cut off: its calls are not run
                    continue
                if not reply.calls:
                    e.finish()  # the answer
                    continue
                e.add(*tool_results(reply.calls, tools, args.tool_timeout, calls[k]))
                calls[k] += len(reply.calls)
        return [exp for k, e in enumerate(episodes) for exp in self.score(e, answers[k], calls[k], k)]

    def score(self, episode: Episode, answer: str, calls: int, k: int) -> list[Experience]:
        """Episode k's experience(s), rewarded for its answer ("" if it ended on a tool call); info["episode"] = k
        ties the turns of one episode together (step_wise_grpo)."""
        args = self.args
        components = self.reward(answer, k)
        mask = args.mask_truncated
        exps = episode.turn_experiences(mask) if args.step_wise else [episode.experience(mask)]
        for exp in exps:
            apply_reward(exp, components)
            exp.metrics.update({"tool_calls": float(calls), "turns": float(len(episode.turns))})
            exp.info["episode"] = k
        return exps


def tool_results(calls: list[ToolCall], tools: list[Tool], timeout: float, before: int = 0) -> tuple[list, list]:
    """A reply's calls run, each in a worker process: (the tool messages, the calls as the assistant turn's
    tool_calls in OpenAI's shape), Episode.add's two arguments. Ids "call00000", "call00001", ... counted from the
    episode's calls `before` (nine characters: Mistral's templates refuse others)."""
    ids = [f"call{before + i:05d}" for i in range(len(calls))]
    messages = [tool_message(run_tool(tools, c, timeout), i, c.name) for c, i in zip(calls, ids)]
    return messages, [
        {"id": i, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c, i in zip(calls, ids)
    ]


# --- the tools


@functools.cache
def load_tools(names: tuple[str, ...]) -> list[Tool]:
    """The tools of workflow_args.tools: TOOLS' own, and functions named `module:function` / `path/file.py:function`
    (function_tool); a ToolError names a function that does not load, or two tools of one name."""
    tools = [TOOLS[name] if name in TOOLS else function_tool(name) for name in names]
    seen: dict[str, str] = {}
    for name, tool in zip(names, tools):
        if tool.name in seen:
            raise ToolError(f"tools {seen[tool.name]!r} and {name!r} are both named {tool.name!r}")
        seen[tool.name] = name
    return tools


@functools.cache
def function_tool(spec: str) -> Tool:
    """The tool of the function `spec` names (`module:function` or `path/file.py:function`, imported here, as a
    workflow named so is: the config is trusted): its name, description and parameters from its signature and
    docstring (transformers.utils.get_json_schema); it runs in a worker process, which loads it by the same name."""
    try:
        fn: Any = workflows.load_object(spec, "tool")
    except KeyError as e:
        raise ToolError(e.args[0]) from None
    # NOTE: imported here, as the explorer loads its tools: the launcher imports workflows/ and never needs it
    from transformers.utils.chat_template_utils import (
        DocstringParsingException,
        TypeHintParsingException,
        get_json_schema,
    )

    if not inspect.isfunction(fn):  # NOTE: builtins:eval or subprocess's classes would run the model's text
        raise ToolError(f"tool {spec!r} is not a Python function (builtins and classes are refused)")
    try:
        schema = get_json_schema(fn)["function"]
    except (DocstringParsingException, TypeHintParsingException) as e:
        raise ToolError(
            f"tool {spec!r}: its JSON schema comes from its signature and docstring (a type hint on each "
            f"parameter, a Google-style docstring with an 'Args:' line for each): {e}"
        ) from None
    return Tool(schema["name"], spec, schema.get("description", ""), schema["parameters"])


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
