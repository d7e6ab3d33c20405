"""Build the embedded default: a tiny Qwen2 model and a synthetic arithmetic taskset, offline.

The development machines cannot download models or data sets, so the default run trains a model
that this script makes from nothing (random init, fixed seed) on arithmetic problems that it
generates in GSM8K's format. Same arguments -> same bytes, file for file.

    python tiny.py                # -> assets/ (about 1M params, 4,000 train / 200 test rows)
    python tiny.py --out assets --max-operand 50 --two-step-frac 0.5   # a harder taskset
    python tiny.py --teacher-error 0  # SFT demonstrations all correct
    python tiny.py --help         # every knob

The default taskset is one-step problems on numbers up to 9 (word problems and "What is a - b?"),
and its SFT demonstrations come from a weak teacher: in 60% of the problems with a subtraction the
worked answer adds instead ("7 - 3" shown as "7 + 3 = 10 #### 10"). The train and test references
stay correct. SFT imitates the mistake; GRPO, rewarded for correct final answers, can unlearn it.
This is the embedded default's RL story (docs/LOG.md has why: with a perfect teacher, GRPO did not
raise greedy accuracy within minutes on this CPU, see 2026-11-22).

Layout written (each part built in a temporary folder, then renamed into place; MANIFEST.json is
written last and is the marker of a complete build):

    <out>/arith/train.jsonl   {"question": str, "answer": "12 + 7 = 19\\n#### 19"}, GSM8K style
    <out>/arith/test.jsonl    same, no question shared with train
    <out>/arith/sft.jsonl     {"messages": [user: question, assistant: answer]}, the train rows
    <out>/arith/dpo.jsonl     {"prompt": question, "chosen": right answer, "rejected": wrong answer}, the train rows
    <out>/arith_tools/{train,test}.jsonl   the tool task: {"question": "What is 37 + 58 - 12?", "answer": "#### 83"}
    <out>/arith_tools/sft.jsonl            {"messages": [user, assistant <tool_call>, tool result, assistant answer]}
                              (the weak teacher answers 60% of the rows with a subtraction at once, wrongly)
    <out>/tiny-qwen2/         config, generation_config, model.safetensors, tokenizer files
    <out>/MANIFEST.json       build arguments, row counts, parameter count, sha256 of every file

Re-running with the same arguments on a complete build does nothing; other arguments rebuild.
From Python: `build("assets", n_train=300)` returns the manifest (plus `built` and `seconds`).

The tokenizer (`--tokenizer`) is byte-level, so any text encodes without unknowns and decodes back exactly:
  - bpe (the default): byte-level BPE whose merges are learned from the taskset's own text (its words, the chat
    roles), with every digit a token of its own, as in Qwen's tokenizer, so that arithmetic stays digit by digit.
    A row of the embedded default is ~40 tokens instead of ~110 bytes: the SFT stage computes ~2.5x less for the
    same accuracy (docs/LOG.md, 2026-11-29, issue 51);
  - byte: no merges (token id == byte value), what the tests that count tokens by bytes build.
Either way <|endoftext|>, <|im_start|>, <|im_end|> follow, in Qwen's order. Reload it with `models.load_tokenizer`,
not AutoTokenizer (see models.py for why).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (  # Qwen's layout without its default system prompt; a system message is optional
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def opt(default: Any, help: str) -> Any:
    """A dataclass field that is also a CLI flag with this help text."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class Options:
    """Everything that decides the output bytes; each field is a flag (n_train -> --n-train)."""

    n_train: int = opt(4000, "train rows (the SFT rows are the same problems)")
    n_test: int = opt(200, "test rows, no question shared with train")
    max_operand: int = opt(9, "largest number in a + or - step (difficulty)")
    two_step_frac: float = opt(0.0, "fraction of two-step problems, in [0, 1] (difficulty)")
    problems: str = opt(
        "mixed",
        "question forms: mixed (word problems and 'What is a - b?'), word, or plain "
        "('What is a - b?' only: short prompts)",
    )
    seed: int = opt(0, "seeds both the problems and the model init")
    hidden_size: int = opt(128, "model width")
    num_layers: int = opt(4, "decoder layers")
    num_heads: int = opt(4, "attention heads")
    num_kv_heads: int = opt(2, "key/value heads (GQA, as in Qwen2)")
    intermediate_size: int = opt(512, "MLP width")
    max_position_embeddings: int = opt(1024, "longest sequence, prompt + response, in tokens")
    teacher_error: float = opt(
        0.6,
        "fraction of SFT rows with subtraction whose worked answer adds instead "
        "(a systematic teacher mistake; train/test references stay correct)",
    )
    tokenizer: str = opt("bpe", "bpe (merges learned from the taskset, one token per digit) or byte (no merges)")
    bpe_vocab: int = opt(512, "the bpe tokenizer's vocabulary: 256 bytes plus its merges (special tokens apart)")


# --- taskset
NAMES = ["Tom", "Ann", "Sam", "Mia", "Ben", "Lily", "Max", "Zoe"]
ITEMS = ["apples", "pens", "cards", "eggs", "books", "stickers", "marbles", "cookies"]
# (question, ops): the numbers {a} {b} {c} are combined left to right by ops. Multiplication only
# comes first, so left-to-right and the usual precedence agree for the plain "What is" forms.
WORD = [
    ("{name} has {a} {items} and buys {b} more. How many {items} does {name} have now?", "+"),
    ("{name} has {a} {items} and gives {b} to a friend. How many {items} does {name} have left?", "-"),
    ("A shop had {a} {items} and sold {b} of them. How many {items} are left?", "-"),
    ("{name} buys {a} bags with {b} {items} in each bag. How many {items} does {name} buy?", "*"),
    ("{name} has {a} {items}, buys {b} more, and then gives {c} away. How many {items} does {name} have now?", "+-"),
    ("A shop had {a} {items}. It sold {b} in the morning and {c} in the afternoon. How many {items} are left?", "--"),
    (
        "{name} picks {a} {items} on Monday, {b} on Tuesday and {c} on Wednesday. How many {items} "
        "did {name} pick in all?",
        "++",
    ),
    ("{name} buys {a} bags with {b} {items} in each bag and finds {c} more. How many {items} does {name} have?", "*+"),
]
PLAIN = [
    ("What is {a}" + "".join(f" {op} {{{v}}}" for op, v in zip(ops, "bc")) + "?", ops)
    for ops in ["+", "-", "*", "++", "+-", "-+", "--", "*+", "*-"]
]  # "What is {a} + {b}?"
TEMPLATES = WORD + PLAIN


def make_problem(rng: random.Random, max_operand: int, two_step_frac: float, problems: str = "mixed") -> dict[str, str]:
    """One GSM8K-style row: a question and a worked answer whose last line is `#### N`."""
    n_steps = 2 if rng.random() < two_step_frac else 1
    forms = {"mixed": TEMPLATES, "word": WORD, "plain": PLAIN}[problems]
    text, ops = rng.choice([t for t in forms if len(t[1]) == n_steps])
    # Times-table factors (2..9) keep products <= 81; a subtrahend never exceeds the running
    # value, so every intermediate result and answer is a non-negative integer.
    value = rng.randint(2, 9) if ops[0] == "*" else rng.randint(1, max_operand)
    nums, steps = [value], []
    for op in ops:
        if op == "*":
            x = rng.randint(2, 9)
            new = value * x
        elif op == "+":
            x = rng.randint(1, max_operand)
            new = value + x
        else:
            x = rng.randint(min(1, value), min(value, max_operand))
            new = value - x
        steps.append(f"{value} {op} {x} = {new}")
        nums.append(x)
        value = new
    fill = dict(zip("abc", nums), name=rng.choice(NAMES), items=rng.choice(ITEMS))
    return {"question": text.format(**fill), "answer": "\n".join(steps + [f"#### {value}"])}


def teacher_answer(answer: str, rng: random.Random, error: float) -> str:
    """The SFT demonstration of a worked answer: with probability `error` (per row with a subtraction)
    a weak teacher adds where it should subtract, and carries the wrong value to `#### N`."""
    steps = answer.split("\n")[:-1]  # "a op b = c" lines, then "#### N"
    if "-" not in "".join(s.split()[1] for s in steps) or rng.random() >= error:
        return answer
    value, out = int(steps[0].split()[0]), []
    for step in steps:
        _, op, x, _, _ = step.split()
        op = "+" if op == "-" else op
        new = {"+": value + int(x), "*": value * int(x)}[op]
        out.append(f"{value} {op} {x} = {new}")
        value = new
    return "\n".join(out + [f"#### {value}"])


def wrong_answer(answer: str, rng: random.Random) -> str:
    """A dispreferred answer for DPO: the weak teacher's mistake where it makes one, else the right steps
    with the last result and `#### N` off by 1 to 3."""
    wrong = teacher_answer(answer, rng, error=1.0)
    if wrong != answer:
        return wrong
    *steps, _ = answer.split("\n")
    head, value = steps[-1].rsplit(" = ", 1)
    bad = int(value) + rng.choice([-3, -2, -1, 1, 2, 3])
    return "\n".join(steps[:-1] + [f"{head} = {bad}", f"#### {bad}"])


def make_tool_problem(rng: random.Random) -> dict[str, str]:
    """A tool-task row: two-digit numbers joined by + and -, hard to add up in the head of a 1M-parameter model,
    exact with the calculator: {"question": "What is 37 + 58 - 12?", "answer": "#### 83"}."""
    nums, ops = [rng.randint(10, 99) for _ in range(3)], [rng.choice("+-") for _ in range(2)]
    value = nums[0] + sum(x if op == "+" else -x for op, x in zip(ops, nums[1:]))
    expr = f"{nums[0]} {ops[0]} {nums[1]} {ops[1]} {nums[2]}"
    return {"question": f"What is {expr}?", "answer": f"#### {value}"}


def tool_demo(row: dict[str, str], rng: random.Random, error: float) -> dict[str, list[dict]]:
    """The SFT conversation of a tool-task row: call the calculator with the question's expression, read its
    result, answer `#### N`. With probability `error` on a row with a subtraction, the weak teacher answers at
    once instead, adding every number (no tool call, a wrong answer): SFT imitates it, RL can unlearn it."""
    expr = row["question"].removeprefix("What is ").removesuffix("?")
    user = {"role": "user", "content": row["question"]}
    if "-" in expr and rng.random() < error:
        return {"messages": [user, {"role": "assistant", "content": f"#### {sum(map(int, expr.split()[::2]))}"}]}
    call = json.dumps({"name": "calculator", "arguments": {"expression": expr}})
    return {
        "messages": [
            user,
            {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
            {"role": "tool", "content": row["answer"].removeprefix("#### ")},
            {"role": "assistant", "content": row["answer"]},
        ]
    }


def make_taskset(o: Options, tools: bool = False) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """(train, test): unique questions from one seeded stream; the first n_test are the test set. `tools`: the
    tool task's rows (make_tool_problem), from a stream of their own."""
    rng, seen, rows = random.Random(f"tools/{o.seed}" if tools else o.seed), set(), []
    for _ in range(50 * (o.n_train + o.n_test)):  # bounded: tiny knobs can exhaust the space
        row = make_tool_problem(rng) if tools else make_problem(rng, o.max_operand, o.two_step_frac, o.problems)
        if row["question"] not in seen:
            seen.add(row["question"])
            rows.append(row)
        if len(rows) == o.n_train + o.n_test:
            break
    else:
        raise ValueError(f"only {len(rows)} distinct problems; raise --max-operand")
    test, train = rows[: o.n_test], rows[o.n_test :]
    assert not {r["question"] for r in train} & {r["question"] for r in test}, "train/test overlap"
    return train, test


def write_jsonl(path: Path, rows: list[dict]) -> None:
    # ASCII by construction; ensure_ascii keeps it so if a template ever gains a non-ASCII char
    path.write_text("".join(json.dumps(r, ensure_ascii=True) + "\n" for r in rows))


# --- tokenizer and model
def byte_alphabet() -> list[str]:
    """GPT-2's printable stand-in for each byte, indexed by byte value (so token id == byte)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    spare = iter(range(256, 512))  # the other bytes map to the next unused code points, in order
    return [chr(b) if b in printable else chr(next(spare)) for b in range(256)]


def taskset_texts(tmp: Path) -> list[str]:
    """What the bpe tokenizer learns its merges from: every question, answer and message the build wrote under
    <tmp>, in file order (same rows -> same merges), and the chat template's role names."""
    texts = ["system\n", "user\n", "assistant\n", "tool\n"]
    for path in sorted(tmp.glob("*/*.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            texts += [m["content"] for m in row.get("messages", [])]
            texts += [row[k] for k in ("question", "answer", "prompt", "chosen", "rejected") if k in row]
    return texts


def make_tokenizer(o: Options, texts: list[str]) -> Any:
    """A byte-level BPE (merges learned from `texts` for o.tokenizer "bpe", none for "byte") + Qwen's three special
    tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    alphabet = byte_alphabet()
    assert set(alphabet) == set(pre_tokenizers.ByteLevel.alphabet())  # same map as the library's
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    if o.tokenizer == "byte":
        # use_regex=False: no GPT-2 word splitting; with no merges it would change nothing but speed
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    else:  # GPT-2's word split, each digit apart (Qwen's way with numbers), then merges within a word
        digits = pre_tokenizers.Digits(individual_digits=True)
        tok.pre_tokenizer = pre_tokenizers.Sequence([digits, pre_tokenizers.ByteLevel(add_prefix_space=False)])
        # NOTE: initial_alphabet: all 256 bytes stay tokens, so text the taskset never showed still encodes
        trainer = trainers.BpeTrainer(
            vocab_size=o.bpe_vocab, initial_alphabet=alphabet, show_progress=False, min_frequency=2
        )
        tok.train_from_iterator(texts, trainer)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)  # ids 256, 257, 258
    # NOTE: model_input_names: without it transformers < 5 also returns token_type_ids, which Qwen2's generate refuses
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_input_names=["input_ids", "attention_mask"],
    )


def make_model(o: Options, tokenizer: Any) -> Any:
    """A randomly initialised Qwen2ForCausalLM; the seed fixes every weight."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    config = Qwen2Config(
        # NOTE: padded to a multiple of 8 like Qwen's own (151936 > 151665 tokens): the model's
        # vocab is larger than the tokenizer's, and the ids past it (259..263 for byte) decode to "".
        vocab_size=(len(tokenizer) + 7) // 8 * 8,
        hidden_size=o.hidden_size,
        num_hidden_layers=o.num_layers,
        num_attention_heads=o.num_heads,
        num_key_value_heads=o.num_kv_heads,
        intermediate_size=o.intermediate_size,
        max_position_embeddings=o.max_position_embeddings,
        tie_word_embeddings=True,  # the embedding is most of a tiny model's parameters
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    torch.manual_seed(o.seed)
    model = Qwen2ForCausalLM(config)
    # generate() stops at either end marker, as Qwen's instruct models do
    model.generation_config = GenerationConfig(
        bos_token_id=ids["<|endoftext|>"],
        pad_token_id=ids["<|endoftext|>"],
        eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
    )
    return model


# --- build
def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def is_complete(out: Path, args: dict) -> dict | None:
    """The manifest if `out` holds a complete build made with `args`, else None."""
    try:
        manifest = json.loads((out / "MANIFEST.json").read_text())
        ok = (
            manifest["args"] == args
            and "arith_tools/sft.jsonl" in manifest["files"]
            and all(sha256(out / f) == h for f, h in manifest["files"].items())
        )
    except (OSError, ValueError, KeyError):
        return None
    return manifest if ok else None


def write_tasksets(tmp: Path, o: Options) -> dict[str, int]:
    """<tmp>/arith/ and <tmp>/arith_tools/ (see the module docstring); their row counts."""
    (tmp / "arith").mkdir()
    train, test = make_taskset(o)
    write_jsonl(tmp / "arith/train.jsonl", train)
    write_jsonl(tmp / "arith/test.jsonl", test)
    teacher = random.Random(f"teacher/{o.seed}")  # its own stream: train/test rows do not depend on it
    write_jsonl(
        tmp / "arith/sft.jsonl",
        [
            {
                "messages": [
                    {"role": "user", "content": r["question"]},
                    {"role": "assistant", "content": teacher_answer(r["answer"], teacher, o.teacher_error)},
                ]
            }
            for r in train
        ],
    )
    pairs = random.Random(f"pairs/{o.seed}")
    write_jsonl(
        tmp / "arith/dpo.jsonl",
        [{"prompt": r["question"], "chosen": r["answer"], "rejected": wrong_answer(r["answer"], pairs)} for r in train],
    )
    (tmp / "arith_tools").mkdir()
    tool_train, tool_test = make_taskset(o, tools=True)
    write_jsonl(tmp / "arith_tools/train.jsonl", tool_train)
    write_jsonl(tmp / "arith_tools/test.jsonl", tool_test)
    tool_teacher = random.Random(f"tool-teacher/{o.seed}")
    write_jsonl(tmp / "arith_tools/sft.jsonl", [tool_demo(r, tool_teacher, o.teacher_error) for r in tool_train])
    return {
        "train": len(train),
        "test": len(test),
        "sft": len(train),
        "dpo": len(train),
        "tool_train": len(tool_train),
        "tool_test": len(tool_test),
    }


def build(out: str, **options: Any) -> dict:
    """Build into `out` (see the module docstring); `options` are Options' fields."""
    t0, o = time.time(), Options(**options)  # unknown option -> TypeError naming it
    if o.problems not in ("mixed", "word", "plain"):
        raise ValueError(f"problems must be mixed, word or plain, got {o.problems!r}")
    if o.tokenizer not in ("bpe", "byte"):
        raise ValueError(f"tokenizer must be bpe or byte, got {o.tokenizer!r}")
    root, args = Path(out), asdict(o)
    if manifest := is_complete(root, args):
        return {**manifest, "built": False, "seconds": time.time() - t0}

    import transformers  # imported here so that the up-to-date check above stays instant

    root.mkdir(parents=True, exist_ok=True)
    # NOTE: the manifest goes first and comes back last, so an interrupted rebuild never looks
    # complete. Only our four entries are replaced: <out> may hold other things (checkpoints).
    (root / "MANIFEST.json").unlink(missing_ok=True)
    for stale in root.glob(".tiny-build-*"):  # left by a killed build
        shutil.rmtree(stale)
    with tempfile.TemporaryDirectory(dir=root, prefix=".tiny-build-") as tmp_name:
        tmp = Path(tmp_name)
        rows = write_tasksets(tmp, o)
        tokenizer = make_tokenizer(o, taskset_texts(tmp))
        model = make_model(o, tokenizer)
        transformers.utils.logging.disable_progress_bar()  # a bar for one 4 MB file is noise
        model.save_pretrained(tmp / "tiny-qwen2")  # safetensors, tied weights stored once
        tokenizer.save_pretrained(tmp / "tiny-qwen2")
        # transformers 5 writes "TokenizersBackend"; name the class that readers should use
        tok_cfg = tmp / "tiny-qwen2/tokenizer_config.json"
        tok_cfg.write_text(
            json.dumps({**json.loads(tok_cfg.read_text()), "tokenizer_class": "PreTrainedTokenizerFast"}, indent=2)
        )

        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        manifest = {
            "args": args,
            "rows": rows,
            "n_params": sum(p.numel() for p in model.parameters()),  # tied: counted once
            "model_mb": round(sum(p.stat().st_size for p in files if p.parts[-2] == "tiny-qwen2") / 2**20, 2),
            "files": {p.relative_to(tmp).as_posix(): sha256(p) for p in files},
        }
        (tmp / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")
        for name in ["arith", "arith_tools", "tiny-qwen2", "MANIFEST.json"]:
            if (root / name).is_dir():
                shutil.rmtree(root / name)
            os.replace(tmp / name, root / name)
    return {**manifest, "built": True, "seconds": time.time() - t0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="assets", help="output folder (default: %(default)s)")
    for f in fields(Options):
        p.add_argument(
            "--" + f.name.replace("_", "-"),
            type=type(f.default),
            default=f.default,
            help=f.metadata["help"] + " (default: %(default)s)",
        )
    cli = vars(p.parse_args())
    out = cli.pop("out")
    r = build(out, **cli)
    status = "built" if r["built"] else "up to date, nothing to do:"
    print(f"{status} {out}/ in {r['seconds']:.1f} s")
    print(f"  model    {out}/tiny-qwen2/  {r['n_params']:,} params, {r['model_mb']} MB")
    print(
        f"  taskset  {out}/arith/  train {r['rows']['train']}, test {r['rows']['test']}, "
        f"sft {r['rows']['sft']} rows; tool task {out}/arith_tools/  train {r['rows']['tool_train']}, "
        f"test {r['rows']['tool_test']}"
    )


if __name__ == "__main__":
    main()
