"""Multi-turn episodes, token in / token out, and tool calls.

    ep = Episode(model, messages, tools=[CALCULATOR], max_turns=4)
    while not ep.done:
        text = ep.reply(temperature=1.0, max_tokens=64)      # one assistant turn, sampled from the exact ids so far
        calls = parse_tool_calls(text)
        if not calls:
            break                                             # an answer: the episode ends
        ep.add([tool_message(run_tool([CALCULATOR], c)) for c in calls])
    exp = ep.experience()           # one experience: the first prompt, then every turn; action_mask = the model's
    turns = ep.turn_experiences()   # or one per assistant turn (step-wise algorithms)

Why tokens and not text: re-rendering a conversation and tokenising it again at every turn loses the ids the
model sampled (the same text can tokenise otherwise) and, with templates that rewrite history (Qwen3 drops the
`<think>` blocks of earlier turns), even the text: the trainer would score tokens the model never produced. Here
the context only grows: an assistant turn appends the sampled ids and log-probs as they came, the template's
closing of the turn (e.g. "\\n" after <|im_end|>) and each tool / user message append the template's rendering
of just those messages, found as the difference between rendering [user "?"] and [user "?"] + new. Tokens the
model did not sample (closings, tool and user turns) have action_mask False: never trained on.

An episode ends on `finish()`, after `max_turns` assistant turns, or at the context limit (the model's
max_model_len): a turn cut at its max_tokens or a message that does not fit ends it "response_truncated".
Tool calls are Qwen / Hermes-style `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` JSON in the
model's text, run by registered Python functions with a timeout; model text is parsed, never evaluated, and a
malformed or failing call becomes an error message for the model, not an exception.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import re
from typing import Any, Callable

import torch

from buffer import Experience
from engines import scored_temperature

_PROBE = [{"role": "user", "content": "?"}]  # a conversation to render new messages after
_MARK = "\x00MARK\x00"  # a string no template writes


@dataclasses.dataclass
class Tool:
    """A function the model may call: `fn(**arguments) -> str | number`; `parameters` is its JSON schema."""

    name: str
    fn: Callable[..., Any]
    description: str
    parameters: dict

    def schema(self) -> dict:
        """The OpenAI / HF chat-template form (`tools=` of apply_chat_template)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclasses.dataclass
class ToolCall:
    name: str
    arguments: dict
    error: str = ""  # why the call could not be read (then name / arguments are empty)


_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The `<tool_call>` blocks of an assistant turn, in order; a block that is not a JSON object with a string
    "name" and an object "arguments" is a ToolCall with `error` set. An unclosed `<tool_call>` is one too."""
    calls = []
    for body in _CALL.findall(text):
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append(ToolCall("", {}, f"the tool call is not valid JSON ({e.msg})"))
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


_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="tool")


def run_tool(tools: list[Tool], call: ToolCall, timeout: float = 10.0) -> str:
    """The result of one call as the text the model reads next; every failure (a malformed call, an unknown tool,
    wrong arguments, an exception, no answer within `timeout` s) is an "error: ..." text.
    NOTE: a tool that never returns keeps its pool thread busy; the episode goes on without it."""
    if call.error:
        return f"error: {call.error}"
    known = {t.name: t for t in tools}
    if call.name not in known:
        return f"error: unknown tool {call.name!r}; available: {', '.join(sorted(known))}"
    future = _POOL.submit(known[call.name].fn, **call.arguments)
    try:
        return str(future.result(timeout=timeout))
    except concurrent.futures.TimeoutError:
        return f"error: {call.name} gave no result within {timeout:g} s"
    except Exception as e:  # the tool's own failure (bad arguments included) is the model's observation
        return f"error: {type(e).__name__}: {e}"


def tool_message(content: str) -> dict:
    return {"role": "tool", "content": content}


class Episode:
    """One conversation between the model and an environment, kept as token ids (see the module docstring).
    `model`: the workflow's ModelHandle; `tools`: Tool objects or JSON tool schemas (e.g. a taskset's
    format.tools_key column), which reach the chat template."""

    def __init__(self, model: Any, messages: list[dict], tools: list[Tool | dict] | None = None, max_turns: int = 8,
                 chat_template: str | None = None) -> None:
        self.model, self.max_turns, self.template = model, max_turns, chat_template
        self.tools = [t.schema() if isinstance(t, Tool) else t for t in tools or []] or None
        self.messages = list(messages)
        self.ids = model.tokenizer.encode(self._render(self.messages), add_special_tokens=False)
        self.prompt_length = len(self.ids)
        self.logprobs: list[float] = []  # one per token after the prompt (0 where the model did not sample)
        self.mask: list[bool] = []  # True where the model sampled the token
        self.turns: list[tuple[int, int]] = []  # [start, end) of each assistant turn's sampled tokens in self.ids
        self.versions: list[int] = []
        self.done, self.truncated, self.temperature = False, False, 1.0
        self.closing = self._closing()

    def _render(self, messages: list[dict], generation: bool = True) -> str:
        return self.model.render(messages, self.tools, self.template, generation)

    def _closing(self) -> list[int]:
        """The ids the template writes after an assistant message's content (e.g. <|im_end|> "\\n")."""
        text = self._render(_PROBE + [{"role": "assistant", "content": _MARK}], generation=False)
        return self.model.tokenizer.encode(text[text.index(_MARK) + len(_MARK):], add_special_tokens=False)

    def room(self) -> int:
        """Tokens left before the context limit (a large number without one)."""
        limit = self.model.max_model_len
        return limit - len(self.ids) if limit else 1 << 30

    def reply(self, **sampling: Any) -> str:
        """Sample the next assistant turn (n = 1) and append it; its text."""
        return self.record(self.request(**sampling).result())

    def request(self, **sampling: Any) -> concurrent.futures.Future:
        """Submit the next assistant turn (record() its completion): lets a workflow run its episodes' turns in
        one batch (`reply_all`)."""
        if self.done:
            raise RuntimeError("the episode is over")
        params = self.model.params(1, **sampling)
        params.max_tokens = min(params.max_tokens, self.room())  # add() leaves at least one token of room
        self.temperature = scored_temperature(params)
        return self.model.submit(self.ids, params)

    def record(self, completions: list) -> str:
        """Append a sampled turn (engines.Completion): its ids and log-probs, then the template's closing."""
        c = completions[0]
        start = len(self.ids)
        self.ids += c.token_ids
        self.logprobs += c.logprobs
        self.mask += [True] * len(c.token_ids)
        self.turns.append((start, len(self.ids)))
        self.versions.append(c.model_version)
        self.messages.append({"role": "assistant", "content": c.text})
        if c.truncated:  # cut at max_tokens or at the context limit: nothing after it would be a real turn
            self.done = self.truncated = True
            return c.text
        closing = self.closing[1:] if self.closing[:1] == c.token_ids[-1:] else self.closing  # EOS already there
        self._append(closing)
        if self.room() < 1:  # the closing filled the context: no room for another turn
            self.done = self.truncated = True
        self.done = self.done or len(self.turns) >= self.max_turns
        return c.text

    def add(self, messages: list[dict]) -> None:
        """Append tool / user / environment messages, rendered by the template after the conversation, with the
        next assistant turn's generation prompt; an episode they would push past the context limit ends
        truncated instead."""
        if self.done:
            raise RuntimeError("the episode is over")
        before, after = self._render(_PROBE, generation=False), self._render(_PROBE + list(messages))
        if not after.startswith(before):
            raise ValueError("the chat template renders earlier messages differently once new ones follow; "
                             "multi-turn episodes need a template that only appends")
        ids = self.model.tokenizer.encode(after[len(before):], add_special_tokens=False)
        if len(ids) >= self.room():  # no token left for the model's reply
            self.done = self.truncated = True
            return
        self.messages += messages
        self._append(ids)

    def _append(self, ids: list[int]) -> None:
        self.ids += ids
        self.logprobs += [0.0] * len(ids)
        self.mask += [False] * len(ids)

    def finish(self) -> None:
        self.done = True

    def experience(self) -> Experience:
        """The whole episode as one experience: prompt = the first prompt, response = every later token,
        action_mask = the assistant's sampled tokens. model_version: the oldest weights that sampled a turn."""
        P = self.prompt_length
        return Experience(tokens=torch.tensor(self.ids, dtype=torch.long), prompt_length=P,
                          logprobs=torch.tensor(self.logprobs, dtype=torch.float32),
                          action_mask=torch.tensor(self.mask, dtype=torch.bool),
                          model_version=min(self.versions, default=0), truncate_status=self._status(),
                          prompt_text=self.model.tokenizer.decode(self.ids[:P]),
                          response_text=self.model.tokenizer.decode(self.ids[P:]),
                          info={"temperature": self.temperature, "turns": len(self.turns)})

    def turn_experiences(self) -> list[Experience]:
        """One experience per assistant turn: prompt = everything before the turn, response = the turn's tokens."""
        out = []
        for k, (a, b) in enumerate(self.turns):
            out.append(Experience(tokens=torch.tensor(self.ids[:b], dtype=torch.long), prompt_length=a,
                                  logprobs=torch.tensor(self.logprobs[a - self.prompt_length:b - self.prompt_length]),
                                  model_version=self.versions[k], response_text=self.messages_text(k),
                                  truncate_status=self._status() if k == len(self.turns) - 1 else None,
                                  info={"temperature": self.temperature, "turn": k, "turns": len(self.turns)}))
        return out

    def messages_text(self, k: int) -> str:
        """The text of assistant turn k."""
        return [m for m in self.messages if m["role"] == "assistant"][k]["content"]

    def _status(self) -> str | None:
        return "response_truncated" if self.truncated else None


def reply_all(episodes: list[Episode], **sampling: Any) -> list[str | None]:
    """The next turn of every episode not done, submitted together (one engine batch); None for those done."""
    futures = [None if e.done else e.request(**sampling) for e in episodes]
    return [None if f is None else e.record(f.result()) for e, f in zip(episodes, futures)]
