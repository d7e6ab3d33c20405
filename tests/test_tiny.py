"""tiny.py (the embedded default) and models.py's loaders, on small builds; CPU, about 30 s."""

from __future__ import annotations

import ast
import hashlib
import json
import operator
import re
from pathlib import Path

import entry
import pytest
import torch
from transformers import AutoModelForCausalLM

import tiny
from models import load_model, load_tokenizer
from workflows.episode import ToolCall, parse_tool_calls
from workflows.tool_use import calculate

REPO = Path(__file__).resolve().parents[1]
# default model size, few rows; two-step problems with bigger numbers and a perfect teacher, so that
# the checks below cover every template and the SFT rows equal the train rows
SMALL = dict(n_train=300, n_test=50, max_operand=50, two_step_frac=0.5, teacher_error=0.0)


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("tiny") / "assets"
    return out, tiny.build(str(out), **SMALL)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def file_hashes(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


# --- build: determinism, manifest, no-op, rebuild
def test_build_is_deterministic(built, tmp_path):
    out, result = built
    again = tiny.build(str(tmp_path / "assets"), **SMALL)
    hashes = file_hashes(out)
    assert hashes == file_hashes(tmp_path / "assets")
    assert {
        "arith/train.jsonl",
        "arith/test.jsonl",
        "arith/sft.jsonl",
        "arith/dpo.jsonl",
        "MANIFEST.json",
        "arith_tools/train.jsonl",
        "arith_tools/test.jsonl",
        "arith_tools/sft.jsonl",
        "tiny-qwen2/model.safetensors",
        "tiny-qwen2/tokenizer.json",
    } <= set(hashes)
    hashes.pop("MANIFEST.json")  # the manifest lists every other file
    assert result["files"] == again["files"] == hashes
    assert result["rows"] == {"train": 300, "test": 50, "sft": 300, "dpo": 300, "tool_train": 300, "tool_test": 50}
    assert not list(out.glob(".tiny-build-*"))  # the temporary folder is gone


def test_rerun_is_a_noop(built):
    out, _ = built
    mtimes = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    result = tiny.build(str(out), **SMALL)
    assert result["built"] is False
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == mtimes


def test_other_args_or_damage_rebuild(tmp_path):
    small_model = dict(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32)
    out = str(tmp_path / "assets")
    assert tiny.build(out, n_train=20, n_test=5, **small_model)["built"]
    result = tiny.build(out, n_train=30, n_test=5, **small_model)
    assert result["built"] and len(read_jsonl(tmp_path / "assets/arith/train.jsonl")) == 30
    # a damaged build is not complete
    (tmp_path / "assets/arith/test.jsonl").write_text("truncated")
    assert tiny.build(out, n_train=30, n_test=5, **small_model)["built"]
    assert len(read_jsonl(tmp_path / "assets/arith/test.jsonl")) == 5
    with pytest.raises(TypeError):
        tiny.build(out, n_trian=30)


# --- taskset: recompute every answer from the question alone
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def eval_expr(text: str) -> int:
    """Integer + - * only, with Python's precedence (no eval)."""

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.BinOp):
            return OPS[type(node.op)](ev(node.left), ev(node.right))
        assert isinstance(node, ast.Constant) and isinstance(node.value, int)
        return node.value

    return ev(ast.parse(text, mode="eval").body)


# One pattern per question form, written from the English, independently of tiny.py's templates.
SOLVERS = [
    (r"What is ([\d +*-]+)\?", lambda e: eval_expr(e)),
    (r"has (\d+) \w+ and buys (\d+) more\.", lambda a, b: int(a) + int(b)),
    (r"has (\d+) \w+ and gives (\d+) to a friend\.", lambda a, b: int(a) - int(b)),
    (r"had (\d+) \w+ and sold (\d+) of them\.", lambda a, b: int(a) - int(b)),
    (r"buys (\d+) bags with (\d+) \w+ in each bag\. How", lambda a, b: int(a) * int(b)),
    (r"has (\d+) \w+, buys (\d+) more, and then gives (\d+) away\.", lambda a, b, c: int(a) + int(b) - int(c)),
    (
        r"had (\d+) \w+\. It sold (\d+) in the morning and (\d+) in the afternoon\.",
        lambda a, b, c: int(a) - int(b) - int(c),
    ),
    (r"picks (\d+) \w+ on Monday, (\d+) on Tuesday and (\d+) on Wednesday\.", lambda a, b, c: int(a) + int(b) + int(c)),
    (r"buys (\d+) bags with (\d+) \w+ in each bag and finds (\d+) more\.", lambda a, b, c: int(a) * int(b) + int(c)),
]


def solve(question: str) -> int:
    found = [(p, f) for p, f in SOLVERS if re.search(p, question)]
    assert len(found) == 1, question
    pattern, f = found[0]
    return f(*re.search(pattern, question).groups())


def test_answers_are_right_and_gsm8k_shaped(built):
    out, _ = built
    for split in ["train", "test"]:
        rows = read_jsonl(out / f"arith/{split}.jsonl")
        for row in rows:
            assert set(row) == {"question", "answer"}
            *steps, last = row["answer"].split("\n")
            m = re.fullmatch(r"#### (\d+)", last)
            assert m, row
            assert int(m.group(1)) == solve(row["question"]) >= 0, row
            assert 1 <= len(steps) <= 2
            for step in steps:  # every worked step is itself correct
                lhs, rhs = step.split(" = ")
                assert eval_expr(lhs) == int(rhs), row
            assert steps[-1].endswith(f"= {m.group(1)}")
        two_step = sum(r["answer"].count("\n") == 2 for r in rows) / len(rows)
        assert 0.3 < two_step < 0.7  # two_step_frac 0.5


def test_splits_disjoint_ascii_and_sft_matches_train(built):
    out, _ = built
    train, test = read_jsonl(out / "arith/train.jsonl"), read_jsonl(out / "arith/test.jsonl")
    questions = [r["question"] for r in train + test]
    assert len(set(questions)) == len(questions) == 350  # unique, so train and test are disjoint
    sft = read_jsonl(out / "arith/sft.jsonl")
    assert sft == [
        {"messages": [{"role": "user", "content": r["question"]}, {"role": "assistant", "content": r["answer"]}]}
        for r in train
    ]
    for name in ["train", "test", "sft"]:
        assert (out / f"arith/{name}.jsonl").read_bytes().isascii()


# --- the model and tokenizer, loaded as the rest of the project will
def test_model_loads_and_generates(built):
    out, result = built
    path = out / "tiny-qwen2"
    assert sum(p.stat().st_size for p in path.iterdir()) < 10 * 2**20
    model = AutoModelForCausalLM.from_pretrained(path)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    n_params = sum(p.numel() for p in model.parameters())
    assert 0.8e6 < n_params < 1.5e6 and n_params == result["n_params"]
    assert model.config.tie_word_embeddings and model.config.vocab_size % 8 == 0

    tok = load_tokenizer(str(path))
    assert model.config.vocab_size >= len(tok)
    assert model.generation_config.eos_token_id == [
        tok.convert_tokens_to_ids("<|im_end|>"),
        tok.convert_tokens_to_ids("<|endoftext|>"),
    ]
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True, tokenize=False
    )
    ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)])
    model = load_model(str(path))
    assert not model.training
    with torch.no_grad():
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    assert gen.dtype == torch.long and gen.shape[0] == 1
    assert 1 <= gen.shape[1] - ids.shape[1] <= 8 and torch.equal(gen[0, : ids.shape[1]], ids[0])


@pytest.mark.parametrize("kind", ["bpe", "byte"])
def test_tokenizer_round_trips_and_chat_template(built, kind, tmp_path):
    out = (
        built[0] if kind == "bpe" else Path(tiny.build(str(tmp_path / "byte"), **SMALL, tokenizer="byte") and tmp_path)
    )
    folder = out / "tiny-qwen2" if kind == "bpe" else out / "byte" / "tiny-qwen2"
    tok = load_tokenizer(str(folder))
    assert type(tok).__name__ in ("PreTrainedTokenizerFast", "TokenizersBackend")
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|endoftext|>")
    text = "Tom has 12 apples.\n12 + 7 = 19\n#### 19\n\n  tabs\tand ~`!@$%^&*()[]{}|\\;:'\",<.>/?"
    for s in [text, "".join(chr(c) for c in range(128)), "cafe\u0301 \u00e9 \u4e2d"]:
        ids = tok.encode(s, add_special_tokens=False)
        assert tok.decode(ids) == s  # no unknowns, whatever the text
        if kind == "byte":
            assert len(ids) == len(s.encode())  # one token per byte
    first = 256 if kind == "byte" else len(tok) - 3  # the special tokens come after the byte/merged vocabulary
    for i, special in enumerate(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]):
        assert tok.encode(special, add_special_tokens=False) == [first + i]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
    assert tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template(messages[1:], tokenize=False) == ("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n")


def test_bpe_merges_the_tasksets_words_and_keeps_digits_apart(built):
    """The default tokenizer's point: a taskset row is less than half its bytes in tokens (the SFT stage's cost), and
    every digit is its own token (137 is 1, 3, 7), so numbers are read and written digit by digit."""
    out, _ = built
    tok = load_tokenizer(str(out / "tiny-qwen2"))
    assert len(tok) < 512 + 3
    rows = read_jsonl(out / "arith/sft.jsonl")
    tokens = sum(len(tok.apply_chat_template(r["messages"], tokenize=True, return_dict=False)) for r in rows)
    chars = sum(len(tok.apply_chat_template(r["messages"], tokenize=False)) for r in rows)
    assert tokens < 0.5 * chars
    for question in [r["messages"][0]["content"] for r in rows[:50]]:
        for piece in tok.tokenize(question):
            assert not any(c.isdigit() for c in piece) or len(piece) == 1, (question, piece)
    assert tok.tokenize(" apples")[0] == "\u0120apples"  # a word of the taskset is one token ("\u0120": the space)
    with pytest.raises(ValueError, match="tokenizer must be bpe or byte"):
        tiny.build(str(out.parent / "other"), **SMALL, tokenizer="wordpiece")


# --- the CLI, as a user runs it (in this process: entry.run)
@pytest.mark.slow
def test_cli(tmp_path):
    args = ["--out", str(tmp_path / "a"), "--n-train", "20", "--n-test", "5", "--hidden-size", "16"]
    args += ["--num-layers", "1", "--intermediate-size", "32"]
    first = entry.run("tiny.py", *args, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    assert first.stdout.startswith("built") and "train 20, test 5, sft 20 rows" in first.stdout
    second = entry.run("tiny.py", *args, timeout=300)
    assert second.returncode == 0 and second.stdout.startswith("up to date"), second.stderr[-3000:]


def test_a_weak_teacher_adds_where_it_should_subtract(tmp_path):
    """teacher_error: that fraction of SFT rows with a subtraction add instead (consistently, down to
    `#### N`); every other row, and the train/test references, are untouched."""
    tiny.build(str(tmp_path), n_train=400, n_test=20, teacher_error=0.6)
    train, sft = read_jsonl(tmp_path / "arith/train.jsonl"), read_jsonl(tmp_path / "arith/sft.jsonl")
    wrong = 0
    for row, demo in zip(train, sft):
        answer = demo["messages"][1]["content"]
        if " - " not in row["answer"]:
            assert answer == row["answer"]
        elif answer != row["answer"]:
            wrong += 1
            *steps, last = answer.split("\n")  # one step in the default build: "a - b" became "a + b"
            assert [x.split(" = ")[0] for x in steps] == [
                x.split(" = ")[0].replace(" - ", " + ") for x in row["answer"].split("\n")[:-1]
            ]
            lhs, rhs = steps[-1].split(" = ")
            assert eval_expr(lhs) == int(rhs) == int(last.removeprefix("#### "))
    subtractions = sum(" - " in r["answer"] for r in train)
    assert subtractions > 50 and 0.45 < wrong / subtractions < 0.75
    assert " - " in "".join(r["answer"] for r in read_jsonl(tmp_path / "arith/test.jsonl"))  # test stays correct


def test_the_tool_task_and_its_teachers_demonstrations(tmp_path):
    """arith_tools: right answers, disjoint splits; a demonstration either calls the calculator with the question's
    expression (whose result is the answer) or, on a row with a subtraction, answers at once by adding every number
    (the weak teacher, teacher_error of those rows)."""
    out = tmp_path
    tiny.build(str(out), n_train=300, n_test=50, teacher_error=0.6)
    train, test = read_jsonl(out / "arith_tools/train.jsonl"), read_jsonl(out / "arith_tools/test.jsonl")
    assert len({r["question"] for r in train + test}) == len(train) + len(test) == 350
    for row in train + test:
        expr = re.fullmatch(r"What is (\d\d [+-] \d\d [+-] \d\d)\?", row["question"]).group(1)
        assert row["answer"] == f"#### {eval_expr(expr)}"
    wrong = 0
    for row, demo in zip(train, read_jsonl(out / "arith_tools/sft.jsonl")):
        roles = [m["role"] for m in demo["messages"]]
        expr = row["question"][8:-1]
        if roles == ["user", "assistant"]:
            wrong += 1
            assert "-" in expr and demo["messages"][1]["content"] == f"#### {eval_expr(expr.replace('-', '+'))}"
            continue
        assert roles == ["user", "assistant", "tool", "assistant"]
        (call,) = parse_tool_calls(demo["messages"][1]["content"])
        assert call == ToolCall("calculator", {"expression": expr})
        assert calculate(expr) == demo["messages"][2]["content"] and demo["messages"][3]["content"] == row["answer"]
    subtractions = sum("-" in r["question"] for r in train)
    assert 0.45 < wrong / subtractions < 0.75  # teacher_error 0.6
