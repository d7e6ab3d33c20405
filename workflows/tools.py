"""Tools a model may call in a multi-turn episode: parsing its `<tool_call>` blocks (the Hermes / Qwen format; the
other families': workflows/tool_parsers.py), and running each call in a worker process with a real timeout.

    calc = Tool("calculator", calculate, "Computes + - * /", {"type": "object", ...})   # calculate: module-level
    for call in parse_tool_calls(text):              # Qwen / Hermes `<tool_call>{"name":..,"arguments":{..}}`
        observation = run_tool([calc], call, timeout=10.0)   # "83", or "error: ..." (never an exception)

Model text is parsed as JSON, never evaluated; `<think>...</think>` blocks are dropped first (a call the model only
thought about is not made). A malformed call (JSON that does not parse, however it fails: nested too deeply, a
number too long), an unknown tool, wrong arguments, the tool's exception or no result within `timeout` seconds all
become an "error: ..." observation for the model. A result over tool_workers.MAX_RESULT_BYTES (16 KiB) is cut and
ends with "... [cut: result was N bytes, cap M]".

Each call runs in a worker process that is killed at the timeout (workflows/tool_workers.py: a thread cannot be
stopped). So a tool function must be importable by a worker: a module-level function (also one of a file named
`path/file.py:attr` in the YAML, or of a script), or a "module:attr" / "path/file.py:attr" string; a lambda or a
nested function is refused when the Tool is made (ToolError).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from workflows.tool_workers import WORKERS, get_attr

log = logging.getLogger("nanorft.tools")


class ToolError(ValueError):
    """A tool that cannot run in a worker process (its function is not importable)."""


@dataclasses.dataclass
class Tool:
    """A function the model may call: `fn(**arguments) -> str | number`; `parameters` is its JSON schema. `fn`: a
    module-level function or a "module:attr" / "path/file.py:attr" string (it runs in a worker process)."""

    name: str
    fn: Callable[..., Any] | str
    description: str
    parameters: dict
    ref: dict = dataclasses.field(init=False, repr=False)  # where a worker finds fn (reference())

    def __post_init__(self) -> None:
        self.ref = reference(self.fn, self.name)  # checked here: a lambda fails when the tool is made, not called

    def schema(self) -> dict:
        """The OpenAI / HF chat-template form (`tools=` of apply_chat_template)."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


@dataclasses.dataclass
class ToolCall:
    name: str
    arguments: dict
    error: str = ""  # why the call could not be read (then name / arguments are empty)


_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_THINK = re.compile(r"<think>.*?(?:</think>|$)", re.DOTALL)


def strip_thinking(text: str) -> str:
    """`text` without its `<think>...</think>` blocks (an unclosed one runs to the end), and without what comes
    before a `</think>` whose `<think>` was in the prompt (templates that open the block in the generation prompt)."""
    text = _THINK.sub("", text)
    return text.rsplit("</think>", 1)[-1]


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The `<tool_call>` blocks of an assistant turn outside its thinking, in order; a block that is not a JSON
    object with a string "name" and an object "arguments" is a ToolCall with `error` set. An unclosed
    `<tool_call>` is one too."""
    text, calls = strip_thinking(text), []
    for body in _CALL.findall(text):
        # NOTE: json.loads fails in more ways than JSONDecodeError ("[" * 1000: RecursionError; a 5000-digit number:
        # ValueError); each is the model's error, never an exception that would lose the task's whole group.
        try:
            obj = json.loads(body)
        except MemoryError:  # the process's trouble, not the model's
            raise
        except Exception as e:
            calls.append(ToolCall("", {}, unreadable(e)))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            calls.append(ToolCall("", {}, 'a tool call needs {"name": ..., "arguments": {...}}'))
        elif not isinstance(obj.get("arguments", {}), dict):
            calls.append(ToolCall("", {}, "the tool call's arguments must be a JSON object"))
        else:
            calls.append(ToolCall(obj["name"], obj.get("arguments", {})))
    if text.count("<tool_call>") > len(calls):
        calls.append(ToolCall("", {}, "a <tool_call> without its </tool_call>"))
    return calls


def unreadable(e: Exception) -> str:
    """Why json.loads could not read a tool call, as the model is told."""
    if isinstance(e, json.JSONDecodeError):
        return f"the tool call is not valid JSON ({e.msg})"
    if isinstance(e, RecursionError):
        return "the tool call's JSON is nested too deeply"
    return f"the tool call's JSON cannot be read ({type(e).__name__}: {str(e)[:200]})"


def tool_message(content: str, call_id: str = "", name: str = "") -> dict:
    """A tool's result as a chat message; `call_id` and `name`: the call it answers (Mistral's template renders the
    id, gpt-oss's the name of the last call)."""
    return {
        "role": "tool",
        "content": content,
        **({"tool_call_id": call_id} if call_id else {}),
        **({"name": name} if name else {}),
    }


def run_tool(tools: list[Tool], call: ToolCall, timeout: float = 10.0) -> str:
    """The result of one call as the text the model reads next, cut to MAX_RESULT_BYTES; every failure (a malformed
    call, an unknown tool, wrong arguments, an exception, no answer within `timeout` s, after which its worker's
    process group is killed) is an "error: ..." text."""
    start = time.monotonic()
    result = _run(tools, call, timeout)
    if log.isEnabledFor(logging.DEBUG):  # explore.py --debug shows them
        try:
            what = f"{call.name}({json.dumps(call.arguments)[:2000]})" if not call.error else "(unreadable call)"
        except (ValueError, TypeError, RecursionError):  # the model's arguments: nested too deeply to write back
            what = f"{call.name}(...)"
        log.debug("%s -> %s (%.2f s)", what, json.dumps(result[:2000]), time.monotonic() - start)
    return result


def _run(tools: list[Tool], call: ToolCall, timeout: float) -> str:
    if call.error:
        return f"error: {call.error}"
    known = {t.name: t for t in tools}
    if call.name not in known:
        return f"error: unknown tool {call.name!r}; available: {', '.join(sorted(known))}"
    out = WORKERS.call(known[call.name].ref, call.arguments, timeout)
    if "result" in out:
        return out["result"]
    if out.get("timeout"):
        return f"error: {call.name} gave no result within {timeout:g} s"
    return f"error: {out['error']}"


# --- where a tool's function lives


def reference(fn: Callable[..., Any] | str, name: str) -> dict:
    """How a worker finds `fn` (tool_workers.load_object): {"module", "file", "attr"}; "module" is "" for a file that
    was not imported by name (a `path/file.py:attr` of the YAML, a script run as __main__)."""
    if isinstance(fn, str):
        module, _, attr = fn.rpartition(":")
        if not module or not attr:
            raise ToolError(f"tool {name!r}: {fn!r} is not 'module:attr' nor 'path/file.py:attr'")
        if module.endswith(".py"):
            if not Path(module).is_file():
                raise ToolError(f"tool {name!r}: no file {module}")
            return {"module": "", "file": str(Path(module).resolve()), "attr": attr}
        try:
            spec = importlib.util.find_spec(module)
        except ImportError:
            spec = None
        if spec is None:
            raise ToolError(f"tool {name!r}: no module {module!r}")
        origin = spec.origin if spec.origin and spec.origin.endswith(".py") else ""
        return {"module": module, "file": origin, "attr": attr}
    module, attr = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or "<" in attr:  # <lambda>, <locals>
        raise ToolError(
            f"tool {name!r}: {attr or fn!r} is not a module-level function; a tool runs in a worker "
            "process, which imports it by name (define it at the top of a module, or give 'module:attr')"
        )
    file = getattr(getattr(fn, "__code__", None), "co_filename", "")
    if not file.endswith(".py") or not Path(file).is_file():
        raise ToolError(f"tool {name!r}: cannot tell which file defines {attr}")
    loaded = sys.modules.get(module)
    named = loaded is not None and get_attr(loaded, attr) is fn and module != "__main__"
    return {"module": module if named else "", "file": str(Path(file).resolve()), "attr": attr}
