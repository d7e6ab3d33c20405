"""Reading the tool calls out of a model's reply in its chat template's format (tool_workflow's `tool_parser`).

    parser = tool_parser(tokenizer, chat_template, "auto", schemas)   # once per task: the format of the template
    reply = parser.parse(text, raw, prefix)    # Reply(calls=[ToolCall(name, arguments, error)], content="...")
    reply = parser.parse_turn(episode)         # the same for an Episode's last turn (workflows/episode.py)

The formats, by the names of vLLM's `--tool-call-parser`:
  hermes       Qwen2.5, Qwen3, Hermes   <tool_call>{"name": "f", "arguments": {...}}</tool_call>
  llama3_json  Llama 3.1 / 3.2 / 3.3    {"name": "f", "parameters": {...}}   (<|python_tag|> before it optional)
  mistral      Mistral                  [TOOL_CALLS]f[ARGS]{...} (v11+ tokenizers, [CALL_ID]id optional);
                                        [TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...] (earlier ones)
  openai       gpt-oss (harmony)        <|channel|>commentary to=functions.f <|constrain|>json<|message|>{...}<|call|>
  qwen3_coder  Qwen3-Coder, Qwen3.5     <tool_call><function=f><parameter=x>1</parameter></function></tool_call>
  FILE.json    a response template of your own, in transformers' format (below)
`auto` (the default): the tokenizer's own response template (transformers 5: "response_template" in its
tokenizer_config.json, what `tokenizer.parse_response` reads) when the task renders with the tokenizer's chat
template; else the format whose marker the chat template in use holds (FORMAT_MARKERS: "<|channel|>" -> openai,
"[TOOL_CALLS]" -> mistral, "<function=" -> qwen3_coder, "<|start_header_id|>" -> llama3_json); else hermes. The
formats were read off vLLM's parsers (vllm/tool_parsers, vllm/parser) and the chat templates of those models
(tests/data/chat_templates: a test renders a call with each template and parses it back).

hermes is workflows/tools.py's parser (JSON in `<tool_call>` blocks outside `<think>`). The others are response
templates, transformers' declarative format (regions of the reply by their delimiters: thinking, content, tool
calls), parsed by transformers' own parser (`transformers.utils.chat_parsing.parse_response`, as
`tokenizer.parse_response` does) on the reply's text with its special tokens, after the prompt (`prefix`: the parser
starts after the template's last `start_anchor` in it). Their tool-call regions are kept as text and read here as
JSON (`json.JSONDecoder.raw_decode`: the first JSON value; what follows it is ignored, as vLLM's parsers do), so
that one malformed call is an error for the model while the others of the reply still run. A tokenizer's own
template may read a region as JSON itself: then one malformed call fails the whole reply, which becomes one call
whose error says so. Model text is parsed, never evaluated; whatever the parsers raise is an error for the model.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

# NOTE: transformers' chat_parsing is imported where it is used: the launcher imports workflows/ (for their args'
# checks) and would pay ~1 s of CPU at every start for a parser it never runs
from workflows.tools import ToolCall, parse_tool_calls, unreadable

if TYPE_CHECKING:
    from transformers.utils.chat_parsing.response_templates import ResponseTemplate

log = logging.getLogger("nanorft.tools")

_CALL = {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}}  # a region -> OpenAI's shape

# Response templates (transformers 5's format, `transformers.utils.chat_parsing`): the tool-call regions as text
# (read by `calls_of`), the answer as "content", reasoning as "thinking".
FORMATS: dict[str, dict | None] = {
    "hermes": None,  # workflows/tools.py's parse_tool_calls
    "llama3_json": {
        "defaults": {"role": "assistant"},
        "start_anchor": "<|start_header_id|>assistant<|end_header_id|>\n\n",
        "fields": {
            "tool_calls": {
                "open_pattern": r'\s*(?:<\|python_tag\|>)?\s*\{\s*"name"\s*:\s*"(?P<name>[^"]+)"\s*,\s*'
                r'"(?:parameters|arguments)"\s*:',
                "close_pattern": r"\}\s*(?:<\|eot_id\|>|<\|eom_id\|>|$)",  # the call object's own closing brace
                "repeats": True,
                "content": "text",
                "transform": _CALL,
            },
            "content": {"close_pattern": r"\s*(?:<\|eot_id\|>|<\|eom_id\|>)\s*", "content": "text"},
        },
    },
    "mistral": {
        "defaults": {"role": "assistant"},
        "start_anchor_pattern": r"\[/INST\]|\[/TOOL_RESULTS\]",
        "fields": {
            "thinking": {"open": "[THINK]", "close": "[/THINK]", "content": "text"},
            "tool_calls": {  # the name is "" before v11 ([TOOL_CALLS] [{...}, ...]): calls_of reads the list
                "open_pattern": r'\[TOOL_CALLS\](?P<name>[^\[\]{}\s"]*)(?:\[CALL_ID\][A-Za-z0-9]*)?(?:\[ARGS\])?',
                "close_pattern": r"(?=\[TOOL_CALLS\])|</s>|$",
                "repeats": True,
                "content": "text",
                "transform": _CALL,
            },
            "content": {"close_pattern": r"\s*</s>\s*", "content": "text"},
        },
    },
    "openai": {
        "defaults": {"role": "assistant"},
        "start_anchor": "<|start|>assistant",
        "fields": {
            "thinking": {"open": "<|channel|>analysis<|message|>", "close_pattern": r"<\|end\|>|$", "content": "text"},
            "tool_calls": {  # as the model writes it, or as the template renders it in history
                "open_pattern": r"(?:<\|channel\|>commentary\s+to=functions\.(?P<name>[^\s<]+)|\s*to=functions\."
                r"(?P<name>[^\s<]+)\s*<\|channel\|>commentary)[^<]*(?:<\|constrain\|>[^<]*)?<\|message\|>",
                "close_pattern": r"<\|call\|>|$",
                "repeats": True,
                "content": "text",
                "transform": _CALL,
            },
            "content": {
                "open": "<|channel|>final<|message|>",
                "close_pattern": r"(?:<\|return\|>|<\|end\|>)\s*|$",
                "content": "text",
            },
        },
    },
    "qwen3_coder": {
        "defaults": {"role": "assistant"},
        "start_anchor": "<|im_start|>assistant\n",
        "fields": {
            "thinking": {"open": "<think>", "close": "</think>", "content": "text"},
            "tool_calls": {  # the values are text; transformers types them by the tool's JSON schema
                "open_pattern": r"\s*<tool_call>\s*<function=(?P<name>[^>\n]+)>",
                "close_pattern": r"</function>\s*</tool_call>|$",
                "repeats": True,
                "content": "xml-inline",
                "content_args": {"tag_pattern": r"<parameter=(?P<key>[^>\n]+)>\n?(?P<value>.*?)\n?</parameter>"},
                "transform": _CALL,
            },
            "content": {"close_pattern": r"\s*(?:<\|im_end\|>|<\|endoftext\|>)\s*", "content": "text"},
        },
    },
}

FORMAT_MARKERS = (  # the chat template holds the marker -> its family's format; checked in this order
    ("<|channel|>", "openai"),
    ("[TOOL_CALLS]", "mistral"),
    ("<function=", "qwen3_coder"),
    ("<|start_header_id|>", "llama3_json"),
)


def known_parser(value: str) -> bool:
    """A valid workflow_args.tool_parser: auto, a FORMATS name or a .json file of a response template."""
    return value == "auto" or value in FORMATS or value.endswith(".json")


@dataclasses.dataclass
class Reply:
    calls: list[ToolCall]  # none: the reply is an answer
    content: str  # the answer's text (hermes: the reply's text as it is; with calls, the text before the first)


@dataclasses.dataclass
class ToolParser:
    """How one task's replies are read: `name` (a FORMATS name, "tokenizer" or a file), its response template
    (None: hermes) and the tools' JSON schemas (the template's parameter values are typed by them)."""

    name: str
    template: ResponseTemplate | None
    tools: list[dict]

    def parse(self, text: str, raw: str = "", prefix: str = "") -> Reply:
        """The calls of one reply: `text` as the engine decoded it (hermes reads it), `raw` with its special tokens
        (the end of turn left out) and the prompt before it, `prefix`, as decoded ids (the templates read those)."""
        if self.template is None:
            calls = parse_tool_calls(text)
            return Reply(calls, text[: text.find("<tool_call>")] if calls else text)
        from transformers.utils.chat_parsing import parse_response

        try:
            parsed = parse_response(raw, self.template, prefix=prefix, tools=self.tools or None)
            calls = [call for item in parsed.get("tool_calls") or [] for call in calls_of(item)]
        except MemoryError:  # the process's trouble, not the model's
            raise
        except Exception as e:  # model output: whatever the parser makes of it is an error for the model
            calls = [ToolCall("", {}, f"the reply's tool calls cannot be read ({type(e).__name__}: {str(e)[:300]})")]
            return Reply(calls, "")
        content = parsed.get("content") or ""
        return Reply(calls, content if isinstance(content, str) else json.dumps(content))

    def parse_turn(self, episode: Any, k: int = -1) -> Reply:
        """The calls of assistant turn k of a workflows.episode.Episode (its text, or its ids decoded with their
        special tokens after what came before it)."""
        if self.template is None:
            return self.parse(episode.texts[k])
        return self.parse(episode.texts[k], *episode.raw_text(k))


def tool_parser(tokenizer: Any, chat_template: str | None, setting: str, tools: list[dict]) -> ToolParser:
    """The parser of replies rendered with `chat_template` (None: the tokenizer's own), for workflow_args
    `setting` (see the module docstring); the choice is logged once per process."""
    own = None if chat_template else getattr(tokenizer, "response_template", None)
    if setting == "auto" and own is not None:
        name, template = "tokenizer", compiled(json.dumps(own, sort_keys=True))
    else:
        name = detect(chat_template or tokenizer.chat_template or "") if setting == "auto" else setting
        template = compiled(file_template(name) if name.endswith(".json") else name)
    _log_once(name, setting)
    return ToolParser(name, template, tools)


def detect(chat_template: str) -> str:
    """The FORMATS name of a chat template's family, by its markers; hermes when none is found."""
    return next((name for marker, name in FORMAT_MARKERS if marker in chat_template), "hermes")


@functools.cache
def file_template(path: str) -> str:
    """A response template file (JSON) as canonical JSON text; a ValueError naming the file if it is none."""
    from transformers.utils.chat_parsing.response_templates import load_response_template

    try:
        spec = json.loads(Path(path).read_text())
        load_response_template(spec)
    except (OSError, ValueError) as e:
        raise ValueError(f"tool_parser {path!r}: not a response template file ({e})") from None
    return json.dumps(spec, sort_keys=True)


@functools.cache
def compiled(key: str) -> ResponseTemplate | None:
    """A FORMATS name's template, or a template given as JSON text, loaded (its regexes compiled) once; None for
    hermes, which needs nothing of transformers (and so works with any version pyproject.toml allows)."""
    spec = FORMATS[key] if key in FORMATS else json.loads(key)
    if spec is None:
        return None
    try:
        from transformers.utils.chat_parsing.response_templates import load_response_template
    except ImportError:
        import transformers

        raise ValueError(
            f"tool_parser {key if key in FORMATS else 'of the tokenizer'}: reading this format needs transformers' "
            f"response templates (transformers.utils.chat_parsing), which transformers {transformers.__version__} "
            "does not have: upgrade transformers, or use tool_parser: hermes"
        ) from None
    return load_response_template(spec)


@functools.cache
def _log_once(name: str, setting: str) -> None:
    how = "the tokenizer's response_template" if name == "tokenizer" else name
    log.info("tool calls are read as %s (workflow_args.tool_parser: %s)", how, setting)


# --- the tool-call regions of a parsed reply -> ToolCalls


def calls_of(item: Any) -> list[ToolCall]:
    """One parsed tool-call region as ToolCalls: {"function": {"name", "arguments"}} with the arguments as an
    object or its JSON text; {"function": JSON text of {"name", "arguments"}} (a template that captures the whole
    call), or a call without a name whose arguments are such JSON: one call or a list of them (Mistral before v11);
    the region's own value when it has no "function" (a template without a transform): {"name", "arguments"} or
    its JSON text."""
    fn = item.get("function", item) if isinstance(item, dict) else item  # a template without a transform: as it is
    if isinstance(fn, dict) and fn.get("name"):
        name, arguments = fn["name"], fn.get("arguments", fn.get("parameters", {}))
        if isinstance(arguments, str):
            arguments, error = first_json(arguments)
            if error:
                return [ToolCall("", {}, error)]
        return [checked(name, arguments)]
    if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
        fn = fn["arguments"]
    if not isinstance(fn, str):
        return [ToolCall("", {}, 'a tool call needs {"name": ..., "arguments": {...}}')]
    value, error = first_json(fn)
    if error:
        return [ToolCall("", {}, error)]
    return [enveloped(v) for v in (value if isinstance(value, list) else [value])]


def enveloped(value: Any) -> ToolCall:
    """A call given as one JSON object {"name": ..., "arguments" (or "parameters"): {...}}."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return ToolCall("", {}, 'a tool call needs {"name": ..., "arguments": {...}}')
    return checked(value["name"], value.get("arguments", value.get("parameters", {})))


def checked(name: Any, arguments: Any) -> ToolCall:
    if not isinstance(name, str) or not name:
        return ToolCall("", {}, "a tool call needs a name")
    if not isinstance(arguments, dict):
        return ToolCall("", {}, "the tool call's arguments must be a JSON object")
    return ToolCall(name, arguments)


def first_json(text: str) -> tuple[Any, str]:
    """(the first JSON value of `text`, "") or (None, why it cannot be read); empty text is {} (no arguments)."""
    text = text.strip()
    if not text:
        return {}, ""
    # NOTE: as in tools.parse_tool_calls: json fails in more ways than JSONDecodeError (RecursionError, ValueError)
    try:
        return json.JSONDecoder().raw_decode(text)[0], ""
    except MemoryError:
        raise
    except Exception as e:
        return None, unreadable(e)
