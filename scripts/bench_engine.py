"""Rollout throughput of the HF engine against one batched `model.generate` call on the same requests, and
the engine's log-prob agreement with a plain forward pass.

    .venv/bin/python scripts/bench_engine.py [--prompts 16] [--n 8] [--tokens 48] [--repeats 5]

Requests: --prompts chat-templated questions of the arithmetic taskset (the GRPO benchmark's kind, "What is
7 + 2 - 4?"), --n samples each, temperature 1, top-k off, top-p 1. Two workloads:
  fixed    exactly --tokens new tokens per sample (EOS suppressed until then: min_tokens / min_new_tokens), so
           both contenders do the same work;
  natural  sampling stops at EOS or --tokens, as a GRPO rollout does; each counts the tokens it returned (up to
           and including EOS).
Contenders, alternating, --repeats runs each (medians, min-max):
  (a) HFEngine.generate: every request in one call; a group's prompt is prefilled once and its KV cache shared by
      its n samples; rows that finish leave the batch;
  (b) model.generate: one batched call over the prompts repeated n times (left padding), do_sample=True, on the
      stock transformers model (its default sdpa attention): what TRL's GRPOTrainer runs on a CPU.
Models (both random-init Qwen2 with tiny.py's byte-level tokenizer, float32 on CPU): tiny (the embedded
default, ~1M params) and 25M (hidden 512, 8 layers, 8 heads, MLP 1408). Generated tokens/s; ratio = (a) / (b).
Then the largest |difference| between the engine's log-probs and one plain forward pass over prompt + response.
"""

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch  # noqa: E402
import transformers  # noqa: E402

from engines import HFEngine, SamplingParams  # noqa: E402
from models import load_model, load_tokenizer  # noqa: E402
from tiny import build  # noqa: E402


def build_25m(tiny: str, out: str) -> str:
    """A ~25M-param random Qwen2 with tiny's tokenizer and generation config."""
    config = transformers.Qwen2Config.from_pretrained(tiny)
    config.update(
        dict(
            hidden_size=512,
            num_hidden_layers=8,
            num_attention_heads=8,
            num_key_value_heads=8,
            intermediate_size=1408,
            layer_types=["full_attention"] * 8,
        )
    )
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).save_pretrained(out)
    for name in os.listdir(tiny):
        if name.startswith("tokenizer") or name in ("chat_template.jinja", "generation_config.json"):
            shutil.copy(os.path.join(tiny, name), os.path.join(out, name))
    return out


def bench_engine(
    engine: HFEngine, prompts: list[list[int]], n: int, tokens: int, fixed: bool, seed: int
) -> tuple[float, list]:
    params = SamplingParams(
        n=n, temperature=1.0, top_k=0, top_p=1.0, max_tokens=tokens, min_tokens=tokens if fixed else 0, seed=seed
    )
    start = time.perf_counter()
    outs = engine.generate(prompts, [params] * len(prompts))
    seconds = time.perf_counter() - start
    return sum(len(c.token_ids) for cs in outs for c in cs) / seconds, outs


def bench_generate(
    model, prompts: list[list[int]], n: int, tokens: int, fixed: bool, pad: int, eos: list[int]
) -> float:
    rows = [p for p in prompts for _ in range(n)]
    width = max(map(len, rows))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in rows])  # [B, L] left-padded
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows])  # [B, L]
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=tokens,
            min_new_tokens=tokens if fixed else 0,
            pad_token_id=pad,
        )
    seconds = time.perf_counter() - start
    count = 0
    for row in out[:, width:].tolist():  # tokens up to and including the first EOS
        count += next((j + 1 for j, t in enumerate(row) if t in eos), len(row))
    return count / seconds


def logprob_diff(model, prompts: list[list[int]], outs: list) -> float:
    worst = 0.0
    with torch.no_grad():
        for p, cs in zip(prompts, outs):
            for c in cs:
                logits = model(torch.tensor([p + c.token_ids])).logits[0, len(p) - 1 : -1]  # [R, V]
                ref = logits.log_softmax(-1).gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]  # [R], T = 1
                worst = max(worst, (ref - torch.tensor(c.logprobs)).abs().max().item())
    return worst


def compare(path: str, prompts: list[list[int]], args: argparse.Namespace, fixed: bool) -> dict:
    """Alternating runs of both contenders on one model and workload: medians, min-max, ratio, log-prob gap."""
    stock = transformers.AutoModelForCausalLM.from_pretrained(path).eval()  # transformers' defaults (sdpa)
    eos = list(stock.generation_config.eos_token_id)
    eng, gen = [], []
    with HFEngine(path, max_model_len=1024) as engine:
        pad = engine.tokenizer.pad_token_id
        bench_engine(engine, prompts[:2], args.n, 4, fixed, 0)  # warm-up
        bench_generate(stock, prompts[:2], args.n, 4, fixed, pad, eos)
        for k in range(args.repeats):
            for contender in (0, 1) if k % 2 else (1, 0):
                if contender == 0:
                    rate, outs = bench_engine(engine, prompts, args.n, args.tokens, fixed, seed=k)
                    eng.append(rate)
                else:
                    gen.append(bench_generate(stock, prompts, args.n, args.tokens, fixed, pad, eos))
    diff = logprob_diff(load_model(path), prompts, outs)
    return {"engine": eng, "generate": gen, "ratio": statistics.median(eng) / statistics.median(gen), "diff": diff}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--models", default="tiny,25M")
    args = ap.parse_args()
    print(
        f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{torch.get_num_threads()} threads; {args.prompts} prompts x n={args.n}, at most {args.tokens} new tokens"
    )
    root = tempfile.mkdtemp(prefix="bench_engine_")
    build(root, n_train=max(50, args.prompts), n_test=10, problems="plain", two_step_frac=0.5, tokenizer="byte")
    tiny = os.path.join(root, "tiny-qwen2")
    paths = {"tiny": tiny, "25M": build_25m(tiny, os.path.join(root, "qwen2-25m"))}
    with open(os.path.join(root, "arith", "train.jsonl")) as f:
        questions = [json.loads(line)["question"] for line in f][: args.prompts]
    rows = []
    for name in args.models.split(","):
        tok = load_tokenizer(paths[name])
        prompts = [
            tok.encode(
                tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False),
                add_special_tokens=False,
            )
            for q in questions
        ]
        for fixed in (True, False):
            r = compare(paths[name], prompts, args, fixed)
            rows.append((name, "fixed" if fixed else "natural", r))
            print(f"{name} {'fixed' if fixed else 'natural'}: {json.dumps(r)}", flush=True)
    shutil.rmtree(root)
    print(
        "\n| model | workload | HFEngine tok/s (min-max) | batched model.generate tok/s (min-max) | ratio "
        "| max logprob diff |"
    )
    print("|---|---|---:|---:|---:|---:|")
    for name, work, r in rows:
        e, g = r["engine"], r["generate"]
        print(
            f"| {name} | {work} | {statistics.median(e):,.0f} ({min(e):,.0f}-{max(e):,.0f}) | "
            f"{statistics.median(g):,.0f} "
            f"({min(g):,.0f}-{max(g):,.0f}) | {r['ratio']:.2f} | {r['diff']:.1e} |"
        )


if __name__ == "__main__":
    main()
