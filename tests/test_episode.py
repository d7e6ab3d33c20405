"""workflows/episode.py and tool_use.py: multi-turn episodes kept as the exact token ids, tool calls parsed and run
safely, the calculator, tool_workflow."""

import concurrent.futures
import string
import threading
import time

import pytest
import torch

from configs.schema import GenerationConfig
from conftest import plain_logprobs
from engines import Completion, HFEngine, ModelHandle
from models import load_model, load_tokenizer
from tasksets import Task
from workflows import build_workflow
from workflows.episode import Episode, Tool, ToolCall, parse_tool_calls, reply_all, run_tool, tool_message
from workflows.tool_use import calculate

# A Qwen3-style template: tool results inside a user turn, and the <think> block of an assistant turn dropped once a
# later user message follows (Qwen3's chat template does this): re-rendering history then rewrites earlier turns.
THINK_TEMPLATE = (
    "{%- set ns = namespace(last=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}{%- set c = m.content -%}"
    "{%- if loop.index0 < ns.last and '</think>' in c -%}{%- set c = c.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}{{- '<|im_start|>assistant\\n' + c + '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'tool' -%}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


class ScriptedEngine:
    """Plays the model: each request gets the next scripted text's ids (+ EOS), log-prob -0.5 per token."""

    def __init__(self, tokenizer, texts: list[str]) -> None:
        self.tokenizer, self.texts, self.requests = tokenizer, list(texts), []
        self.model_version = 3

    def submit(self, ids, params) -> concurrent.futures.Future:
        self.requests.append((list(ids), params))
        text = self.texts.pop(0)
        out = self.tokenizer.encode(text, add_special_tokens=False)[: params.max_tokens]
        cut = len(out) == params.max_tokens
        out += [] if cut else [self.tokenizer.eos_token_id]
        f = concurrent.futures.Future()
        f.set_result([Completion(out, [-0.5] * len(out), text, "length" if cut else "stop", self.model_version)])
        return f


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def scripted(tokenizer, texts, **handle) -> ModelHandle:
    return ModelHandle(ScriptedEngine(tokenizer, texts), tokenizer, {"max_tokens": 200}, **handle)


@pytest.mark.parametrize("template", [None, THINK_TEMPLATE], ids=["project", "qwen3-style"])
def test_each_turns_ids_are_a_prefix_of_the_next_and_only_sampled_tokens_are_actions(tokenizer, template):
    turns = ["<think>6 x 7 first</think>call: <tool_call>{\"name\": \"calc\"}</tool_call>", "<think>ok</think>42"]
    model = scripted(tokenizer, turns)
    ep = Episode(model, [{"role": "user", "content": "What is 6 x 7?"}], chat_template=template)
    seen = [list(ep.ids)]
    ep.reply()
    seen.append(list(ep.ids))
    ep.add([tool_message("42"), {"role": "user", "content": "And now?"}])
    seen.append(list(ep.ids))
    ep.reply()
    seen.append(list(ep.ids))
    for a, b in zip(seen, seen[1:]):
        assert b[: len(a)] == a  # the context only grows
    # the sampled ids are in the context exactly as sampled, and they alone are actions
    sampled = [model.engine.requests[k][0] for k in range(2)]
    assert sampled[0] == seen[0] and sampled[1] == seen[2]  # each turn was sampled from exactly the context so far
    want = [tokenizer.encode(t, add_special_tokens=False) + [tokenizer.eos_token_id] for t in turns]
    actions = [t for t, m in zip(ep.ids[ep.prompt_length:], ep.mask) if m]
    assert actions == want[0] + want[1] and [ep.ids[a:b] for a, b in ep.turns] == want
    assert [lp for lp, m in zip(ep.logprobs, ep.mask) if m] == [-0.5] * len(actions)
    assert all(lp == 0.0 for lp, m in zip(ep.logprobs, ep.mask) if not m)
    # what lies between the turns is the template's own rendering of the new messages
    between = tokenizer.decode(ep.ids[ep.turns[0][1]: ep.turns[1][0]])
    if template is None:
        assert between == ("\n<|im_start|>tool\n42<|im_end|>\n"
                           "<|im_start|>user\nAnd now?<|im_end|>\n<|im_start|>assistant\n")
    else:
        assert between == ("\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
                           "<|im_start|>user\nAnd now?<|im_end|>\n<|im_start|>assistant\n")
        # re-rendering the history instead drops turn 1's <think> block: not what the model saw or sampled
        rerendered = tokenizer.encode(model.render(ep.messages, chat_template=template), add_special_tokens=False)
        assert rerendered[: len(seen[1]) - 1] != seen[1][:-1]
    exp = ep.experience()
    assert exp.tokens.tolist() == ep.ids and exp.prompt_length == len(seen[0]) and exp.model_version == 3
    assert exp.action_mask.tolist() == ep.mask and exp.info["turns"] == 2 and exp.truncate_status is None


def test_one_experience_per_turn(tokenizer):
    model = scripted(tokenizer, ["first", "second"])
    ep = Episode(model, [{"role": "user", "content": "hi"}])
    ep.reply()
    ep.add([{"role": "user", "content": "more"}])
    ep.reply()
    one, two = ep.turn_experiences()
    assert (one.prompt_length, len(one.tokens)) == ep.turns[0] and (two.prompt_length, len(two.tokens)) == ep.turns[1]
    assert two.tokens.tolist() == ep.ids[: ep.turns[1][1]] and one.action_mask is None
    assert one.response_text == "first" and two.info["turn"] == 1
    assert two.logprobs.tolist() == [-0.5] * (ep.turns[1][1] - ep.turns[1][0])


def test_episodes_end_at_max_turns_and_at_the_context_limit(tokenizer):
    ep = Episode(scripted(tokenizer, ["a", "b"]), [{"role": "user", "content": "hi"}], max_turns=1)
    ep.reply()
    assert ep.done and not ep.truncated
    with pytest.raises(RuntimeError, match="the episode is over"):
        ep.reply()
    # a context of 40 tokens: the prompt (~9) and a turn fit, a long tool result does not
    model = scripted(tokenizer, ["a"], max_model_len=40)
    ep = Episode(model, [{"role": "user", "content": "hi"}])
    ep.reply()
    assert model.engine.requests[0][1].max_tokens == 40 - ep.prompt_length  # clamped to the room left
    before = list(ep.ids)
    ep.add([tool_message("x " * 40)])
    assert ep.done and ep.truncated and ep.ids == before  # nothing half-added
    assert ep.experience().truncate_status == "response_truncated"
    # a turn cut at its max_tokens ends the episode too
    ep = Episode(scripted(tokenizer, ["a b c d e f g h"]), [{"role": "user", "content": "hi"}])
    ep.reply(max_tokens=3)
    assert ep.done and ep.truncated and len(ep.mask) == 3


def test_episodes_turns_go_to_the_engine_together(tokenizer):
    model = scripted(tokenizer, ["a", "b", "c"])
    eps = [Episode(model, [{"role": "user", "content": f"q{i}"}], max_turns=1) for i in range(3)]
    eps[1].finish()
    assert reply_all(eps) == ["a", None, "b"] and len(model.engine.requests) == 2


def test_tool_calls_are_parsed_never_evaluated():
    text = ('<tool_call>{"name": "calc", "arguments": {"expression": "2+3"}}</tool_call> then '
            '<tool_call>{"name": "calc", "arguments": "2+3"}</tool_call><tool_call>[1]</tool_call>'
            '<tool_call>{nope}</tool_call><tool_call>{"name": "calc"')
    calls = parse_tool_calls(text)
    assert calls[0] == ToolCall("calc", {"expression": "2+3"})
    assert [c.error for c in calls[1:]] == ["the tool call's arguments must be a JSON object",
                                            'a tool call needs {"name": ..., "arguments": {...}}',
                                            "the tool call is not valid JSON (Expecting property name enclosed in "
                                            "double quotes)", "a <tool_call> without its </tool_call>"]
    assert parse_tool_calls("no call, just __import__('os').system('x')") == []


def test_a_failing_tool_is_an_observation_not_a_crash():
    release = threading.Event()
    tools = [Tool("add", lambda a, b: a + b, "a + b", {"type": "object"}),
             Tool("boom", lambda: 1 / 0, "fails", {"type": "object"}),
             Tool("hang", lambda: release.wait(30), "never answers", {"type": "object"})]
    try:
        assert run_tool(tools, ToolCall("add", {"a": 2, "b": 3})) == "5"
        assert run_tool(tools, ToolCall("sub", {})) == "error: unknown tool 'sub'; available: add, boom, hang"
        assert run_tool(tools, ToolCall("add", {"a": 1})).startswith("error: TypeError:")
        assert run_tool(tools, ToolCall("boom", {})) == "error: ZeroDivisionError: division by zero"
        assert run_tool(tools, ToolCall("", {}, "bad JSON")) == "error: bad JSON"
        t0 = time.monotonic()
        assert run_tool(tools, ToolCall("hang", {}), timeout=0.2) == "error: hang gave no result within 0.2 s"
        assert time.monotonic() - t0 < 5
    finally:
        release.set()
    assert tools[0].schema() == {"type": "function", "function": {"name": "add", "description": "a + b",
                                                                  "parameters": {"type": "object"}}}


def test_a_real_episode_gives_the_trainer_the_engines_log_probs(tiny_model_dir):
    """HF engine, two turns with a tool message between: at every action token the rollout log-prob equals a plain
    forward pass over the whole episode (what the trainer computes), so the episode trains on what was sampled."""
    ref = load_model(tiny_model_dir)
    stop = list(string.ascii_letters + string.digits)  # the untrained model samples bytes, rarely EOS: end its
    # turns at the first ASCII letter or digit (deterministic with the seed)
    with HFEngine(tiny_model_dir) as engine:
        model = ModelHandle(engine, engine.tokenizer, {"max_tokens": 12, "temperature": 0.8, "seed": 1, "stop": stop})
        ep = Episode(model, [{"role": "user", "content": "What is 2 + 3?"}])
        ep.reply()
        ep.add([tool_message("5")])
        ep.reply()
    assert len(ep.turns) == 2
    exp = ep.experience()
    want = plain_logprobs(ref, exp.tokens, exp.prompt_length, 0.8)
    mask = exp.action_mask
    assert 0 < mask.sum() < len(mask)  # the tool message and the turns' closings are not actions
    torch.testing.assert_close(exp.logprobs[mask], want[mask], atol=1e-4, rtol=0)


# --- tool_workflow and the calculator


@pytest.mark.parametrize("expression,value", [("37 + 58 - 12", "83"), ("7 / 2", "3.5"), ("-(2 + 3) * 4", "-20"),
                                              (" 10 - 66 - 27 ", "-83")])
def test_the_calculator_computes_arithmetic(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize("expression", ["__import__('os').system('echo hacked')", "2 ** 999999", "a + 1", "1 +",
                                        "[1, 2]", "9" * 300, "open('x')"])
def test_the_calculator_refuses_everything_else_without_running_it(expression):
    with pytest.raises(ValueError):
        calculate(expression)


def tool_task(**over) -> Task:
    fields = dict(taskset="t", index=0, epoch=0, raw={}, prompt="What is 37 + 58 - 12?",
                  messages=[{"role": "user", "content": "What is 37 + 58 - 12?"}], reference="#### 83", tools=None,
                  workflow="tool_workflow", reward_fn="math_reward", workflow_args={"max_turns": 3},
                  reward_fn_args={}, rollout_args=GenerationConfig(temperature=1.0), repeat_times=3)
    return Task(**{**fields, **over})


CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "37 + 58 - 12"}}</tool_call>'


def test_tool_workflow_runs_calls_between_turns_and_scores_the_answer(tokenizer):
    # episode 0 calls the tool then answers; 1 answers at once (wrongly); 2 sends a broken call, then answers
    script = [CALL, "#### 107", "<tool_call>{oops</tool_call>", "#### 83", "#### 83"]
    model = scripted(tokenizer, script)
    exps = build_workflow(tool_task(), model).run()
    assert [e.reward for e in exps] == pytest.approx([1.1, 0.1, 1.1])
    assert [(e.metrics["turns"], e.metrics["tool_calls"]) for e in exps] == [(2, 1), (1, 0), (2, 1)]
    # turns went to the engine together: the 3 first turns (the prompt alone), then the 2 episodes still going
    prompt = len(model.engine.requests[0][0])
    assert [len(ids) > prompt for ids, _ in model.engine.requests] == [False, False, False, True, True]
    shown = tokenizer.decode(exps[0].tokens[exps[0].prompt_length:])
    assert "<|im_start|>tool\n83<|im_end|>" in shown  # the calculator's result, as the template renders it
    assert "error: the tool call is not valid JSON" in tokenizer.decode(exps[2].tokens)
    assert all(e.action_mask is not None and 0 < e.action_mask.sum() < e.response_length for e in (exps[0], exps[2]))


def test_tool_workflow_step_wise_gives_each_turn_the_episodes_reward(tokenizer):
    exps = build_workflow(tool_task(repeat_times=1, workflow_args={"step_wise": True}),
                          scripted(tokenizer, [CALL, "#### 83"])).run()
    assert [e.info["turn"] for e in exps] == [0, 1] and [e.reward for e in exps] == pytest.approx([1.1, 1.1])


def test_tool_workflow_names_an_unknown_tool(tokenizer):
    with pytest.raises(ValueError, match=r"unknown tool\(s\) \['search'\]; known: \['calculator'\]"):
        build_workflow(tool_task(workflow_args={"tools": ["search"]}), scripted(tokenizer, [])).run()


def test_the_tools_reach_the_chat_template(tokenizer):
    """The registered tools' schemas and the taskset's own (format.tools_key) are what the template renders."""
    template = ("{%- for t in tools or [] -%}{{- 'TOOL ' + t.function.name + '\\n' -}}{%- endfor -%}"
                "{%- for m in messages -%}{{- m.role + ': ' + m.content + '\\n' -}}{%- endfor -%}"
                "{%- if add_generation_prompt -%}{{- 'assistant: ' -}}{%- endif -%}")
    search = {"type": "function", "function": {"name": "search", "description": "web", "parameters": {}}}
    model = scripted(tokenizer, ["#### 83"])
    build_workflow(tool_task(repeat_times=1, tools=[search], chat_template=template), model).run()
    prompt = tokenizer.decode(model.engine.requests[0][0])
    assert prompt.startswith("TOOL calculator\nTOOL search\nuser: What is 37 + 58 - 12?\nassistant: ")
