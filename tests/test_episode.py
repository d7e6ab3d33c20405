"""workflows/episode.py and tool_use.py: multi-turn episodes kept as the exact token ids, tool calls parsed and run
safely, the calculator, tool_workflow."""

import string
from pathlib import Path

import pytest
import torch

from algos import ADVANTAGE_FNS, step_wise_grpo
from algos.utils import BatchError
from batching import group_advantages, step_batch
from buffer import ExperienceDB
from configs.schema import AlgorithmConfig, GenerationConfig
from engines import EngineHandle, HFEngine
from helpers import ScriptedEngine, plain_logprobs, scripted, tool_task
from models import load_model, load_tokenizer
from sampling import PromptTooLong
from workflows import build_workflow
from workflows.episode import Episode, MixedTemperatures, reply_all, tool_message

# The chat templates of real models (tests/data/chat_templates/README.md): Qwen2.5's puts the tools in the system
# header and joins consecutive tool messages into one user turn; Qwen3's also drops the <think> block of assistant
# turns before the last user query when history is rendered again: re-rendering would rewrite earlier turns.
TEMPLATES = {
    name: (Path(__file__).parent / "data" / "chat_templates" / f"{name}.jinja").read_text()
    for name in ("qwen2.5", "qwen3")
}
CALC_SCHEMA = {
    "type": "function",
    "function": {"name": "calculator", "description": "+ - * /", "parameters": {"type": "object"}},
}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def test_the_real_templates_render_as_their_models_do(tokenizer):
    hi = [{"role": "user", "content": "Hi"}]
    assert tokenizer.apply_chat_template(
        hi, chat_template=TEMPLATES["qwen2.5"], tokenize=False, add_generation_prompt=True
    ) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.apply_chat_template(
        hi + [{"role": "assistant", "content": "Hello"}], tokenize=False, chat_template=TEMPLATES["qwen3"]
    ) == ("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nHello<|im_end|>\n")
    assert tokenizer.apply_chat_template(
        hi, chat_template=TEMPLATES["qwen3"], tokenize=False, enable_thinking=False, add_generation_prompt=True
    ).endswith("assistant\n<think>\n\n</think>\n\n")


@pytest.mark.parametrize("template", [None, "qwen2.5", "qwen3"], ids=["project", "qwen2.5", "qwen3"])
def test_each_turns_ids_are_a_prefix_of_the_next_and_only_sampled_tokens_are_actions(tokenizer, template):
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "6 * 7"}}</tool_call>'
    turns = [f"<think>6 x 7 first</think>call: {call}\n{call}", "<think>ok</think>42"]
    model = scripted(tokenizer, turns)
    ep = Episode(
        model, [{"role": "user", "content": "What is 6 x 7?"}], [CALC_SCHEMA], chat_template=TEMPLATES.get(template)
    )
    seen = [list(ep.ids)]
    ep.reply()
    seen.append(list(ep.ids))
    ep.add([tool_message("42"), tool_message("42"), {"role": "user", "content": "And now?"}])  # two tool results
    seen.append(list(ep.ids))
    ep.reply()
    seen.append(list(ep.ids))
    for a, b in zip(seen, seen[1:]):
        assert b[: len(a)] == a  # the context only grows
    # the sampled ids are in the context exactly as sampled, and they alone are actions
    sampled = [model.engine.requests[k][0] for k in range(2)]
    assert sampled[0] == seen[0] and sampled[1] == seen[2]  # each turn was sampled from exactly the context so far
    want = [tokenizer.encode(t, add_special_tokens=False) + [tokenizer.eos_token_id] for t in turns]
    actions = [t for t, m in zip(ep.ids[ep.prompt_length :], ep.mask) if m]
    assert actions == want[0] + want[1] and [ep.ids[a:b] for a, b in ep.turns] == want
    assert [lp for lp, m in zip(ep.logprobs, ep.mask) if m] == [-0.5] * len(actions)
    assert all(lp == 0.0 for lp, m in zip(ep.logprobs, ep.mask) if not m)
    # what lies between the turns is the template's own rendering of the new messages
    between = tokenizer.decode(ep.ids[ep.turns[0][1] : ep.turns[1][0]])
    if template is None:
        assert between == (
            "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>tool\n42<|im_end|>\n"
            "<|im_start|>user\nAnd now?<|im_end|>\n<|im_start|>assistant\n"
        )
    else:  # Qwen's: the tools in the system header, the two results in one user turn
        assert "# Tools" in tokenizer.decode(seen[0]) and '"name": "calculator"' in tokenizer.decode(seen[0])
        assert between == (
            "\n<|im_start|>user\n<tool_response>\n42\n</tool_response>\n<tool_response>\n42\n"
            "</tool_response><|im_end|>\n<|im_start|>user\nAnd now?<|im_end|>\n<|im_start|>assistant\n"
        )
    rerendered = tokenizer.encode(
        model.render(ep.messages, [CALC_SCHEMA], TEMPLATES.get(template)), add_special_tokens=False
    )
    if template == "qwen3":  # re-rendering the history drops turn 1's <think> block: not what the model saw
        assert rerendered[: len(seen[1]) - 1] != seen[1][:-1]
        assert "6 x 7 first" not in tokenizer.decode(rerendered) and "6 x 7 first" in tokenizer.decode(ep.ids)
    exp = ep.experience()
    assert exp.tokens.tolist() == ep.ids and exp.prompt_length == len(seen[0]) and exp.model_version == 3
    assert exp.action_mask.tolist() == ep.mask and exp.info["turns"] == 2 and exp.truncate_status is None


def test_a_turn_that_ends_on_any_eos_id_gets_the_closing_without_its_end_token(tokenizer):
    """The engine stops on any of its EOS ids (the tiny model's generation config: <|im_end|> and <|endoftext|>):
    after a turn ended by <|endoftext|> the template's <|im_end|> is not appended too."""
    other = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    engine = ScriptedEngine(tokenizer, [("first", other), "second"], eos_ids=[tokenizer.eos_token_id, other])
    ep = Episode(EngineHandle(engine, tokenizer, {"max_tokens": 50}), [{"role": "user", "content": "hi"}])
    ep.reply()
    ep.add([{"role": "user", "content": "more"}])
    ep.reply()
    text = tokenizer.decode(ep.ids[ep.prompt_length :])
    assert text == ("first<|endoftext|>\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\nsecond<|im_end|>\n")


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


def test_turns_keep_their_own_text_after_a_few_shot_assistant_message(tokenizer):
    shots = [
        {"role": "user", "content": "1 + 1?"},
        {"role": "assistant", "content": "#### 2"},
        {"role": "user", "content": "2 + 3?"},
    ]
    ep = Episode(scripted(tokenizer, ["#### 5", "#### 6"]), shots)
    ep.reply()
    ep.add([{"role": "user", "content": "sure?"}])
    ep.reply()
    assert [e.response_text for e in ep.turn_experiences()] == ["#### 5", "#### 6"]
    assert ep.messages_text(0) == "#### 5" and ep.messages_text(-1) == "#### 6"


def test_an_episodes_prompt_goes_through_the_handles_prompt_limit(tokenizer):
    long = [{"role": "user", "content": "What is " + "1 + " * 30 + "1?"}]
    ep = Episode(scripted(tokenizer, ["#### 31"], max_prompt_tokens=40), long)
    assert ep.prompt_length == 40 and ep.prompt_truncated
    ep.reply()
    assert ep.experience().truncate_status == "prompt_truncated"  # the trainer gives it no loss
    assert tokenizer.decode(ep.ids[:40]).endswith("<|im_start|>assistant\n")  # the end kept: the generation prompt
    with pytest.raises(PromptTooLong, match="exceeds model.max_prompt_tokens"):
        Episode(scripted(tokenizer, [], max_prompt_tokens=40, truncate=False), long)
    with pytest.raises(PromptTooLong, match=r"leaves no room for a reply within max_model_len=20"):
        Episode(scripted(tokenizer, [], max_model_len=20), long)


def test_each_turn_keeps_its_temperature_and_one_experience_needs_one(tokenizer):
    ep = Episode(scripted(tokenizer, ["a", "b"]), [{"role": "user", "content": "hi"}])
    ep.reply(temperature=0.5)
    ep.add([{"role": "user", "content": "more"}])
    ep.reply(temperature=1.0)
    assert [e.info["temperature"] for e in ep.turn_experiences()] == [0.5, 1.0]
    with pytest.raises(MixedTemperatures, match=r"temperatures \[0.5, 1.0\] cannot be one experience"):
        ep.experience()
    ep = Episode(scripted(tokenizer, ["a", "b"]), [{"role": "user", "content": "hi"}])
    ep.reply(temperature=0.0)  # greedy turns are scored at 1.0
    ep.add([{"role": "user", "content": "more"}])
    ep.reply(temperature=1.0)
    assert ep.experience().info["temperature"] == 1.0


def test_a_truncated_episode_is_masked_and_counted(tokenizer):
    ep = Episode(scripted(tokenizer, ["a b c d e f g h"]), [{"role": "user", "content": "hi"}])
    ep.reply(max_tokens=3)  # cut at max_tokens: the episode ends truncated
    exp = ep.experience()
    assert exp.truncate_status == "response_truncated" and not exp.action_mask.any()  # no loss on it
    assert exp.metrics == {"truncated": 1.0, "truncated_masked": 1.0}
    kept = ep.experience(mask_truncated=False)
    assert kept.action_mask.sum() == 3 and kept.metrics["truncated_masked"] == 0.0
    assert not ep.turn_experiences()[0].action_mask.any()
    done = Episode(scripted(tokenizer, ["a"]), [{"role": "user", "content": "hi"}], max_turns=1)
    done.reply()
    assert done.experience().metrics == {"truncated": 0.0, "truncated_masked": 0.0}


def test_episodes_turns_go_to_the_engine_together(tokenizer):
    model = scripted(tokenizer, ["a", "b", "c"])
    eps = [Episode(model, [{"role": "user", "content": f"q{i}"}], max_turns=1) for i in range(3)]
    eps[1].finish()
    assert reply_all(eps) == ["a", None, "b"] and len(model.engine.requests) == 2


def test_a_real_episode_gives_the_trainer_the_engines_log_probs(tiny_model_dir):
    """HF engine, two turns with a tool message between: at every action token the rollout log-prob equals a plain
    forward pass over the whole episode (what the trainer computes), so the episode trains on what was sampled."""
    ref = load_model(tiny_model_dir)
    stop = list(string.ascii_letters + string.digits)  # the untrained model samples bytes, rarely EOS: end its
    # turns at the first ASCII letter or digit (deterministic with the seed)
    with HFEngine(tiny_model_dir) as engine:
        model = EngineHandle(engine, engine.tokenizer, {"max_tokens": 12, "temperature": 0.8, "seed": 1, "stop": stop})
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


# --- tool_workflow


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
    shown = tokenizer.decode(exps[0].tokens[exps[0].prompt_length :])
    assert "<|im_start|>tool\n83<|im_end|>" in shown  # the calculator's result, as the template renders it
    assert "error: the tool call is not valid JSON" in tokenizer.decode(exps[2].tokens)
    assert all(e.action_mask is not None and 0 < e.action_mask.sum() < e.response_length for e in (exps[0], exps[2]))


def test_tool_workflow_step_wise_gives_each_turn_the_episodes_reward(tokenizer):
    exps = build_workflow(
        tool_task(repeat_times=1, workflow_args={"step_wise": True}), scripted(tokenizer, [CALL, "#### 83"])
    ).run()
    assert [e.info["turn"] for e in exps] == [0, 1] and [e.reward for e in exps] == pytest.approx([1.1, 1.1])


def test_an_episode_that_ends_on_a_tool_call_gave_no_answer(tokenizer):
    """At max_turns on a call whose numbers hold the reference (83): scored as "" (no answer), not as the last
    number of the call."""
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "0 + 83"}}</tool_call>'
    exps = build_workflow(tool_task(repeat_times=1, workflow_args={"max_turns": 1}), scripted(tokenizer, [call])).run()
    assert exps[0].reward == pytest.approx(-0.1) and exps[0].metrics["accuracy"] == 0.0


def test_tool_workflow_masks_truncated_episodes_unless_told_not_to(tokenizer):
    long = "x " * 200  # runs into max_tokens: the episode is truncated
    task = tool_task(repeat_times=2, rollout_args=GenerationConfig(temperature=1.0, max_tokens=20))
    exps = build_workflow(task, scripted(tokenizer, [long, "#### 83"])).run()
    assert [e.metrics["truncated"] for e in exps] == [1.0, 0.0]
    assert not exps[0].action_mask.any() and exps[1].action_mask.any()
    assert [e.reward for e in exps] == pytest.approx([-0.1, 1.1])  # its reward still counts in the group
    task.workflow_args = {"mask_truncated": False}
    exps = build_workflow(task, scripted(tokenizer, [long, "#### 83"])).run()
    assert exps[0].action_mask.sum() == 20 and exps[0].metrics["truncated_masked"] == 0.0


def test_a_taskset_tool_without_a_function_is_named_once_and_its_calls_get_unknown_tool(tokenizer, caplog):
    search = {"type": "function", "function": {"name": "web_search", "description": "web", "parameters": {}}}
    call = '<tool_call>{"name": "web_search", "arguments": {"q": "x"}}</tool_call>'
    with caplog.at_level("WARNING"):
        for _ in range(2):
            model = scripted(tokenizer, [call, "#### 83"])
            exps = build_workflow(tool_task(repeat_times=1, tools=[search]), model).run()
    assert sum("'web_search' (format.tools_key)" in r.getMessage() for r in caplog.records) == 1
    assert "error: unknown tool 'web_search'; available: calculator" in tokenizer.decode(exps[0].tokens)


def test_step_wise_advantages_are_the_whole_groups_though_a_train_step_gets_part_of_it(tokenizer, tmp_path):
    """Episodes of 1, 3 and 2 turns (rewards 1.1, 0.1, 1.1): step_wise_grpo runs in the explorer over the group's
    three episodes; through the real DB, a trainer claiming 3 experiences a step gets the group in two parts and
    reads each turn's episode advantage back unchanged. Normalising each part alone gives other numbers."""
    from explore import stamp

    script = ["#### 83", CALL, CALL, CALL, "#### 83", "#### 5"]  # turn 1 of 3 episodes, turn 2 of 2, turn 3 of 1
    task = tool_task(workflow_args={"step_wise": True, "max_turns": 3})
    exps = build_workflow(task, scripted(tokenizer, script)).run()
    assert [e.info["episode"] for e in exps] == [0, 1, 1, 1, 2, 2]
    stamp(exps, task, "explorer")
    group_advantages(exps, AlgorithmConfig(algorithm_type="multi_step_grpo", advantage_fn="step_wise_grpo"))
    a = 1 / 3**0.5  # episodes [1.1, 0.1, 1.1]: mean 0.767, std 0.577 -> +0.577, -1.155, +0.577
    want = {0: a, 1: -2 * a, 2: a}
    with ExperienceDB(f"sqlite:///{tmp_path / 'exp.db'}") as db:
        db.write(exps)
        parts = [db.claim(3, step=1), db.claim(3, step=2)]
    fn, cfg = ADVANTAGE_FNS["step_wise_grpo"]
    for part in parts:
        batch = step_batch(part, 0)
        out, _ = fn(batch, cfg())
        for b, x in enumerate(part):
            mask = batch["response_mask"][b]
            assert out["advantages"][b][mask].tolist() == pytest.approx(
                [want[x.info["episode"]]] * int(mask.sum()), abs=1e-4
            )
        alone, _ = step_wise_grpo.compute(batch, cfg())  # what the trainer computing it per part would get
        assert not torch.allclose(alone["advantages"], out["advantages"], atol=1e-3)
    with pytest.raises(BatchError, match="1 of 1 experiences carry no advantages"):
        fn(step_batch(build_workflow(tool_task(repeat_times=1), scripted(tokenizer, ["#### 83"])).run(), 0), cfg())


def test_tool_workflow_names_an_unknown_tool(tokenizer):
    with pytest.raises(
        ValueError,
        match=r"workflow_args.tools: \['search'\] is out of range; allowed: names of "
        r"known tools \(TOOLS: calculator\)",
    ):
        build_workflow(tool_task(workflow_args={"tools": ["search"]}), scripted(tokenizer, [])).run()


def test_the_tools_reach_the_chat_template(tokenizer):
    """The registered tools' schemas and the taskset's own (format.tools_key) are what the template renders."""
    template = (
        "{%- for t in tools or [] -%}{{- 'TOOL ' + t.function.name + '\\n' -}}{%- endfor -%}"
        "{%- for m in messages -%}{{- m.role + ': ' + m.content + '\\n' -}}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- 'assistant: ' -}}{%- endif -%}"
    )
    search = {"type": "function", "function": {"name": "search", "description": "web", "parameters": {}}}
    model = scripted(tokenizer, ["#### 83"])
    build_workflow(tool_task(repeat_times=1, tools=[search], chat_template=template), model).run()
    prompt = tokenizer.decode(model.engine.requests[0][0])
    assert prompt.startswith("TOOL calculator\nTOOL search\nuser: What is 37 + 58 - 12?\nassistant: ")
