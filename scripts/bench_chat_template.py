"""The cost of tokenising chat prompts with their data as text (chat_template.chat_ids) against rendering and encoding
the text as before (apply_chat_template, then encode with special tokens parsed), on GSM8K questions.

    .venv/bin/python scripts/bench_chat_template.py assets/tiny-qwen2 [--prompts 1000] [--runs 21] [--data JSONL]

Each run tokenises the prompts (a system message and the question) four ways, interleaved: before, chat_ids, chat_ids
with every question ending in `<|im_end|>` (the slow path), and the protect() walk alone; with the tokenizer as it is
and with 256 more special tokens (Llama 3's count of reserved ones). Reported: the median CPU time over runs (CPU,
not wall: the machine is shared), in ms per --prompts prompts, and the ratios to before.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tokenizers import AddedToken  # noqa: E402

from chat_template import Protected, chat_ids  # noqa: E402
from models import load_tokenizer  # noqa: E402

GSM8K = "../shared/datasets/gsm8k/main/test.jsonl"  # from the repository's root (DESIGN.md); or --data


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--prompts", type=int, default=1000)
    ap.add_argument("--runs", type=int, default=21)
    ap.add_argument("--data", default=GSM8K, help="a JSON-lines file with a `question` per line")
    a = ap.parse_args()
    with open(a.data) as f:
        questions = [json.loads(line)["question"] for line in f][: a.prompts]
    system = {"role": "system", "content": "Reason step by step."}
    ways = {
        "before": lambda t, q: t.encode(
            t.apply_chat_template([system, {"role": "user", "content": q}], tokenize=False, add_generation_prompt=True),
            add_special_tokens=False,
        ),
        "chat_ids": lambda t, q: chat_ids(t, [system, {"role": "user", "content": q}])[1],
        "forged": lambda t, q: chat_ids(t, [system, {"role": "user", "content": q + "<|im_end|>"}])[1],
        "walk": lambda t, q: Protected(t).protect([system, {"role": "user", "content": q}]),
    }
    for extra in (0, 256):
        tok = load_tokenizer(a.model)
        tok.add_tokens([AddedToken(f"<|reserved_special_token_{i}|>", special=True) for i in range(extra)])
        assert [ways["before"](tok, q) for q in questions] == [ways["chat_ids"](tok, q) for q in questions]
        times: dict[str, list[float]] = {k: [] for k in ways}
        for _ in range(a.runs):
            for name, way in ways.items():
                start = time.process_time()
                for q in questions:
                    way(tok, q)
                times[name].append((time.process_time() - start) * 1e3)
        m = {k: statistics.median(v) for k, v in times.items()}
        print(
            f"{sum(t.special for t in tok.added_tokens_decoder.values())} special tokens: "
            f"{len(questions)} prompts, median CPU ms: before {m['before']:.0f}, chat_ids {m['chat_ids']:.0f} "
            f"(x{m['chat_ids'] / m['before']:.2f}; the protect() walk {m['walk']:.1f}), "
            f"every prompt forged {m['forged']:.0f} (x{m['forged'] / m['before']:.2f})"
        )


if __name__ == "__main__":
    main()
