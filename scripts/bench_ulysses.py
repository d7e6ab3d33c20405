"""What sequence parallelism (trainer.ulysses_sequence_parallel_size, ulysses.py) saves: each rank's peak host memory
and time for one forward and backward pass of the trainer's actor over one long packed sequence, unsplit (every rank
runs the whole sequence) and split over the ranks; and that both give the same loss and gradient norm.

    .venv/bin/python scripts/bench_ulysses.py                           # 2 CPU ranks (gloo), 50m shape, 4096 tokens
    .venv/bin/python scripts/bench_ulysses.py --ranks 4 --tokens 8192 --shape tiny --work /tmp/sp

The model is scripts/bench_gpu.py's shape (random weights, seed 0, fp32), made once in --work. The sequence is one
group as the trainer packs it: a 256-token prompt laid out once and responses of 512 tokens after it, `--tokens` in
all, every response token scored. Each rank is a torchrun process that builds the actor (scoring.build_model, FSDP2
over all ranks) with a sequence-parallel group of --sp ranks, resets its peak RSS (/proc/self/clear_refs, 5), then
runs the scorer (log-probs and entropies) and backward of their token-mean: `peak_mib` is its peak RSS during that
above its RSS before it (VmHWM - VmRSS, Linux), `saved_mib` the activations the forward pass kept for the backward
(the storages autograd saved, weights left out: torch.autograd.graph.saved_tensors_hooks), `pass_s` the wall time.
Output: a markdown table, one row per (sp, rank), then one JSON line (--json FILE writes it too).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from bench_load import model_folder, report, run_ranks, status_mib  # scripts/, this folder

HERE = Path(__file__).resolve().parent
PROMPT, RESPONSE = 256, 512  # tokens


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--shape", default="50m", help="a scripts/bench_gpu.py shape (default: %(default)s)")
    ap.add_argument("--tokens", type=int, default=4096, help="the packed sequence's length (default: %(default)s)")
    ap.add_argument("--work", type=Path, help="where the model folder is made (default: a temporary folder)")
    ap.add_argument("--json", type=Path, help="also write the JSON line here")
    ap.add_argument("--sp", type=int, help=argparse.SUPPRESS)  # internal: a rank's own process
    ap.add_argument("--rank-out", type=Path, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def long_group(tokens: int) -> list:
    """One group of experiences: a PROMPT-token prompt and responses of RESPONSE tokens, `tokens` in all."""
    import torch

    from buffer import Experience

    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 250, (PROMPT,), generator=g)
    n = max(1, (tokens - PROMPT) // RESPONSE)
    return [
        Experience(tokens=torch.cat([prompt, torch.randint(0, 250, (RESPONSE,), generator=g)]), prompt_length=PROMPT)
        for _ in range(n)
    ]


def keep_size(x, saved: dict) -> object:
    """A saved-tensors hook: the size of the storage of a tensor autograd keeps for the backward pass, by storage
    (a storage counted once), unless it is a weight (a leaf that requires grad: FSDP2's gathered parameters)."""
    if not (x.is_leaf and x.requires_grad):
        saved[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
    return x


def rank(a: argparse.Namespace) -> None:
    """One torchrun rank: build the actor, one pass over the long sequence, measured; its figures into a.rank_out."""
    sys.path.insert(0, str(HERE.parent))
    import torch
    import torch.distributed as dist

    import batching
    import scoring
    from configs.schema import TrainerConfig
    from ulysses import SeqParallel

    _, _, device = scoring.setup_distributed()
    model = scoring.build_model(
        str(a.work / "model"), TrainerConfig(), device, trainable=True, sp=SeqParallel.make(a.sp)
    )
    batch = batching.step_batch(long_group(a.tokens), width=RESPONSE)
    units = batching.pack_units(batch, list(range(len(batch["rewards"]))), True, 10**9)
    mb = batching.micro_batch(batch, units, True, device)
    Path("/proc/self/clear_refs").write_text("5")  # NOTE: the peak RSS starts again from the RSS now
    before, start, saved = status_mib("VmRSS"), time.perf_counter(), {}
    with torch.autograd.graph.saved_tensors_hooks(lambda x: keep_size(x, saved), lambda x: x):
        logp, ent = model(mb, entropy=True)  # [n,T] each
    loss = -(logp.sum() + 0.01 * ent.sum()) / mb["response_mask"].sum()
    loss.backward()
    out = {"sp": a.sp, "rank": dist.get_rank(), "pass_s": round(time.perf_counter() - start, 2)}
    out["peak_mib"] = round(status_mib("VmHWM") - before, 1)
    out["saved_mib"] = round(sum(saved.values()) / 2**20, 1)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
    out |= {"loss": loss.item(), "grad_norm": norm.full_tensor().item(), "width": mb["input_ids"].shape[1]}
    a.rank_out.with_suffix(f".{a.sp}.{dist.get_rank()}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict:
    a = parse_args(argv)
    if a.rank_out:
        rank(a)
        return {}
    work = a.work or Path(tempfile.mkdtemp(prefix="bench_ulysses_"))
    model_folder(a.shape, work, "float32")
    out, rows = work / "rank", []
    for sp in (1, a.ranks):
        run_ranks(
            __file__, a.ranks, ["--work", str(work), "--tokens", str(a.tokens), "--sp", str(sp), "--rank-out", str(out)]
        )
        rows += [json.loads(out.with_suffix(f".{sp}.{r}.json").read_text()) for r in range(a.ranks)]
    unsplit, split = ([r for r in rows if r["sp"] == sp] for sp in (1, a.ranks))
    record = {"shape": a.shape, "ranks": a.ranks, "tokens": rows[0]["width"], "per_rank": rows}
    record["peak_ratio"] = round(max(r["peak_mib"] for r in split) / max(r["peak_mib"] for r in unsplit), 3)
    record["saved_ratio"] = round(max(r["saved_mib"] for r in split) / max(r["saved_mib"] for r in unsplit), 3)
    record["loss_diff"] = abs(split[0]["loss"] - unsplit[0]["loss"])
    record["grad_norm_rel_diff"] = abs(split[0]["grad_norm"] / unsplit[0]["grad_norm"] - 1)
    print(f"{a.shape}, one packed sequence of {record['tokens']} tokens, {a.ranks} rank(s)")
    print(f"split / unsplit: peak {record['peak_ratio']}, saved activations {record['saved_ratio']}; ", end="")
    print(f"loss differs by {record['loss_diff']:.2e}, gradient norm by {record['grad_norm_rel_diff']:.2e} (relative)")
    columns = ("sequence-parallel ranks", "rank", "forward + backward s", "peak MiB", "saved activations MiB", "loss")
    keys = ("sp", "rank", "pass_s", "peak_mib", "saved_mib", "loss", "grad_norm")
    report(dict(zip(keys, (*columns, "grad norm"))), rows, record, a.json)
    return record


if __name__ == "__main__":
    main()
