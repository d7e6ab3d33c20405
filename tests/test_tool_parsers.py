"""workflows/tool_parsers.py and tool_workflow's tools of the user's own: tool calls read in the format of each chat
template family (the real templates of tests/data/chat_templates), a tool written outside the repository and named
only in the workflow_args run from that name, its result rendered back by the family's template."""

import json
from pathlib import Path

import pytest

from configs import ConfigError
from helpers import scripted, tool_task
from models import load_tokenizer
from workflows import build_workflow
from workflows.tool_parsers import ToolParser, compiled, detect, tool_parser
from workflows.tool_use import function_tool, load_tools
from workflows.tools import ToolCall, ToolError

DATA = Path(__file__).parent / "data" / "chat_templates"
TEMPLATES = {
    name: (DATA / f"{name}.jinja").read_text() for name in ("qwen3", "qwen3.5", "llama3.1", "mistral-v11", "gpt-oss")
}
FAMILY = {
    "qwen3": "hermes",
    "qwen3.5": "qwen3_coder",
    "llama3.1": "llama3_json",
    "mistral-v11": "mistral",
    "gpt-oss": "openai",
}

# A tool of the user's own, written outside the repository (tmp_path): its schema comes from its signature and
# docstring; it runs in a worker process, which loads it by its file's path.
TOOL_FILE = '''
def get_weather(city: str, days: int = 1) -> str:
    """Gets the weather forecast.

    Args:
        city: The city's name.
        days: How many days ahead.
    """
    return f"{city}: sunny for {days} days"


def no_docs(city: str) -> str:
    return city


def get_weather_again(city: str) -> str:
    """Gets the weather.

    Args:
        city: The city.
    """
    return city
'''
SCHEMA = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Gets the weather forecast.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city's name."},
                "days": {"type": "integer", "description": "How many days ahead."},
            },
            "required": ["city"],
        },
    },
}
PARIS = ToolCall("get_weather", {"city": "Paris", "days": 3})


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


@pytest.fixture
def tool_file(tmp_path) -> Path:
    path = tmp_path / "outside" / "my_tools.py"
    path.parent.mkdir()
    path.write_text(TOOL_FILE)
    return path


def render(tokenizer, name: str, messages: list[dict], generation: bool) -> str:
    return tokenizer.apply_chat_template(
        messages, tools=[SCHEMA], chat_template=TEMPLATES[name], tokenize=False, add_generation_prompt=generation
    )


def test_each_family_is_told_by_its_chat_template(tokenizer):
    assert {name: detect(t) for name, t in TEMPLATES.items()} == FAMILY
    assert detect(tokenizer.chat_template) == "hermes"  # the tiny model's (Qwen's layout)


@pytest.mark.parametrize("name", list(FAMILY))
def test_a_call_as_each_template_renders_it_is_read_back(tokenizer, name):
    """The template writes an assistant turn with a tool call (in history); what follows the generation prompt is
    what the model writes: the family's parser reads the same call back, and a plain answer as no call."""
    user = [{"role": "user", "content": "Weather in Paris?"}]
    call = {"id": "call00000", "type": "function", "function": {"name": "get_weather", "arguments": PARIS.arguments}}
    prompt = render(tokenizer, name, user, generation=True)
    turn = render(tokenizer, name, user + [{"role": "assistant", "content": "", "tool_calls": [call]}], False)
    assert turn.startswith(prompt)
    parser = tool_parser(tokenizer, TEMPLATES[name], "auto", [SCHEMA])
    assert parser.name == FAMILY[name]
    written = turn[len(prompt) :]
    assert parser.parse(written, written, prompt).calls == [PARIS], written
    answer = render(tokenizer, name, user + [{"role": "assistant", "content": "#### 83"}], False)[len(prompt) :]
    reply = parser.parse(answer, answer, prompt)
    assert reply.calls == [] and "#### 83" in reply.content


@pytest.mark.parametrize(
    "fmt,text,calls",
    [  # as the models write them (vLLM's parsers' formats)
        ("llama3_json", '<|python_tag|>{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}', [PARIS]),
        (
            "mistral",  # v11+: [ARGS], with and without a call id, two calls, text after the JSON ignored
            '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e'
            '[ARGS]{"city": "Rome"} and so on</s>',
            [PARIS, ToolCall("get_weather", {"city": "Rome"})],
        ),
        (
            "mistral",  # before v11: one list of calls
            '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
            '{"name": "get_weather", "arguments": {"city": "Rome"}}]</s>',
            [PARIS, ToolCall("get_weather", {"city": "Rome"})],
        ),
        (
            "openai",  # harmony: reasoning, then the call on the commentary channel
            "<|channel|>analysis<|message|>I need the weather.<|end|><|start|>assistant<|channel|>commentary "
            'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "days": 3}<|call|>',
            [PARIS],
        ),
        (
            "qwen3_coder",  # the values are text, typed by the tool's schema ("3" -> 3 for an integer)
            "<think>\nweather\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
            "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
            [PARIS],
        ),
        (
            "hermes",
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}</tool_call>',
            [PARIS],
        ),
    ],
)
def test_calls_as_the_models_write_them_are_read(fmt, text, calls):
    assert ToolParser(fmt, compiled(fmt), [SCHEMA]).parse(text, text, "").calls == calls


@pytest.mark.parametrize(
    "fmt,text",
    [
        (
            "openai",
            "<|channel|>analysis<|message|>maybe to=functions.get_weather<|channel|>commentary json<|message|>{}"
            "<|end|><|start|>assistant<|channel|>final<|message|>#### 83<|return|>",
        ),
        ("mistral", '[THINK]maybe [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[/THINK]#### 83</s>'),
        ("qwen3_coder", "<think>maybe <tool_call>\n<function=get_weather>\n</function>\n</tool_call></think>#### 83"),
    ],
)
def test_a_call_the_model_only_thought_about_is_not_made(fmt, text):
    reply = ToolParser(fmt, compiled(fmt), [SCHEMA]).parse(text, text, "")
    assert reply.calls == [] and reply.content == "#### 83"


def test_a_malformed_call_is_an_error_for_the_model_and_the_others_still_run():
    mistral = ToolParser("mistral", compiled("mistral"), [])
    bad, good = mistral.parse("", '[TOOL_CALLS]get_weather[ARGS]{"city": [TOOL_CALLS]f[ARGS]{"a": 1}</s>', "").calls
    assert bad.error.startswith("the tool call is not valid JSON") and good == ToolCall("f", {"a": 1})
    llama = ToolParser("llama3_json", compiled("llama3_json"), [])
    deep = '{"name": "f", "parameters": ' + "[" * 100000 + "}"  # json.loads: RecursionError
    assert llama.parse("", deep, "").calls == [ToolCall("", {}, "the tool call's JSON is nested too deeply")]
    (call,) = llama.parse("", '{"name": "f", "parameters": [1, 2]}', "").calls
    assert call.error == "the tool call's arguments must be a JSON object"
    # a tokenizer's own template that reads a region as JSON itself: one bad call fails the reply, said so
    own = {
        "start_anchor": "<|im_start|>assistant\n",
        "fields": {
            "tool_calls": {"open": "<tool_call>", "close": "</tool_call>", "repeats": True, "content": "json"},
            "content": {"close": "<|im_end|>", "content": "text"},
        },
    }
    parser = ToolParser("tokenizer", compiled(json.dumps(own)), [])
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{nope</tool_call>'
    (call,) = parser.parse("", text, "").calls
    assert call.name == "" and call.error.startswith("the reply's tool calls cannot be read (ValueError: json parser")


def test_the_tokenizers_own_response_template_is_used_unless_the_task_brings_its_template(tokenizer, tmp_path):
    own = {
        "start_anchor": "<|im_start|>assistant\n",
        "fields": {
            "tool_calls": {"open": "<call>", "close": "</call>", "repeats": True, "content": "json"},
            "content": {"close": "<|im_end|>", "content": "text"},
        },
    }
    tokenizer.response_template = own
    try:
        parser = tool_parser(tokenizer, None, "auto", [])
        assert parser.name == "tokenizer"
        assert parser.parse(
            "", '<call>{"type": "function", "function": {"name": "f", "arguments": {}}}</call>', ""
        ).calls == [ToolCall("f", {})]
        assert tool_parser(tokenizer, TEMPLATES["llama3.1"], "auto", []).name == "llama3_json"  # the task's template
        assert tool_parser(tokenizer, None, "mistral", []).name == "mistral"  # named in the YAML
    finally:
        del tokenizer.response_template
    (tmp_path / "mine.json").write_text(json.dumps(own))
    parser = tool_parser(tokenizer, None, str(tmp_path / "mine.json"), [])
    assert parser.parse("", '<call>{"name": "f", "arguments": {"x": 1}}</call>', "").calls == [ToolCall("f", {"x": 1})]


@pytest.mark.parametrize(
    "name,call,answer,between",
    [
        (
            "llama3.1",
            '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}',
            "#### 83",
            '<|start_header_id|>ipython<|end_header_id|>\n\n"Paris: sunny for 3 days"<|eot_id|>'
            "<|start_header_id|>assistant<|end_header_id|>\n\n",
        ),
        (
            "mistral-v11",
            '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}',
            "#### 83",
            "[TOOL_RESULTS]call00000[TOOL_CONTENT]Paris: sunny for 3 days[/TOOL_RESULTS]",
        ),
        (
            "gpt-oss",
            '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "days": 3}'
            "<|call|>",
            "<|channel|>final<|message|>#### 83<|return|>",
            '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"Paris: sunny for 3 days"'
            "<|end|><|start|>assistant",
        ),
        (
            "qwen3.5",
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
            "</parameter>\n</function>\n</tool_call>",
            "#### 83",
            "<|im_start|>user\n<tool_response>\nParis: sunny for 3 days\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n<think>\n\n</think>\n\n",
        ),
        (
            "qwen3",
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
            "#### 83",
            "<|im_start|>user\n<tool_response>\nParis: sunny for 3 days\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n",
        ),
    ],
)
def test_an_outside_tool_named_in_workflow_args_is_called_in_each_familys_format(
    tokenizer, tool_file, name, call, answer, between
):
    """tool_workflow with a tool named only by `path/file.py:function` (no line in TOOLS): its schema (from the
    docstring) reaches the family's template, the model's call in the family's format is read, run in a worker,
    and its result is rendered by that template before the next turn; the answer is scored."""
    model = scripted(tokenizer, [call, answer])
    task = tool_task(
        workflow_args={"tools": [f"{tool_file}:get_weather"], "max_turns": 3},
        chat_template=TEMPLATES[name],
        repeat_times=1,
    )
    (exp,) = build_workflow(task, model).run()
    assert (exp.reward, exp.metrics["tool_calls"], exp.metrics["turns"]) == (pytest.approx(1.1), 1, 2)
    prompt = tokenizer.decode(exp.tokens[: exp.prompt_length])
    assert "Gets the weather forecast." in prompt and "How many days ahead." in prompt
    response = exp.tokens[exp.prompt_length :].tolist()
    first_turn_end = exp.action_mask.tolist().index(False)
    second_turn = exp.action_mask.tolist().index(True, first_turn_end)
    assert tokenizer.decode(response[first_turn_end:second_turn]).endswith(between)


def test_a_tool_of_ones_own_must_load_and_describe_itself(tool_file, tmp_path):
    tool = function_tool(f"{tool_file}:get_weather")
    assert tool.schema() == SCHEMA and tool.ref["file"] == str(tool_file)
    with pytest.raises(ToolError, match=r"no_docs': its JSON schema comes from its signature and docstring"):
        function_tool(f"{tool_file}:no_docs")
    with pytest.raises(ToolError, match=r"'builtins:eval' is not a Python function"):
        function_tool("builtins:eval")
    with pytest.raises(ToolError, match=r"has no 'nope'"):
        function_tool(f"{tool_file}:nope")
    with pytest.raises(ToolError, match=r"are both named 'get_weather'"):
        load_tools((f"{tool_file}:get_weather", f"{tool_file}:get_weather_again", f"{tool_file}:get_weather"))


def test_an_explorer_refuses_a_tool_that_does_not_load_when_it_starts(tool_file):
    """The config loader imports no user code (it checks the form of the names); an explorer loads the tools when it
    starts and names the one that fails."""
    import configs
    from workflows.args import check_tasksets

    def stage(tools: list[str], parser: str = "auto"):
        raw = {
            "model": {"model_path": "m", "max_model_len": 256},
            "buffer": {
                "batch_size": 2,
                "explorer_input": {
                    "taskset": {
                        "path": "x",
                        "default_workflow_type": "tool_workflow",
                        "workflow_args": {"tools": tools, "tool_parser": parser},
                    }
                },
            },
        }
        (cfg,) = configs.resolve_stages(configs.from_dict(configs.Config, configs.normalize(raw)))
        return cfg

    check_tasksets(stage(["calculator", f"{tool_file}:get_weather"]))
    cfg = stage([f"{tool_file}:no_docs"])  # loads: the loader does not import it
    with pytest.raises(ConfigError, match=r"tasksets\[0\]\.workflow_args: tool '.*no_docs': its JSON schema"):
        check_tasksets(cfg)
    with pytest.raises(ConfigError, match=r"workflow_args\.tools: \['search'\] is out of range; allowed: names of "):
        check_tasksets(stage(["search"]), user_code=False)
    with pytest.raises(ConfigError, match=r"workflow_args\.tool_parser: 'llama' is out of range; allowed: auto, "):
        check_tasksets(stage(["calculator"], "llama"), user_code=False)
    with pytest.raises(ConfigError, match=r"workflow_args: tool_parser 'none\.json': not a response template file"):
        check_tasksets(stage(["calculator"], "none.json"))


USER_WORKFLOW = '''
from workflows import Workflow, apply_reward, chat_messages
from workflows.episode import Episode
from workflows.tool_parsers import tool_parser
from workflows.tool_use import load_tools, tool_results


class Weather(Workflow):
    """One episode with the tools of workflow_args["tools"], as workflows/episode.py's docstring writes it."""

    default_reward_fn = "math_reward"

    def run(self):
        tools, template = load_tools(tuple(self.task.workflow_args["tools"])), self.task.chat_template or None
        ep = Episode(self.model, chat_messages(self.task), tools, max_turns=3, chat_template=template)
        parser = tool_parser(self.model.tokenizer, template, "auto", ep.tools)
        while not ep.done:
            ep.reply(max_tokens=64)
            calls = parser.parse_turn(ep).calls
            if not calls:
                break
            ep.add(*tool_results(calls, tools, timeout=10.0))
        exp = ep.experience()
        return [apply_reward(exp, self.reward(parser.parse_turn(ep).content, 0))]
'''


def test_a_workflow_of_ones_own_reads_and_runs_tool_calls_in_the_templates_format(tokenizer, tool_file, tmp_path):
    """A workflow outside the repository (`file.py:Class`) written with the public pieces (Episode, tool_parser,
    load_tools, tool_results), a tool outside it too, Mistral's template: the call is read, run and rendered."""
    (tmp_path / "weather_workflow.py").write_text(USER_WORKFLOW)
    task = tool_task(
        workflow=f"{tmp_path / 'weather_workflow.py'}:Weather",
        workflow_args={"tools": [f"{tool_file}:get_weather"]},
        chat_template=TEMPLATES["mistral-v11"],
        repeat_times=1,
    )
    model = scripted(tokenizer, ['[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}', "#### 83"])
    (exp,) = build_workflow(task, model).run()
    assert exp.reward == pytest.approx(1.1)
    assert "[TOOL_RESULTS]call00000[TOOL_CONTENT]Paris: sunny for 3 days[/TOOL_RESULTS]" in exp.response_text


def test_a_tool_file_named_in_a_yaml_is_read_from_the_yamls_directory(tmp_path):
    """As a workflow's `file.py:Class`: a relative `my_tools.py:get_weather` (and a tool_parser .json file) in a YAML
    file is resolved against that file's directory, not the working directory; a module name stays as it is."""
    import yaml

    import configs

    (tmp_path / "cfg").mkdir()
    args = {"tools": ["calculator", "my_tools.py:get_weather", "pkg.mod:f"], "tool_parser": "mine.json"}
    taskset = {"path": "x", "default_workflow_type": "tool_workflow", "workflow_args": args}
    raw = {"model": {"model_path": "m", "max_model_len": 256}, "buffer": {"explorer_input": {"taskset": taskset}}}
    (tmp_path / "cfg" / "run.yaml").write_text(yaml.safe_dump(raw))
    (stage,) = configs.resolve_stages(configs.cli(["--config", str(tmp_path / "cfg" / "run.yaml")])[0])
    (ts,) = stage.buffer.explorer_input.tasksets
    assert ts.workflow_args == {
        "tools": ["calculator", f"{tmp_path / 'cfg' / 'my_tools.py'}:get_weather", "pkg.mod:f"],
        "tool_parser": str(tmp_path / "cfg" / "mine.json"),
    }
