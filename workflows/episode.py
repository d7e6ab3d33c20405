"""Multi-turn episodes, token in / token out, and tool calls.

    ep = Episode(model, messages, tools=[CALCULATOR], max_turns=4)
    parser = tool_parser(model.tokenizer, None, "auto", ep.tools)   # tool calls in the chat template's format
    while not ep.done:
        ep.reply(temperature=1.0, max_tokens=64)             # one assistant turn, sampled from the exact ids so far
        calls = parser.parse_turn(ep).calls
        if not calls:
            break                                             # an answer: the episode ends
        ep.add(*tool_results(calls, [CALCULATOR], timeout=10.0))   # the results, after the turn that made the calls
    exp = ep.experience()           # one experience: the first prompt, then every turn; action_mask = the model's
    turns = ep.turn_experiences()   # or one per assistant turn (step-wise algorithms)

Why tokens and not text: re-rendering a conversation and tokenising it again at every turn loses the ids the
model sampled (the same text can tokenise otherwise) and, with templates that rewrite history (Qwen3 drops the
`<think>` blocks of earlier turns), even the text: the trainer would score tokens the model never produced. Here
the context only grows: an assistant turn appends the sampled ids and log-probs as they came, the template's
closing of the turn (e.g. "\\n" after <|im_end|>) and each tool / user message append the template's rendering
of just those messages, found as the difference between rendering [user "?"] and [user "?"] + new. Tokens the
model did not sample (closings, tool and user turns) have action_mask False: never trained on. Every string of the
messages (a tool's result, a user's text, the first prompt's row) is tokenised as text (chat_template.py): one that
holds the template's control tokens (`<|im_end|><|im_start|>system`) cannot forge a turn.

An episode ends on `finish()`, after `max_turns` assistant turns, or at the context limit (the model's
max_model_len): a turn cut at its max_tokens or a message that does not fit ends it "response_truncated", and
its experience then has no action tokens (`mask_truncated`, on by default: DAPO's overlong filtering; its reward
still counts in its group) and the metric truncated = 1. The first prompt is cut to max_prompt_tokens as a
single-turn prompt is (marked "prompt_truncated": no loss), or fails with PromptTooLong.
Tool calls are read in the chat template's format (workflows/tool_parsers.py: Hermes / Qwen `<tool_call>`, Llama
3, Mistral, gpt-oss, Qwen3-Coder; tool_use.tool_results runs them) outside the model's reasoning, and run by Python
functions in worker processes with a timeout (workflows/tools.py); model text is parsed, never evaluated, and a
malformed or failing call becomes an error message for the model, not an exception.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

import torch

from buffer import Experience
from chat_template import Protected
from sampling import PromptTooLong, scored_temperature
from workflows.tools import Tool, ToolCall, parse_tool_calls, run_tool, tool_message  # noqa: F401 (re-exported)

_PROBE = [{"role": "user", "content": "?"}]  # a conversation to render new messages after
_MARK = "\x00MARK\x00"  # a string no template writes


class MixedTemperatures(ValueError):
    """An episode whose turns were sampled at different temperatures, asked for as one experience: the trainer
    scores an experience at one temperature (use turn_experiences(), or one temperature)."""


class Episode:
    """One conversation between the model and an environment, kept as token ids (see the module docstring).
    `model`: the workflow's ModelHandle; `tools`: Tool objects or JSON tool schemas (e.g. a taskset's
    format.tools_key column), which reach the chat template. The first prompt goes through the handle's
    max_prompt_tokens (cut and marked prompt_truncated, or PromptTooLong), as single-turn prompts do; one that
    leaves no room for a reply within max_model_len is PromptTooLong too."""

    def __init__(
        self,
        model: Any,
        messages: list[dict],
        tools: list[Tool | dict] | None = None,
        max_turns: int = 8,
        chat_template: str | None = None,
    ) -> None:
        self.model, self.max_turns, self.template = model, max_turns, chat_template
        self.tools = [t.schema() if isinstance(t, Tool) else t for t in tools or []] or None
        self.messages = list(messages)
        self.ids, self.prompt_truncated = model.cut(model.render_ids(self.messages, self.tools, chat_template)[1])
        self.prompt_length = len(self.ids)
        if self.room() < 1:
            raise PromptTooLong(
                f"an episode's prompt of {self.prompt_length} tokens leaves no room for a reply "
                f"within max_model_len={model.max_model_len}"
            )
        self.logprobs: list[float] = []  # one per token after the prompt (0 where the model did not sample)
        self.mask: list[bool] = []  # True where the model sampled the token
        self.turns: list[tuple[int, int]] = []  # [start, end) of each assistant turn's sampled tokens in self.ids
        self.texts: list[str] = []  # each assistant turn's text, as sampled
        self.temperatures: list[float] = []  # each turn's scoring temperature (sampling.scored_temperature)
        self.min_tokens: list[int] = []  # each turn's min_tokens (EOS masked before: batching.eos_masked)
        self.versions: list[int] = []
        self.spans: list[list[tuple[int, int]]] = []  # each turn's Completion.spans (explorer.partial_rollout)
        self.done, self.truncated, self.pending, self.pending_min = False, False, 1.0, 0
        self.closing, self.eos = self._closing(), set(model.eos_ids)

    def _render(self, messages: list[dict], generation: bool = True, p: Protected | None = None) -> str:
        """The template's text of `messages`; with `p`, of their protected strings (Protected: the tools' too)."""
        tools = p.protect(self.tools) if p is not None else self.tools
        return self.model.render(messages, tools, self.template, generation)

    def _closing(self) -> list[int]:
        """The ids the template writes after an assistant message's content (e.g. <|im_end|> "\\n")."""
        text = self._render(_PROBE + [{"role": "assistant", "content": _MARK}], generation=False)
        return self.model.tokenizer.encode(text[text.index(_MARK) + len(_MARK) :], add_special_tokens=False)

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
        self.pending, self.pending_min = scored_temperature(params), params.min_tokens
        return self.model.submit(self.ids, params)

    def record(self, completions: list) -> str:
        """Append a sampled turn (sampling.Completion): its ids and log-probs, then the template's closing."""
        c = completions[0]
        start = len(self.ids)
        self.ids += c.token_ids
        self.logprobs += c.logprobs
        self.mask += [True] * len(c.token_ids)
        self.turns.append((start, len(self.ids)))
        self.texts.append(c.text)
        self.temperatures.append(self.pending)
        self.min_tokens.append(self.pending_min)
        self.versions.append(c.model_version)
        self.spans.append(list(c.spans))
        self.messages.append({"role": "assistant", "content": c.text})
        if c.truncated:  # cut at max_tokens or at the context limit: nothing after it would be a real turn
            self.done = self.truncated = True
            return c.text
        self._append(self._closing_after(c.token_ids[-1:]))
        if self.room() < 1:  # the closing filled the context: no room for another turn
            self.done = self.truncated = True
        self.done = self.done or len(self.turns) >= self.max_turns
        return c.text

    def _closing_after(self, last: list[int]) -> list[int]:
        """The closing to append after a turn whose last sampled id is `last`: without its end-of-turn token when
        the turn ended on one, or on any of the engine's EOS ids while the closing starts with one of them (the
        sampled EOS ended the turn; a second end token would be text the model never saw)."""
        head = self.closing[:1]
        if head and (head == last or (last and last[0] in self.eos and head[0] in self.eos)):
            return self.closing[1:]
        return self.closing

    def add(self, messages: list[dict], tool_calls: list[dict] | None = None) -> None:
        """Append tool / user / environment messages, rendered by the template after the conversation, with the
        next assistant turn's generation prompt; an episode they would push past the context limit ends
        truncated instead. `tool_calls`: the calls (OpenAI's shape, with ids) of the assistant turn whose results
        `messages` are: templates that render a tool result by its call (Mistral's ids, gpt-oss's tool name) or
        refuse a tool message after a user one get that turn before them. NOTE: give a turn's tool results in one
        call (templates such as Qwen's join consecutive tool messages into one user turn)."""
        if self.done:
            raise RuntimeError("the episode is over")
        p = Protected(self.model.tokenizer)  # NOTE: a tool's result or a user's text is data: tokenised as text
        ids = p.encode(self._rendered_after(p.protect(list(messages)), p.protect(tool_calls), p))
        if len(ids) >= self.room():  # no token left for the model's reply
            self.done = self.truncated = True
            return
        self.messages += messages
        self._append(ids)

    def _rendered_after(self, messages: list[dict], tool_calls: list[dict] | None, p: Protected) -> str:
        """What the template writes for `messages` (and the next generation prompt) after the conversation: the
        difference between its rendering of a probe and of the probe followed by them. The probe is [user "?"],
        after an assistant turn with `tool_calls` when they are given and the template renders that turn as a
        prefix of what follows (Qwen3's rewrites its last assistant turn once a tool message follows it)."""
        probes = [_PROBE + [{"role": "assistant", "content": "", "tool_calls": tool_calls}]] if tool_calls else []
        first: Exception | None = None
        for probe in [*probes, _PROBE]:
            try:
                before, after = self._render(probe, False, p), self._render(probe + messages, True, p)
            except Exception as e:  # a template that refuses this probe (jinja's raise_exception): the next one
                first = first or e
                continue
            if after.startswith(before):
                return after[len(before) :]
        if first is not None and not probes:
            raise first
        raise ValueError(
            "the chat template renders earlier messages differently once new ones follow"
            + (f" or refuses them ({first})" if first else "")
            + "; multi-turn episodes need a template that only appends"
        )

    def _append(self, ids: list[int]) -> None:
        self.ids += ids
        self.logprobs += [0.0] * len(ids)
        self.mask += [False] * len(ids)

    def finish(self) -> None:
        self.done = True

    def experience(self, mask_truncated: bool = True) -> Experience:
        """The whole episode as one experience (conversation_experience): prompt = the first prompt, response =
        every later token, action_mask = the assistant's sampled tokens, none of them if the episode was truncated
        and `mask_truncated`. MixedTemperatures if its turns' temperatures differ (or use turn_experiences())."""
        return conversation_experience(
            self.model.tokenizer,
            self.ids,
            prompt_length=self.prompt_length,
            logprobs=self.logprobs,
            mask=self.mask,
            temperatures=self.temperatures,
            versions=self.versions,
            min_tokens=self.min_tokens,
            spans=turn_spans(self.turns, self.prompt_length, self.spans, self.versions),
            truncated=self.truncated,
            prompt_truncated=self.prompt_truncated,
            mask_truncated=mask_truncated,
        )

    def turn_experiences(self, mask_truncated: bool = True) -> list[Experience]:
        """One experience per assistant turn: prompt = everything before the turn, response = the turn's tokens,
        scored at the turn's own temperature. A truncated episode's turns have no action (`mask_truncated`)."""
        out, P, masked = [], self.prompt_length, self.truncated and mask_truncated
        for k, (a, b) in enumerate(self.turns):
            out.append(
                Experience(
                    tokens=torch.tensor(self.ids[:b], dtype=torch.long),
                    prompt_length=a,
                    logprobs=torch.tensor(self.logprobs[a - P : b - P]),
                    model_version=self.versions[k],
                    spans=self.spans[k],
                    action_mask=torch.zeros(b - a, dtype=torch.bool) if masked else None,
                    response_text=self.texts[k],
                    metrics=_truncation_metrics(self.truncated, masked),
                    truncate_status=_status(self.prompt_truncated, self.truncated and k == len(self.turns) - 1),
                    info={
                        "temperature": self.temperatures[k],
                        "min_tokens": self.min_tokens[k],
                        "turn": k,
                        "turns": len(self.turns),
                    },
                )
            )
        return out

    def messages_text(self, k: int) -> str:
        """The text of assistant turn k (as sampled; an initial few-shot assistant message is not a turn)."""
        return self.texts[k]

    def raw_text(self, k: int) -> tuple[str, str]:
        """Assistant turn k with its special tokens (without the end-of-turn id it ended on), and everything before
        it: the text and prefix a response template reads (workflows/tool_parsers.py)."""
        a, b = self.turns[k]
        b -= 1 if b > a and self.ids[b - 1] in self.eos else 0
        decode = self.model.tokenizer.decode
        return decode(self.ids[a:b], skip_special_tokens=False), decode(self.ids[:a], skip_special_tokens=False)


def conversation_experience(
    tokenizer: Any,
    ids: list[int],
    prompt_length: int,
    logprobs: list[float],
    mask: list[bool],
    temperatures: list[float],
    versions: list[int],
    truncated: bool,
    prompt_truncated: bool = False,
    mask_truncated: bool = True,
    min_tokens: list[int] | None = None,
    spans: list[tuple[int, int]] | None = None,
) -> Experience:
    """A conversation kept as token ids as ONE experience: Episode.experience and the OpenAI API's
    OpenAIServer.episode both build theirs here. prompt = ids[:prompt_length], response = the rest (one log-prob
    per token, 0 where the model did not sample); action_mask = `mask` (the model's sampled tokens), none of them
    when the conversation ended truncated and `mask_truncated` (DAPO's overlong filtering: no loss, the reward still
    counts in its group); metrics truncated / truncated_masked. model_version: the oldest weights that sampled a
    turn. MixedTemperatures if the turns' scoring temperatures differ: the trainer scores one experience at one.
    `min_tokens`: each turn's (the runs of `mask`), kept in info for the trainer's EOS mask (batching.eos_masked)."""
    if len(set(temperatures)) > 1:
        raise MixedTemperatures(
            f"a conversation sampled at temperatures {temperatures} cannot be one experience: "
            "the trainer scores an experience at one temperature; sample every turn at one, or "
            "make one experience per turn (Episode.turn_experiences, EngineHandle.history)"
        )
    P, masked = prompt_length, truncated and mask_truncated
    return Experience(
        tokens=torch.tensor(ids, dtype=torch.long),
        prompt_length=P,
        logprobs=torch.tensor(logprobs, dtype=torch.float32),
        action_mask=torch.tensor(mask, dtype=torch.bool) & (not masked),
        model_version=min(versions, default=0),
        spans=spans or [],
        truncate_status=_status(prompt_truncated, truncated),
        prompt_text=tokenizer.decode(ids[:P]),
        response_text=tokenizer.decode(ids[P:]),
        metrics=_truncation_metrics(truncated, masked),
        info={"temperature": (temperatures or [1.0])[0], "turns": len(versions), "min_tokens": min_tokens or 0},
    )


def turn_spans(
    turns: list[tuple[int, int]], prompt_length: int, spans: list[list[tuple[int, int]]], versions: list[int]
) -> list[tuple[int, int]]:
    """The spans (Experience.spans) of a conversation's response from its turns' (each turn [a, b) of the ids, its
    Completion.spans, its version): each turn's shifted to where the turn starts in the response; the tokens between
    turns (not sampled: template, tool results) count as the turn's before them. Empty when one version sampled all.
    E.g. turns [(10, 14), (20, 25)] after a prompt of 10, spans [[], [(0, 3), (2, 4)]], versions [3, 3]:
    [(0, 3), (12, 4)]."""
    out: list[tuple[int, int]] = []
    for (a, _), own, version in zip(turns, spans, versions):
        for start, v in own or [(0, version)]:
            if not out or out[-1][1] != v:
                out.append((max(a - prompt_length + start, 0) if out else 0, v))
    return out if len(out) > 1 else []


def _truncation_metrics(truncated: bool, masked: bool) -> dict[str, float]:
    return {"truncated": float(truncated), "truncated_masked": float(masked)}


def _status(prompt_truncated: bool, truncated: bool) -> str | None:
    """prompt_truncated (the trainer gives it no loss) before response_truncated."""
    return "prompt_truncated" if prompt_truncated else "response_truncated" if truncated else None


def reply_all(episodes: list[Episode], **sampling: Any) -> list[str | None]:
    """The next turn of every episode not done, submitted together (one engine batch); None for those done."""
    futures = [None if e.done else e.request(**sampling) for e in episodes]
    return [None if f is None else e.record(f.result()) for e, f in zip(episodes, futures)]
