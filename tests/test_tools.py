"""workflows/tools.py, tool_workers.py, calculator.py: tool calls parsed as JSON outside the model's thinking, run in
worker processes that are killed at their timeout (a hung tool holds nothing, and the process still exits), the
calculator."""

import os
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from workflows.calculator import calculate
from workflows.tool_use import CALCULATOR
from workflows.tool_workers import WORKERS, Worker, Workers
from workflows.tools import Tool, ToolCall, ToolError, parse_tool_calls, run_tool, strip_thinking

ROOT = Path(__file__).resolve().parents[1]

# Tool functions for the tests, in a file of their own (a worker loads it by path: standard library only)
TOOL_FILE = '''
import os, time


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
'''


@pytest.fixture
def tool_file(tmp_path) -> Path:
    path = tmp_path / "my_tools.py"
    path.write_text(TOOL_FILE)
    return path


def tool(path: Path, name: str) -> Tool:
    return Tool(name, f"{path}:{name}", name, {"type": "object"})


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_failing_tool_is_an_observation_not_a_crash(tool_file):
    tools = [tool(tool_file, n) for n in ("add", "boom", "die")]
    assert run_tool(tools, ToolCall("add", {"a": 2, "b": 3})) == "5"
    assert run_tool(tools, ToolCall("sub", {})) == "error: unknown tool 'sub'; available: add, boom, die"
    assert run_tool(tools, ToolCall("add", {"a": 1})).startswith("error: TypeError:")
    assert run_tool(tools, ToolCall("boom", {})) == "error: ZeroDivisionError: division by zero"
    assert run_tool(tools, ToolCall("", {}, "bad JSON")) == "error: bad JSON"
    assert run_tool(tools, ToolCall("die", {})) == "error: the tool's process died"
    assert run_tool(tools, ToolCall("add", {"a": "x", "b": "y"})) == "xy"  # a fresh worker after the dead one
    assert tools[0].schema() == {"type": "function", "function": {"name": "add", "description": "add",
                                                                  "parameters": {"type": "object"}}}


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


def test_a_process_whose_episode_calls_a_hung_tool_exits_promptly(tool_file, tmp_path, tiny_model_dir):
    """An episode in a child process: the model calls a tool that never returns; the episode goes on after the
    timeout, and the process exits at once when it is done (a thread running the tool kept it alive forever)."""
    code = textwrap.dedent(f"""
        import concurrent.futures, sys
        sys.path.insert(0, {str(ROOT)!r})
        from engines import Completion, ModelHandle
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
        call = '<tool_call>{{"name": "sleep_forever", "arguments": {{"pid_file": "{tmp_path / 'x.pid'}"}}}}</tool_call>'
        model = ModelHandle(Engine(tok, [call, "#### 5"]), tok, {{"max_tokens": 200}})
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


CALL = '<tool_call>{"name": "calc", "arguments": {"expression": "2+3"}}</tool_call>'


@pytest.mark.parametrize("text,calls", [
    (f"<think>maybe {CALL}? no</think>The answer is 5.", 0),  # thought about, not made
    (f"<think>let me compute</think>\n\n{CALL}", 1),
    (f"<think>first {CALL}</think>{CALL}<think>and again {CALL}", 1),  # an unclosed block runs to the end
    (f"I open no block, {CALL}</think>#### 5", 0),  # <think> was in the prompt: before </think> is thinking
    (f"plain {CALL}", 1)])
def test_tool_calls_inside_thinking_are_not_made(text, calls):
    assert len(parse_tool_calls(text)) == calls
    assert "<think>" not in strip_thinking(text) and "</think>" not in strip_thinking(text)


@pytest.mark.parametrize("expression,value", [("37 + 58 - 12", "83"), ("7 / 2", "3.5"), ("-(2 + 3) * 4", "-20"),
                                              (" 10 - 66 - 27 ", "-83")])
def test_the_calculator_computes_arithmetic(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize("expression", ["__import__('os').system('echo hacked')", "2 ** 999999", "a + 1", "1 +",
                                        "[1, 2]", "9" * 300, "open('x')"])
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


def test_the_tool_call_benchmark_runs():
    """scripts/bench_tools.py (the README's and docs/LOG.md's figures) in a tiny shape: each figure a median."""
    out = subprocess.run([sys.executable, "scripts/bench_tools.py", "--runs", "2", "--calls", "5"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    for what in ("first call (starts a worker)", "a pooled call", "the calculator in-process"):
        assert f"{what}: median " in out.stdout and " ms over 2 runs" in out.stdout
