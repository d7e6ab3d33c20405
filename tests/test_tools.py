"""workflows/tools.py, tool_workers.py, calculator.py: tool calls parsed as JSON outside the model's thinking, run in
worker processes that are killed at their timeout (a hung tool holds nothing, and the process still exits), the
calculator. Containment: a tool's children die with it, any parser failure is an observation, big results are cut,
workers do not inherit the explorer's secrets."""

import concurrent.futures
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from engines import Completion, EngineHandle
from helpers import tool_task
from models import load_tokenizer
from workflows import build_workflow
from workflows.calculator import calculate
from workflows.tool_use import CALCULATOR
from workflows.tool_workers import MAX_REPLY_BYTES, MAX_RESULT_BYTES, WORKERS, Worker, Workers, cut
from workflows.tools import Tool, ToolCall, ToolError, parse_tool_calls, run_tool, strip_thinking

ROOT = Path(__file__).resolve().parents[1]

# Tool functions for the tests, in a file of their own (a worker loads it by path: standard library only)
TOOL_FILE = """
import json, os, subprocess, time


def add(a, b):
    return a + b


def boom():
    return 1 / 0


def pid():
    return os.getpid()


def die():
    os._exit(3)


def sleep_forever(pid_file):
    with open(pid_file, "w") as f:
        f.write(str(os.getpid()))
    while True:
        time.sleep(1)


def spawn_and_hang(pid_file):
    child = subprocess.Popen(["sleep", "60"])
    with open(pid_file, "w") as f:
        f.write(str(child.pid))
    while True:
        time.sleep(1)


def huge(n):
    return "x" * n


def huge_error(n):
    raise ValueError("y" * n)


def environ():
    return json.dumps(dict(os.environ))
"""


@pytest.fixture
def tool_file(tmp_path) -> Path:
    path = tmp_path / "my_tools.py"
    path.write_text(TOOL_FILE)
    return path


def tool(path: Path, name: str) -> Tool:
    return Tool(name, f"{path}:{name}", name, {"type": "object"})


def alive(pid: int) -> bool:
    """Whether `pid` runs; a zombie (killed, its new parent has not reaped it yet) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not stat.exists() or stat.read_text().rsplit(")", 1)[-1].split()[0] != "Z"


def gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


def test_a_failing_tool_is_an_observation_not_a_crash(tool_file):
    tools = [tool(tool_file, n) for n in ("add", "boom", "die")]
    assert run_tool(tools, ToolCall("add", {"a": 2, "b": 3})) == "5"
    assert run_tool(tools, ToolCall("sub", {})) == "error: unknown tool 'sub'; available: add, boom, die"
    assert run_tool(tools, ToolCall("add", {"a": 1})).startswith("error: TypeError:")
    assert run_tool(tools, ToolCall("boom", {})) == "error: ZeroDivisionError: division by zero"
    assert run_tool(tools, ToolCall("", {}, "bad JSON")) == "error: bad JSON"
    assert run_tool(tools, ToolCall("die", {})) == "error: the tool's process died"
    assert run_tool(tools, ToolCall("add", {"a": "x", "b": "y"})) == "xy"  # a fresh worker after the dead one
    assert tools[0].schema() == {
        "type": "function",
        "function": {"name": "add", "description": "add", "parameters": {"type": "object"}},
    }


def test_a_tool_must_be_importable_by_a_worker(tool_file):
    with pytest.raises(ToolError, match="'add': .*<lambda>' is not a module-level function"):
        Tool("add", lambda a, b: a + b, "a + b", {})
    with pytest.raises(ToolError, match="no module 'no_such_module'"):
        Tool("f", "no_such_module:f", "", {})
    with pytest.raises(ToolError, match="is not 'module:attr'"):
        Tool("f", "f", "", {})
    assert CALCULATOR.ref["module"] == "workflows.calculator" and CALCULATOR.ref["file"].endswith("calculator.py")
    assert run_tool([CALCULATOR], ToolCall("calculator", {"expression": "37 + 58 - 12"})) == "83"


def test_a_hung_tool_is_killed_at_its_timeout_and_later_calls_still_work(tool_file, tmp_path):
    """More hung calls than any pool has slots (the thread pool this replaced had 8): each is cut off at its timeout
    and its process is gone; a healthy call still answers."""
    tools = [tool(tool_file, "sleep_forever"), tool(tool_file, "pid")]
    for k in range(10):
        pid_file = tmp_path / f"hang{k}.pid"
        t0 = time.monotonic()
        out = run_tool(tools, ToolCall("sleep_forever", {"pid_file": str(pid_file)}), timeout=0.3)
        assert out == "error: sleep_forever gave no result within 0.3 s" and time.monotonic() - t0 < 5
        hung = int(pid_file.read_text())
        assert hung != os.getpid() and not alive(hung)  # it ran in a process of its own, now killed
    worker = int(run_tool(tools, ToolCall("pid", {})))
    assert worker != os.getpid() and alive(worker)
    assert len(WORKERS.live) <= WORKERS.size


def test_a_killed_worker_leaves_no_pipe_open():
    """Worker.kill (a hung call's worker, at its timeout) closes our ends of the worker's pipes at once, also with a
    request written that it never read: no descriptor is left to the garbage collector."""
    worker = Worker()
    worker.proc.stdin.write(b'{"ref": ')  # buffered, unflushed: close() flushes it into a dead pipe
    worker.kill()
    assert worker.proc.stdin.closed and worker.proc.stdout.closed and worker.proc.returncode is not None


def test_concurrent_calls_share_a_bounded_pool(tool_file):
    pool = Workers(size=2)
    ref = tool(tool_file, "pid").ref
    try:
        with ThreadPoolExecutor(8) as ex:
            pids = list(ex.map(lambda _: pool.call(ref, {}, 10.0)["result"], range(40)))
        assert 1 <= len(set(pids)) <= 2 and len(pool.live) <= 2
    finally:
        pool.close()
    assert not any(alive(int(p)) for p in set(pids))


@pytest.mark.slow
def test_a_process_whose_episode_calls_a_hung_tool_exits_promptly(tool_file, tmp_path, tiny_model_dir):
    """An episode in a child process: the model calls a tool that never returns; the episode goes on after the
    timeout, and the process exits at once when it is done (a thread running the tool kept it alive forever)."""
    code = textwrap.dedent(f"""
        import concurrent.futures, sys
        sys.path.insert(0, {str(ROOT)!r})
        from engines import Completion, EngineHandle
        from models import load_tokenizer
        from workflows.episode import Episode
        from workflows.tools import Tool, parse_tool_calls, run_tool, tool_message

        class Engine:
            model_version = 0
            def __init__(self, tok, texts):
                self.tok, self.texts = tok, texts
            def submit(self, ids, params):
                text = self.texts.pop(0)
                out = self.tok.encode(text, add_special_tokens=False) + [self.tok.eos_token_id]
                f = concurrent.futures.Future()
                f.set_result([Completion(out, [-0.5] * len(out), text, "stop")])
                return f

        tok = load_tokenizer({tiny_model_dir!r})
        call = '<tool_call>{{"name": "sleep_forever", "arguments": {{"pid_file": "{tmp_path / "x.pid"}"}}}}</tool_call>'
        model = EngineHandle(Engine(tok, [call, "#### 5"]), tok, {{"max_tokens": 200}})
        hang = Tool("sleep_forever", {str(tool_file)!r} + ":sleep_forever", "", {{}})
        ep = Episode(model, [{{"role": "user", "content": "2 + 3?"}}], [hang])
        (c,) = parse_tool_calls(ep.reply())
        ep.add([tool_message(run_tool([hang], c, timeout=0.5))])
        print(ep.reply(), ep.messages[-2]["content"], flush=True)
    """)
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "#### 5 error: sleep_forever gave no result within 0.5 s"
    assert time.monotonic() - t0 < 60
    assert not alive(int((tmp_path / "x.pid").read_text()))


def test_tool_calls_are_parsed_never_evaluated():
    text = (
        '<tool_call>{"name": "calc", "arguments": {"expression": "2+3"}}</tool_call> then '
        '<tool_call>{"name": "calc", "arguments": "2+3"}</tool_call><tool_call>[1]</tool_call>'
        '<tool_call>{nope}</tool_call><tool_call>{"name": "calc"'
    )
    calls = parse_tool_calls(text)
    assert calls[0] == ToolCall("calc", {"expression": "2+3"})
    assert [c.error for c in calls[1:]] == [
        "the tool call's arguments must be a JSON object",
        'a tool call needs {"name": ..., "arguments": {...}}',
        "the tool call is not valid JSON (Expecting property name enclosed in double quotes)",
        "a <tool_call> without its </tool_call>",
    ]
    assert parse_tool_calls("no call, just __import__('os').system('x')") == []


CALL = '<tool_call>{"name": "calc", "arguments": {"expression": "2+3"}}</tool_call>'


@pytest.mark.parametrize(
    "text,calls",
    [
        (f"<think>maybe {CALL}? no</think>The answer is 5.", 0),  # thought about, not made
        (f"<think>let me compute</think>\n\n{CALL}", 1),
        (f"<think>first {CALL}</think>{CALL}<think>and again {CALL}", 1),  # an unclosed block runs to the end
        (f"I open no block, {CALL}</think>#### 5", 0),  # <think> was in the prompt: before </think> is thinking
        (f"plain {CALL}", 1),
    ],
)
def test_tool_calls_inside_thinking_are_not_made(text, calls):
    assert len(parse_tool_calls(text)) == calls
    assert "<think>" not in strip_thinking(text) and "</think>" not in strip_thinking(text)


@pytest.mark.parametrize(
    "expression,value", [("37 + 58 - 12", "83"), ("7 / 2", "3.5"), ("-(2 + 3) * 4", "-20"), (" 10 - 66 - 27 ", "-83")]
)
def test_the_calculator_computes_arithmetic(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize(
    "expression",
    ["__import__('os').system('echo hacked')", "2 ** 999999", "a + 1", "1 +", "[1, 2]", "9" * 300, "open('x')"],
)
def test_the_calculator_refuses_everything_else_without_running_it(expression):
    with pytest.raises(ValueError):
        calculate(expression)


def test_the_calculator_tool_answers_from_many_threads_at_once():
    calls = [ToolCall("calculator", {"expression": f"{k} + 1"}) for k in range(50)]
    results = [None] * 50

    def go(k):
        results[k] = run_tool([CALCULATOR], calls[k])

    threads = [threading.Thread(target=go, args=(k,)) for k in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [str(k + 1) for k in range(50)]


@pytest.mark.slow
def test_the_tool_call_benchmark_runs():
    """scripts/bench_tools.py (the README's and docs/LOG.md's figures) in a tiny shape: each figure a median."""
    out = subprocess.run(
        [sys.executable, "scripts/bench_tools.py", "--runs", "2", "--calls", "5"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    for what in ("first call (starts a worker)", "a pooled call", "the calculator in-process"):
        assert f"{what}: median " in out.stdout and " ms over 2 runs" in out.stdout


# --- containment: process groups, parser failures, result size, environment


def test_a_process_a_timed_out_tool_started_is_killed_with_it(tool_file, tmp_path):
    """The worker leads a process group of its own and the whole group is killed at the timeout: the `sleep 60`
    the tool started dies too (killing the worker alone left it running); a later call still answers."""
    pid_file = tmp_path / "child.pid"
    tools = [tool(tool_file, "spawn_and_hang"), tool(tool_file, "add")]
    out = run_tool(tools, ToolCall("spawn_and_hang", {"pid_file": str(pid_file)}), timeout=1.0)
    assert out == "error: spawn_and_hang gave no result within 1 s"
    child = int(pid_file.read_text())
    assert gone_within(child, 5.0), f"the tool's child {child} outlived its worker"
    assert run_tool(tools, ToolCall("add", {"a": 1, "b": 2})) == "3"


@pytest.mark.parametrize(
    "body,error",
    [
        ("[" * 100000, "error: the tool call's JSON is nested too deeply"),
        (
            '{"name": "add", "arguments": {"a": ' + "[" * 1000 + "]" * 1000 + "}}",
            "error: the tool call's JSON is nested",
        ),
        (
            '{"name": "add", "arguments": {"a": ' + "7" * 5000 + ', "b": 1}}',
            "error: the tool call's JSON cannot be read (ValueError: Exceeds the limit (4300 digits)",
        ),
    ],
)
def test_a_tool_call_that_breaks_the_json_parser_is_an_error_for_the_model(tool_file, body, error):
    """RecursionError and ValueError from json.loads (not JSONDecodeError) escaped parse_tool_calls and lost the
    whole group; now each is the call's error, and the next call in the same reply still runs."""
    calls = parse_tool_calls(
        f'<tool_call>{body}</tool_call><tool_call>{{"name": "add", "arguments": {{"a": 2, "b": 3}}}}</tool_call>'
    )
    tools = [tool(tool_file, "add")]
    assert run_tool(tools, calls[0]).startswith(error) and run_tool(tools, calls[1]) == "5"


def test_arguments_that_cannot_be_sent_to_a_worker_are_an_error_not_an_exception(tool_file):
    out = run_tool([tool(tool_file, "add")], ToolCall("add", {"a": {1}, "b": 2}))
    assert out.startswith("error: the tool call's arguments cannot be sent to the tool (TypeError:")


class Scripted:
    """Plays the model: each request gets the next scripted text's ids and EOS, whatever its length."""

    model_version = 0

    def __init__(self, tokenizer, texts: list[str]) -> None:
        self.tokenizer, self.texts = tokenizer, list(texts)

    def submit(self, ids, params) -> concurrent.futures.Future:
        text = self.texts.pop(0)
        out = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        f = concurrent.futures.Future()
        f.set_result([Completion(out, [-0.5] * len(out), text, "stop")])
        return f


def test_a_group_whose_model_sends_deeply_nested_json_is_scored_not_lost(tiny_model_dir):
    """tool_workflow, 2 episodes: one sends `[` * 100000 in a tool call, reads the error and answers; the other
    answers at once. Both are scored (the RecursionError used to end the task's whole group)."""
    tok = load_tokenizer(tiny_model_dir)
    model = EngineHandle(
        Scripted(tok, ["<tool_call>" + "[" * 100000 + "</tool_call>", "#### 83", "#### 83"]),
        tok,
        {"max_tokens": 200000},
    )
    task = tool_task(repeat_times=2)
    exps = build_workflow(task, model).run()
    assert [e.reward for e in exps] == pytest.approx([1.1, 1.1])
    assert [(e.metrics["turns"], e.metrics["tool_calls"]) for e in exps] == [(2, 1), (1, 0)]
    assert "<|im_start|>tool\nerror: the tool call's JSON is nested too deeply<|im_end|>" in tok.decode(exps[0].tokens)


def test_a_huge_result_is_cut_quickly_and_says_so(tool_file):
    """50 MiB back from a tool: cut in the worker to MAX_RESULT_BYTES, with a notice, in well under the timeout (the
    reply used to be read into a growing buffer, quadratically, and the call was reported as a timeout)."""
    tools = [tool(tool_file, "huge"), tool(tool_file, "huge_error")]
    t0 = time.monotonic()
    out = run_tool(tools, ToolCall("huge", {"n": 50 << 20}), timeout=10.0)
    assert time.monotonic() - t0 < 5.0
    assert out == "x" * MAX_RESULT_BYTES + f"... [cut: result was {50 << 20} bytes, cap {MAX_RESULT_BYTES}]"
    out = run_tool(tools, ToolCall("huge_error", {"n": 10 << 20}), timeout=10.0)
    assert out.startswith("error: ValueError: yyy") and out.endswith(f"bytes, cap {MAX_RESULT_BYTES}]")
    assert len(out) < MAX_RESULT_BYTES + 100
    assert run_tool(tools, ToolCall("huge", {"n": MAX_RESULT_BYTES})) == "x" * MAX_RESULT_BYTES  # at the cap: whole


def test_a_cut_counts_utf8_bytes_and_splits_no_character():
    text = "a" + "\N{GRINNING FACE}" * MAX_RESULT_BYTES  # 4 bytes each: the cap falls inside a character
    out = cut(text)
    kept, notice = out.split("... [cut: ")
    assert kept == "a" + "\N{GRINNING FACE}" * ((MAX_RESULT_BYTES - 1) // 4)
    assert notice == f"result was {1 + 4 * MAX_RESULT_BYTES} bytes, cap {MAX_RESULT_BYTES}]"
    assert cut("\N{GRINNING FACE}" * (MAX_RESULT_BYTES // 4)) == "\N{GRINNING FACE}" * (MAX_RESULT_BYTES // 4)


def test_a_reply_over_the_reply_cap_is_refused_in_one_pass():
    """Worker.read on a pipe that never sends a newline (only a tool writing to the reply pipe itself could): it
    stops at MAX_REPLY_BYTES, it does not wait for the timeout."""
    worker = Worker()
    try:
        r, w = os.pipe()
        worker.proc.stdout.close()
        worker.proc.stdout = os.fdopen(r, "rb")
        writer = threading.Thread(target=lambda: os.write(w, b"z" * (MAX_REPLY_BYTES + 1)) and os.close(w))
        writer.start()
        t0 = time.monotonic()
        assert worker.read(30.0) == {"lost": f"the tool broke its worker: its reply is over {MAX_REPLY_BYTES} bytes"}
        assert time.monotonic() - t0 < 10.0
    finally:
        worker.kill()
        writer.join()


def test_a_worker_does_not_inherit_the_explorers_secrets(tool_file, monkeypatch):
    """Only ENV_ALLOWED, LC_* and the names in NANORFT_TOOL_ENV reach a worker (a fresh pool: the environment is
    read when a worker starts)."""
    for name, value in {
        "HF_TOKEN": "hf_secret",
        "PGPASSWORD": "pg_secret",
        "AWS_SECRET_ACCESS_KEY": "aws",
        "LC_TIME": "C",
        "NANORFT_TOOL_ENV": "MY_TOOL_KEY, OTHER",
        "MY_TOOL_KEY": "k1",
    }.items():
        monkeypatch.setenv(name, value)
    pool = Workers(size=1)
    try:
        out = pool.call(tool(tool_file, "environ").ref, {}, 30.0)
    finally:
        pool.close()
    env = json.loads(out["result"])
    assert not {"HF_TOKEN", "PGPASSWORD", "AWS_SECRET_ACCESS_KEY"} & set(env)
    assert "hf_secret" not in out["result"] and "pg_secret" not in out["result"]
    assert env["PATH"] == os.environ["PATH"] and env["LC_TIME"] == "C" and env["MY_TOOL_KEY"] == "k1"
