"""Rollout throughput of HFEngine against a plain `model.generate` loop, plus log-prob agreement.

    .venv/bin/python scripts/bench_engine.py [--prompts 32] [--n 4] [--tokens 64] [--repeats 3]

Two models, both random-init Qwen2 with the byte-level tokenizer of tiny.py, float32 on CPU:
  tiny   the embedded default built by tiny.py (~1M params)
  25M    hidden 512, 8 layers, 8 heads, intermediate 1408 (built here, ~25M params)
Same workload for both contenders: --prompts chat-templated questions of the arithmetic taskset,
--n samples each, exactly --tokens new tokens per sample (EOS suppressed until then, so the work
is equal), temperature 1.0, top_k 0, top_p 1.0:
  (a) HFEngine.generate     all requests in one call (batches of up to 64 rows, KV cache)
  (b) model.generate loop   one prompt at a time, num_return_sequences=n, do_sample=True
Generated tokens/s, median of --repeats runs; ratio = (a) / (b). Then the largest |difference|
between the engine's log-probs and one plain forward pass over prompt + response.
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
from models import load_model  # noqa: E402
from tiny import build  # noqa: E402


def build_25m(tiny: str, out: str) -> str:
    """A ~25M-param random Qwen2 with tiny's tokenizer and generation config."""
    config = transformers.Qwen2Config.from_pretrained(tiny)
    config.update(dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
                       intermediate_size=1408, layer_types=["full_attention"] * 8))
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).save_pretrained(out)
    for name in os.listdir(tiny):
        if name.startswith("tokenizer") or name in ("chat_template.jinja", "generation_config.json"):
            with open(os.path.join(tiny, name), "rb") as src, open(os.path.join(out, name), "wb") as dst:
                dst.write(src.read())
    return out


def bench_engine(engine: HFEngine, prompts: list[list[int]], n: int, tokens: int) -> tuple[float, list]:
    params = SamplingParams(n=n, temperature=1.0, top_k=0, top_p=1.0, max_tokens=tokens, min_tokens=tokens)
    start = time.perf_counter()
    outs = engine.generate(prompts, [params] * len(prompts))
    seconds = time.perf_counter() - start
    return sum(len(c.token_ids) for cs in outs for c in cs) / seconds, outs


def bench_generate(model, prompts: list[list[int]], n: int, tokens: int, pad: int) -> float:
    start, count = time.perf_counter(), 0
    with torch.no_grad():
        for p in prompts:
            out = model.generate(torch.tensor([p]), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                 max_new_tokens=tokens, min_new_tokens=tokens, num_return_sequences=n,
                                 pad_token_id=pad)
            count += out[:, len(p):].numel()
    return count / (time.perf_counter() - start)


def logprob_diff(model, prompts: list[list[int]], outs: list) -> float:
    worst = 0.0
    with torch.no_grad():
        for p, cs in zip(prompts, outs):
            for c in cs:
                logits = model(torch.tensor([p + c.token_ids])).logits[0, len(p) - 1 : -1]  # [R, V]
                ref = logits.log_softmax(-1).gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]  # [R], T = 1
                worst = max(worst, (ref - torch.tensor(c.logprobs)).abs().max().item())
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{torch.get_num_threads()} threads; {args.prompts} prompts x n={args.n} x {args.tokens} tokens")
    root = tempfile.mkdtemp(prefix="bench_engine_")
    build(root, n_train=max(50, args.prompts), n_test=10)
    tiny = os.path.join(root, "tiny-qwen2")
    models = {"tiny": tiny, "25M": build_25m(tiny, os.path.join(root, "qwen2-25m"))}
    rows = []
    for name, path in models.items():
        with HFEngine(path, max_model_len=1024) as engine:
            tok, model = engine.tokenizer, load_model(path)
            params = sum(p.numel() for p in model.parameters()) / 1e6
            with open(os.path.join(root, "arith", "train.jsonl")) as f:
                questions = [json.loads(line)["question"] for line in f][: args.prompts]
            prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                          tokenize=False), add_special_tokens=False) for q in questions]
            bench_engine(engine, prompts[:2], args.n, 4)  # warm-up
            runs = [bench_engine(engine, prompts, args.n, args.tokens) for _ in range(args.repeats)]
            eng = [r[0] for r in runs]
            gen = [bench_generate(model, prompts, args.n, args.tokens, tok.pad_token_id) for _ in range(args.repeats)]
            diff = logprob_diff(model, prompts, runs[-1][1])
        rows.append((name, params, statistics.median(eng), min(eng), max(eng),
                     statistics.median(gen), min(gen), max(gen), diff))
        print(f"{name}: engine {eng}, generate {gen}, logprob diff {diff:.2e}", flush=True)
    shutil.rmtree(root)
    print("\n| model | params | HFEngine tok/s (min-max) | model.generate tok/s (min-max) | ratio | max logprob diff |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, params, e, e0, e1, g, g0, g1, diff in rows:
        print(f"| {name} | {params:.1f}M | {e:,.0f} ({e0:,.0f}-{e1:,.0f}) | {g:,.0f} ({g0:,.0f}-{g1:,.0f}) "
              f"| {e / g:.2f} | {diff:.1e} |")


if __name__ == "__main__":
    main()
