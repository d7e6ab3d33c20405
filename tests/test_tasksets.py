"""Tasksets: files in Hugging Face layout, formats, several tasksets, epochs, seeded order, saved position."""

import dataclasses
import json
import os
import socket
import time
from pathlib import Path

import datasets
import huggingface_hub
import pytest

import tasksets
from configs import derive, from_dict
from configs.schema import BufferConfig, Config, FormatConfig, TasksetConfig
from tasksets import (
    DataError,
    TaskReader,
    find_data_files,
    format_row,
    load_tasks,
    read_rows,
    total_steps,
)

ROOT = Path(__file__).resolve().parents[1]
GSM8K = ROOT / "tests/data/gsm8k"


def taskset(path, **kw) -> TasksetConfig:
    """A derived TasksetConfig, as the explorer gets it."""
    fmt = kw.pop("format", {"prompt_key": "question", "response_key": "answer"})
    raw = {
        "model": {"model_path": "m", "max_model_len": 64},
        "algorithm": {"algorithm_type": "grpo", "repeat_times": 4},
        "buffer": {
            "default_workflow_type": "math_workflow",
            "default_reward_fn_type": "math_reward",
            "explorer_input": {"taskset": {"path": str(path), "format": fmt, **kw}},
        },
    }
    return derive(from_dict(Config, raw)).buffer.explorer_input.tasksets[0]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def rows(n: int, tag: str = "q") -> list[dict]:
    return [{"question": f"{tag}{i}", "answer": f"#### {i}"} for i in range(n)]


def test_real_gsm8k_in_hf_layout():
    tasks = load_tasks(taskset(GSM8K, subset_name="main", split="test"))
    assert len(tasks) == 1319
    first = json.loads((GSM8K / "main/test.jsonl").read_text().splitlines()[0])
    t = tasks[0]
    assert t.prompt == first["question"] and t.reference == first["answer"] and t.reference.split("####")[-1].strip()
    assert t.messages == [{"role": "user", "content": first["question"]}]
    assert (t.taskset, t.index, t.task_id, t.repeat_times) == ("taskset_0", 0, "taskset_0/0", 4)
    assert (t.workflow, t.reward_fn) == ("math_workflow", "math_reward")
    assert len(load_tasks(taskset(GSM8K, subset_name="main", split="train"))) == 300
    assert len(load_tasks(taskset(GSM8K / "main/train.jsonl"))) == 300  # a single file


@pytest.mark.parametrize("ext", ["jsonl", "json", "parquet", "csv"])
def test_file_types_and_shard_names(tmp_path, ext):
    ds = datasets.Dataset.from_list(rows(10))
    folder = tmp_path / "data"
    folder.mkdir()
    writer = {
        "jsonl": lambda p: ds.to_json(p, lines=True),
        "json": lambda p: Path(p).write_text(json.dumps(rows(10))),
        "parquet": ds.to_parquet,
        "csv": ds.to_csv,
    }[ext]
    writer(str(folder / f"train-00000-of-00001.{ext}"))  # the hub's parquet naming, under data/
    assert find_data_files(str(tmp_path), None, "train") == [folder / f"train-00000-of-00001.{ext}"]
    tasks = load_tasks(taskset(tmp_path))
    assert [t.prompt for t in tasks] == [f"q{i}" for i in range(10)]


def test_missing_split_or_subset_is_a_clear_error(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", rows(3))
    with pytest.raises(DataError, match=r"no 'validation' split"):
        load_tasks(taskset(tmp_path, split="validation"))
    with pytest.raises(DataError, match=r"no sub-folder 'main'"):
        load_tasks(taskset(tmp_path, subset_name="main"))


def test_missing_column_names_file_row_and_key(tmp_path):
    data = rows(5)
    del data[3]["answer"]
    f = write_jsonl(tmp_path / "train.jsonl", data)
    # a JSON row without a key that other rows have reads as null: named as null, not as a missing column
    with pytest.raises(DataError, match=rf"{f}: row 3: column 'answer' \(format.response_key\) is null"):
        load_tasks(taskset(tmp_path))
    with pytest.raises(DataError, match=r"row 0: missing column 'prompt' \(format.prompt_key\)"):
        load_tasks(taskset(tmp_path, format={"response_key": "answer"}))


@pytest.mark.slow
def test_hub_name_offline_says_what_was_tried(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    # NOTE: both libraries read the variable once, when imported (above): without these the hub is tried, and its
    # retries wait ~20 s for a network that is not there
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    t0 = time.time()
    with pytest.raises(DataError, match=r"'no-such-org/no-such-set' is not a local file or folder.*hub.*subset 'main'"):
        read_rows("no-such-org/no-such-set", "main", "train")
    assert time.time() - t0 < 60


def test_format_keys(tmp_path):
    fmt = FormatConfig(prompt_key="q", response_key="a", system_prompt="Be brief.")
    row = {"q": "1+1?", "a": "2", "sys": "Row system.", "tools": [{"name": "calc"}]}
    got = format_row(row, fmt, "w")
    assert got["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}]
    assert got["reference"] == "2" and got["tools"] == [{"name": "calc"}]
    got = format_row(
        row, FormatConfig(prompt_key="q", response_key="a", system_prompt="x", system_prompt_key="sys"), "w"
    )
    assert got["messages"][0]["content"] == "Row system."  # the column wins over the fixed prompt
    sft = format_row(row, FormatConfig(prompt_key="q", response_key="a"), "w", kind="sft")
    assert sft["messages"][-1] == {"role": "assistant", "content": "2"}
    conv = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    mfmt = FormatConfig(prompt_type="messages", system_prompt="S")
    assert format_row(conv, mfmt, "w", kind="sft")["messages"][0] == {"role": "system", "content": "S"}
    task = format_row(conv, mfmt, "w")
    assert task["messages"][-1]["role"] == "user" and task["reference"] == "hello"
    with pytest.raises(DataError, match="must end with an assistant message"):
        format_row({"messages": conv["messages"][:1]}, mfmt, "w", kind="sft")
    with pytest.raises(DataError, match="list of {role, content} messages"):
        format_row({"messages": "hi"}, mfmt, "w")
    dpo = format_row(
        {"prompt": "p", "good": "g", "bad": "b"}, FormatConfig(chosen_key="good", rejected_key="bad"), "w", kind="dpo"
    )
    assert (dpo["chosen"], dpo["rejected"], dpo["messages"][-1]["content"]) == ("g", "b", "p")
    with pytest.raises(DataError, match=r"w: missing column 'rejected' \(format.rejected_key\)"):
        format_row({"prompt": "p", "chosen": "g"}, FormatConfig(), "w", kind="dpo")


def test_several_tasksets_interleave_in_proportion(tmp_path):
    a = taskset(write_jsonl(tmp_path / "a/train.jsonl", rows(6, "a")).parent, name="a")
    b = taskset(write_jsonl(tmp_path / "b/train.jsonl", rows(3, "b")).parent, name="b")
    reader = TaskReader([a, b], total_epochs=1)
    got = [t.prompt for t in reader.read(100)]
    assert sorted(got) == sorted([f"a{i}" for i in range(6)] + [f"b{i}" for i in range(3)])  # each task once
    assert got[:3] == ["a0", "b0", "a1"]  # b's three tasks are spread through the epoch, not appended
    assert reader.read(5) == []


def test_epochs_shuffle_and_saved_position(tmp_path):
    ts = taskset(
        write_jsonl(tmp_path / "train.jsonl", rows(10)).parent, data_selector={"selector_type": "shuffle", "seed": 7}
    )
    whole = TaskReader([ts], total_epochs=3)
    all_tasks = whole.read(1000)
    assert len(all_tasks) == 30 and [t.epoch for t in all_tasks] == [0] * 10 + [1] * 10 + [2] * 10
    epoch0, epoch1 = [t.index for t in all_tasks[:10]], [t.index for t in all_tasks[10:20]]
    assert sorted(epoch0) == list(range(10)) and epoch0 != list(range(10)) and epoch0 != epoch1
    assert [t.index for t in TaskReader([ts], 1).read(10)] == epoch0  # seeded: the same order every run
    # save after 13 tasks (mid-epoch 1), restore in a new reader: the rest continues exactly
    first = TaskReader([ts], total_epochs=3)
    head = first.read(7) + first.read(6)
    state = json.loads(json.dumps(first.state()))
    second = TaskReader([ts], total_epochs=3)
    second.load_state(state)
    tail = second.read(1000)
    assert [(t.epoch, t.index) for t in head + tail] == [(t.epoch, t.index) for t in all_tasks]
    with pytest.raises(DataError, match="sizes"):
        TaskReader([taskset(write_jsonl(tmp_path / "o/train.jsonl", rows(4)).parent)], 1).load_state(state)


def test_the_step_count_is_the_steps_the_reader_fills(tmp_path):
    """5 tasks, 2 per step, 2 epochs: 5 steps (a step fills across the epoch's end), as the reader gives them; the
    trainer's count for 4 experiences per task, 8 per step, is the same. Before, the explorer counted ceil(5 / 2) per
    epoch, 6 steps: it went to a sync point after its last step and could skip its final eval."""
    ts = taskset(write_jsonl(tmp_path / "train.jsonl", rows(5)).parent)
    buffer = BufferConfig(batch_size=2, train_batch_size=8, total_epochs=2)
    reader, steps = TaskReader([ts], total_epochs=2), 0
    while reader.read(2):
        steps += 1
    assert steps == total_steps(buffer, 5) == total_steps(buffer, 5, per_task=4, per_step=8) == 5
    assert total_steps(dataclasses.replace(buffer, total_steps=3), 5) == 3


def test_sequential_is_file_order_and_random_is_seeded(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", rows(8)).parent
    assert [t.index for t in TaskReader([taskset(path)], 1).read(8)] == list(range(8))
    rnd = taskset(path, data_selector={"selector_type": "random", "seed": 1})
    one, two = TaskReader([rnd], 1).read(8), TaskReader([rnd], 1).read(8)
    assert [t.index for t in one] == [t.index for t in two] and len({t.index for t in one}) < 8  # with replacement


@pytest.mark.parametrize(
    "bad, named",
    [
        (b'{"question": "x", "answer": \n', "line 3: not valid JSON (Expecting value at column 29)"),  # its end
        (b'{"question": "x\xff", "answer": "2"}\n', "line 3: not UTF-8 (byte 0xff at byte 16)"),
        (b"[1, 2]\n", "line 3: a JSON list, not an object (one row per line)"),
        (  # issue 46: pyarrow's "Trailing data at position 34", no line
            b'{"question": "x\\ud800", "answer": "2"}\n',
            "line 3: a lone surrogate \\ud800 (half of a UTF-16 pair, escaped alone) in a string: not text; fix or "
            "drop the row",
        ),
    ],
)
def test_a_bad_line_is_named_by_file_and_line(tmp_path, bad, named):
    good = b'{"question": "a", "answer": "1"}\n'
    (tmp_path / "train.jsonl").write_bytes(good + good + bad + good)
    with pytest.raises(DataError) as e:
        read_rows(str(tmp_path))
    assert str(e.value) == f"{tmp_path / 'train.jsonl'}: {named}"


@pytest.mark.parametrize(
    "name, data, named",
    [
        (
            "train.json",
            b'{"question": "a", "answer": "1"}\n{"question": "b", "answer": 2\n',  # JSON lines in a .json
            "line 2: not valid JSON (Expecting ',' delimiter at column 30)",
        ),
        ("train.json", b'[{"question": "a", "answer": "1"},\n {"question": "b"\n', "line 3: not valid JSON"),
        ("train.json", b'{"question": "a", "answer": "1"}\n[1, 2]\n', "line 2: a JSON list, not an object"),
        (
            "train.json",  # issue 46: a lone surrogate in a JSON document (a paired one on line 2 is text)
            b'[{"question": "a", "answer": "1"},\n {"question": "\\ud83d\\ude00", "answer": "1"},\n'
            b' {"question": "b\\udc00", "answer": "2"}]\n',
            "line 3: a lone surrogate \\udc00 (half of a UTF-16 pair, escaped alone) in a string",
        ),
        ("train.jsonl", b"", "empty: no rows"),
        ("train.jsonl", b"\n\n", "empty: no rows"),
        ("train.csv", b"", "empty: no rows"),
        ("train.csv", b'question,answer\na,1\n"b,2\n', "cannot be read (ParserError: Error tokenizing data"),
    ],
)
def test_a_file_that_cannot_be_read_says_why(tmp_path, name, data, named):
    """No StopIteration or bare DatasetGenerationError: the line that is wrong, that the file is empty, or the
    parser's own error underneath."""
    (tmp_path / name).write_bytes(data)
    with pytest.raises(DataError) as e:
        read_rows(str(tmp_path))
    assert str(e.value).startswith(f"{tmp_path / name}: {named}")


def _not_a_file(kind: str, where: Path) -> None:
    """Make `where` a thing that is not a regular file: a link to /dev/zero, a FIFO, a socket, a directory."""
    if kind == "dev-zero":
        where.symlink_to("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(where)
    elif kind == "socket":
        sock, cwd = socket.socket(socket.AF_UNIX), os.getcwd()
        os.chdir(where.parent)  # NOTE: bound by its relative name: a socket's path is limited to ~107 bytes
        try:
            sock.bind(where.name)
        finally:
            os.chdir(cwd)
            sock.close()  # the socket file stays
    else:
        where.mkdir()


@pytest.mark.parametrize(
    "kind, what, named",
    [
        (kind, what, named)
        for kind, what in [
            ("dev-zero", " (a link to /dev/zero) is a character device"),
            ("fifo", " is a FIFO (named pipe)"),
            ("socket", " is a socket"),
            ("directory", " is a directory"),
        ]
        for named in ("as the path", "in a folder")
        if (kind, named) != ("directory", "as the path")  # a folder given as the path is a Hugging Face layout
    ],
)
def test_only_regular_files_are_read_as_data(tmp_path, kind, what, named):
    """Issue 46: a train.jsonl that is a link to /dev/zero ate all memory, a FIFO hung the explorer. Each is a
    DataError naming the path and what it is, before anything is read; a link to a regular file still reads."""
    folder = tmp_path / "set"
    folder.mkdir()
    target = folder / "train.jsonl"
    _not_a_file(kind, target)
    with pytest.raises(DataError) as e:
        read_rows(str(target if named == "as the path" else folder))
    assert str(e.value).startswith(f"{target}{what}, not a data file: point the path at a regular file")
    write_jsonl(tmp_path / "real.jsonl", rows(2))
    (tmp_path / "linked.jsonl").symlink_to(tmp_path / "real.jsonl")
    assert [r["question"] for _, _, r in read_rows(str(tmp_path / "linked.jsonl"))] == ["q0", "q1"]


def test_a_line_longer_than_the_limit_is_named_before_it_is_read_whole(tmp_path, monkeypatch):
    """A JSONL line (or a CSV's) is read with a bound: one over tasksets.MAX_LINE_BYTES is a DataError with the file
    and the line number; lines within it read as before."""
    monkeypatch.setattr(tasksets, "MAX_LINE_BYTES", 1000)
    path = write_jsonl(tmp_path / "train.jsonl", [*rows(1), {"question": "x" * 2000, "answer": "1"}, *rows(1)])
    with pytest.raises(DataError, match=r"train.jsonl: line 2: longer than 1,000 bytes \(tasksets.MAX_LINE_BYTES\)"):
        read_rows(str(path))
    (tmp_path / "t.csv").write_text("question,answer\n" + "y" * 1200 + ",1\n")
    with pytest.raises(DataError, match="t.csv: line 2: longer than 1,000 bytes"):
        read_rows(str(tmp_path / "t.csv"))
    write_jsonl(path, [*rows(1), {"question": "x" * 900, "answer": "1"}])
    assert len(read_rows(str(path))) == 2


def test_a_prompt_over_the_character_bound_is_cut_before_tokenising_and_named(tmp_path, caplog):
    """Issue 46: a 10 MB question was tokenised whole, then cut to its last max_prompt_tokens tokens. A prompt over
    CHARS_PER_TOKEN x max_prompt_tokens characters is cut as it is read, keeping its end (what the engine's cut keeps),
    and marked (prompt_cut: its experiences get prompt_truncated); one warning names the taskset and the first row."""
    big = "x" * 2_000_000 + " the end: what is 2+2?"
    write_jsonl(tmp_path / "train.jsonl", [*rows(1), {"question": big, "answer": "4"}, *rows(1)])
    ts = dataclasses.replace(
        taskset(tmp_path), format=FormatConfig(prompt_key="question", response_key="answer", system_prompt="Be brief.")
    )
    bound = tasksets.PromptBound(chars=32 * 64, tokens=64, truncate=True)
    with caplog.at_level("WARNING", logger="nanorft.tasksets"):
        start = time.monotonic()
        tasks = load_tasks(ts, bound=bound)
        assert time.monotonic() - start < 30
    cut = tasks[1]
    assert [m["role"] for m in cut.messages] == ["system", "user"]  # every role stays
    assert sum(len(m["content"]) for m in cut.messages) == 32 * 64 and cut.messages[0]["content"] == ""
    assert cut.prompt == cut.messages[-1]["content"] and cut.prompt.endswith(" the end: what is 2+2?")
    assert cut.prompt_cut == len(big) + len("Be brief.") and [t.prompt_cut for t in (tasks[0], tasks[2])] == [0, 0]
    assert tasks[0].messages[-1]["content"] == "q0"  # the others as they were
    assert (
        f"taskset {ts.name}: 1 prompt(s) longer than 2,048 characters (tasksets.CHARS_PER_TOKEN 32 x 64 tokens, "
        "model.max_prompt_tokens) were cut to their last 2,048 characters before tokenising (their experiences are "
        f"marked prompt_truncated: no loss, as the engine's cut); the first: {tmp_path / 'train.jsonl'}: row 1 "
        "(2,000,031 characters)" in caplog.text
    )


def test_with_prompt_truncation_off_an_over_long_prompt_drops_its_task_by_name(tmp_path, caplog):
    """enable_prompt_truncation off: the engine would fail the task (PromptTooLong); it is dropped as it is read,
    with a warning naming it, the other tasks keep their row index."""
    write_jsonl(tmp_path / "train.jsonl", [*rows(1, "a"), {"question": "y" * 5000, "answer": "4"}, *rows(2, "b")])
    bound = tasksets.PromptBound(chars=1000, tokens=100, truncate=False)
    with caplog.at_level("WARNING", logger="nanorft.tasksets"):
        tasks = load_tasks(taskset(tmp_path), bound=bound)
    assert [t.index for t in tasks] == [0, 2, 3] and [t.prompt for t in tasks] == ["a0", "b0", "b1"]
    assert "were dropped, as model.enable_prompt_truncation is off (PromptTooLong); the first: " in caplog.text
    write_jsonl(tmp_path / "train.jsonl", [{"question": "y" * 5000, "answer": "4"}])
    with pytest.raises(DataError, match="has no rows once the 1 over-long prompt"):
        load_tasks(taskset(tmp_path), bound=bound)


def test_the_prompt_bound_follows_the_models_token_limits():
    """prompt_bound: CHARS_PER_TOKEN characters per token of model.max_prompt_tokens (else max_model_len)."""
    model = {"model_path": "m", "max_prompt_tokens": 100, "max_response_tokens": 8}
    cfg = derive(from_dict(Config, {"mode": "train", "model": model}))
    assert tasksets.prompt_bound(cfg.model) == tasksets.PromptBound(3200, 100, True)
    cfg.model.enable_prompt_truncation = False
    assert tasksets.prompt_bound(cfg.model) == tasksets.PromptBound(3200, 100, False)


def test_a_row_names_a_registered_workflow_or_the_yamls_own_never_code_to_import(tmp_path):
    """format.workflow_key / reward_fn_key: a row may name a registered workflow or reward function, or the one the
    YAML gives the taskset; a row naming code (a file or module:attr) is refused by name, and that code never runs."""
    ran = tmp_path / "ran"
    (tmp_path / "evil.py").write_text(f"import pathlib\npathlib.Path({str(ran)!r}).write_text('x')\nW = object\n")
    fmt = {"prompt_key": "question", "response_key": "answer", "workflow_key": "wf", "reward_fn_key": "rf"}
    good = [{**r, "wf": "countdown", "rf": "format_reward"} for r in rows(2)] + [rows(1)[0]]
    tasks = load_tasks(taskset(write_jsonl(tmp_path / "ok" / "train.jsonl", good), format=fmt))
    assert [(t.workflow, t.reward_fn) for t in tasks] == [("countdown", "format_reward")] * 2 + [(None, None)]
    own = write_jsonl(tmp_path / "own" / "train.jsonl", [{**rows(1)[0], "wf": f"{tmp_path}/evil.py:W"}])
    (task,) = load_tasks(taskset(own, format=fmt, default_workflow_type=f"{tmp_path}/evil.py:W"))
    assert task.workflow == f"{tmp_path}/evil.py:W"  # the YAML names it: trusted (loaded when the workflow is built)
    for column, value in (
        ("wf", f"{tmp_path}/evil.py:W"),
        ("wf", "os:system"),
        ("rf", "builtins:exec"),
        ("rf", "x\\evil.py"),
        ("wf", {"module": "os"}),
    ):
        bad = write_jsonl(tmp_path / "bad" / "train.jsonl", [rows(1)[0], {**rows(1)[0], column: value}])  # rows 0, 1
        with pytest.raises(
            DataError,
            match=rf"row 1: column '{column}' names the (workflow|reward function) .*: a "
            "row may name a registered .* never code to import",
        ):
            load_tasks(taskset(bad, format=fmt))
    assert not ran.exists()


def verl_rows() -> list[dict]:
    """Two rows in veRL's parquet shape (verl/examples/data_preprocess/gsm8k.py): the prompt a chat, the answer in
    reward_model.ground_truth, a struct of extras."""
    return [
        {
            "data_source": "openai/gsm8k",
            "ability": "math",
            "prompt": [{"role": "user", "content": f"What is {a} x 7? Answer after ####."}],
            "reward_model": {"style": "rule", "ground_truth": str(a * 7)},
            "extra_info": {"split": "train", "index": i, "system": "Be brief.", "reward": "math_reward"},
        }
        for i, a in enumerate((6, 9))
    ]


def test_a_verl_parquet_reads_through_dotted_keys_and_scores(tmp_path):
    """format keys walk into struct columns: the reference is the ground-truth string (not None, not the dict), the
    chat prompt comes out as the messages, and math_reward scores a right answer 1.0 (it scored 0.0 on the dict)."""
    from workflows.math import math_reward

    path = tmp_path / "train.parquet"
    datasets.Dataset.from_list(verl_rows()).to_parquet(str(path))
    fmt = {
        "prompt_key": "prompt",
        "response_key": "reward_model.ground_truth",
        "system_prompt_key": "extra_info.system",
        "reward_fn_key": "extra_info.reward",
    }
    tasks = load_tasks(taskset(path, format=fmt))
    assert [t.reference for t in tasks] == ["42", "63"] and tasks[0].prompt is None
    assert tasks[1].messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 9 x 7? Answer after ####."},
    ]
    assert tasks[0].reward_fn == "math_reward" and tasks[0].raw["extra_info"]["index"] == 0
    assert math_reward("6 x 7 = 42\n#### 42", tasks[0].reference)["accuracy"] == 1.0
    assert math_reward("#### 41", tasks[0].reference)["accuracy"] == 0.0
    chat = load_tasks(
        taskset(
            path,
            format={"prompt_type": "messages", "messages_key": "prompt", "response_key": "reward_model.ground_truth"},
        )
    )
    assert [(t.messages, t.reference) for t in chat] == [(t.messages[1:], t.reference) for t in tasks]
    # naming the struct itself is refused, with the dotted key that would work
    with pytest.raises(
        DataError,
        match=rf"{path}: row 0: column 'reward_model' \(format.response_key\) holds a "
        r"struct \(dict\), not text: .*dotted key: reward_model.style or "
        r"reward_model.ground_truth$",
    ):
        load_tasks(taskset(path, format={"prompt_key": "prompt", "response_key": "reward_model"}))


def test_a_top_level_column_with_a_dot_wins_over_the_nested_path(tmp_path):
    f = write_jsonl(tmp_path / "train.jsonl", [{"q.text": "hi", "a": {"b": "nested"}, "a.b": "top"}])
    (t,) = load_tasks(taskset(f, format={"prompt_key": "q.text", "response_key": "a.b"}))
    assert (t.prompt, t.reference) == ("hi", "top")
    dpo = format_row(
        {"p": {"q": "p"}, "pair": {"good": "g", "bad": 2}},
        FormatConfig(prompt_key="p.q", chosen_key="pair.good", rejected_key="pair.bad"),
        "w",
        kind="dpo",
    )
    assert (dpo["chosen"], dpo["rejected"]) == ("g", "2")


@pytest.mark.parametrize(
    "data, fmt, named",
    [
        (
            [{"question": "q", "answer": "1"}, {"question": "q", "answer": None}],
            {},
            r"row 1: column 'answer' \(format.response_key\) is null",
        ),
        (
            [{"question": "q", "answer": {"value": "1", "n": 2}}],
            {},  # only its text fields are offered
            r"row 0: column 'answer' \(format.response_key\) holds a struct \(dict\), not text: .*key: answer.value$",
        ),
        ([{"question": "q", "answer": ["1", "2"]}], {}, r"row 0: column 'answer' \(format.response_key\) holds a list"),
        ([{"question": "q", "answer": True}], {}, r"row 0: column 'answer' \(format.response_key\) holds a boolean"),
        (
            [{"question": {"text": "q"}, "answer": "1"}],
            {},
            r"row 0: column 'question' \(format.prompt_key\) holds a struct \(dict\), not text: .*key: question.text$",
        ),
        (
            [{"question": ["a", "b"], "answer": "1"}],
            {},
            r"row 0: column 'question': expected a list of \{role, content\} messages",
        ),
        (
            [{"question": [{"role": "user", "content": None}], "answer": "1"}],
            {},
            r"row 0: column 'question': message 0",
        ),
        (
            [{"question": "q", "rm": {"truth": "1"}}, {"question": "q", "rm": None}],
            {"response_key": "rm.truth"},
            r"row 1: column 'rm.truth' \(format.response_key\): 'rm' is null",
        ),
        (
            [{"question": "q", "rm": {"truth": "1"}}],
            {"response_key": "rm.ground_truth"},
            r"row 0: missing column 'rm.ground_truth' \(format.response_key\); 'rm' has \['truth'\]",
        ),
        (
            [{"question": "q", "rm": "1"}],
            {"response_key": "rm.truth"},
            r"row 0: column 'rm.truth' \(format.response_key\): 'rm' holds a str, not a struct to look into",
        ),
    ],
    ids=[
        "null",
        "dict-reference",
        "list-reference",
        "bool-reference",
        "dict-prompt",
        "list-prompt",
        "null-content",
        "null-struct",
        "missing-nested",
        "not-a-struct",
    ],
)
def test_a_null_or_non_text_prompt_or_reference_is_refused_by_row_and_column(tmp_path, data, fmt, named):
    f = write_jsonl(tmp_path / "train.jsonl", data)
    with pytest.raises(DataError, match=rf"^taskset taskset_0: {f}: {named}"):
        load_tasks(taskset(f, format={"prompt_key": "question", "response_key": "answer", **fmt}))


def test_a_number_is_text_where_text_is_needed(tmp_path):
    """GSM8K-style integer answers (and a CSV's number column) are taken as their strings."""
    (tmp_path / "train.csv").write_text("question,answer\n7,42\n8,2.5\n")
    tasks = load_tasks(taskset(tmp_path))
    assert [(t.prompt, t.reference) for t in tasks] == [("7", "42"), ("8", "2.5")]
