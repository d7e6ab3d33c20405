"""How the trainer's model starts on several ranks: each rank's peak host memory and time in scoring.build_model, and
the weights the ranks end with against the model folder's, bit for bit.

    .venv/bin/python scripts/bench_load.py                        # 2 CPU ranks (gloo), the 50m shape
    .venv/bin/python scripts/bench_load.py --ranks 4 --shape 0.5b --work /tmp/load
    .venv/bin/python scripts/bench_load.py --root /tmp/old        # another checkout's scoring.py (e.g. the one before)

The model folder is scripts/bench_gpu.py's shape (random weights, seed 0), saved in bf16 as published checkpoints
are (the trainer holds fp32 weights: each rank that loads it converts them), made once in --work.
Each rank is a torchrun process that imports everything, resets its peak RSS (/proc/self/clear_refs, 5), then runs
scoring.build_model(folder, trainable=True) as train.py does for the actor: `start_s` is that call's wall time,
`peak_mib` the rank's peak RSS during it above its RSS before it (VmHWM - VmRSS, Linux), `rss_after_mib` what it
holds after. Then the ranks gather the sharded weights (not counted) and rank 0 compares them, and the rotary
buffers, with models.load_model(folder): `same_weights` is true when every tensor is equal bit for bit. Last, one
AdamW step on random gradients and checkpoint.save_checkpoint of it into --work/ck as train.py saves a step that
published no weights (with or without the HF folder: --save-hf-checkpoint): `save_s` and `save_peak_mib` (the same
peak RSS measure) per rank.
Output: a markdown table, one row per rank, then one JSON line (--json FILE writes it too).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--shape", default="50m", help="a scripts/bench_gpu.py shape (default: %(default)s)")
    ap.add_argument("--work", type=Path, help="where the model folder is made (default: a temporary folder)")
    ap.add_argument("--root", type=Path, default=HERE.parent, help="the checkout whose scoring.py runs")
    ap.add_argument("--json", type=Path, help="also write the JSON line here")
    ap.add_argument(
        "--save-hf-checkpoint",
        default="always",
        choices=["always", "never"],
        help="trainer.save_hf_checkpoint of the save: never = no HF folder gathered (default: %(default)s)",
    )
    ap.add_argument("--rank-out", type=Path, help=argparse.SUPPRESS)  # internal: a rank's own process
    return ap.parse_args(argv)


def status_mib(key: str) -> float:
    """A VmRSS / VmHWM line of /proc/self/status, in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(key)


def rank(a: argparse.Namespace) -> None:
    """One torchrun rank: build the model, measure, check the weights; its figures into a.rank_out."""
    sys.path.insert(0, str(a.root))
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    import scoring
    from configs.schema import TrainerConfig
    from models import load_model

    _, _, device = scoring.setup_distributed()
    folder = str(a.work / "model")
    Path("/proc/self/clear_refs").write_text("5")  # NOTE: the peak RSS starts again from the RSS now
    before, start = status_mib("VmRSS"), time.perf_counter()
    model = scoring.build_model(folder, TrainerConfig(), device, trainable=True)
    out = {"rank": dist.get_rank(), "start_s": round(time.perf_counter() - start, 3)}
    out |= {"peak_mib": round(status_mib("VmHWM") - before, 1), "rss_after_mib": round(status_mib("VmRSS") - before, 1)}
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    buffers = {name: b.detach().cpu() for name, b in model.named_buffers()}
    if dist.get_rank() == 0:
        ref = load_model(folder)
        want = {"model." + k: v for k, v in ref.state_dict().items()}
        want |= {"model." + k: v for k, v in ref.named_buffers()}
        got = full | buffers
        out["same_weights"] = set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    del full, buffers
    out |= save_figures(model, a.work, torch, a.save_hf_checkpoint == "always")
    a.rank_out.with_suffix(f".{dist.get_rank()}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def save_figures(model, work: Path, torch, hf: bool) -> dict:
    """One AdamW step on random gradients (its states made), then checkpoint.save_checkpoint of step 1 as train.py
    saves one (no weights published this step): the call's wall time and this rank's peak RSS during it above its RSS
    before it."""
    import torch.distributed as dist

    import checkpoint
    from models import load_tokenizer

    optim = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-3)
    torch.manual_seed(0)
    for q in model.parameters():
        q.grad = torch.randn_like(q)
    optim.step()
    Path("/proc/self/clear_refs").write_text("5")
    before, start = status_mib("VmRSS"), time.perf_counter()
    tokenizer = load_tokenizer(str(work / "model"))
    extra = {} if hf else {"hf": False}  # NOTE: older code's save_checkpoint has no `hf`
    checkpoint.save_checkpoint(model, optim, tokenizer, work / "ck", 1, dist.get_rank(), None, **extra)
    return {"save_s": round(time.perf_counter() - start, 3), "save_peak_mib": round(status_mib("VmHWM") - before, 1)}


def model_folder(shape: str, work: Path, dtype_name: str) -> Path:
    """<work>/model: bench_gpu.py's `shape` saved in `dtype_name`, made the first time."""
    if not (work / "model" / "config.json").is_file():
        sys.path.insert(0, str(HERE))
        import torch
        from bench_gpu import make_model_folder

        make_model_folder(shape, work / "model", torch.device("cpu"), getattr(torch, dtype_name))
    return work / "model"


def run_ranks(script: str, ranks: int, args: list[str]) -> None:
    """`script` with `args` as `ranks` torchrun ranks on this machine (one thread each unless OMP_NUM_THREADS says)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", script, *args]
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})


def report(header: dict[str, str], rows: list[dict], record: dict, json_path: Path | None) -> None:
    """A markdown table of `rows` (header: row key -> column title), then `record` as one JSON line (also into
    json_path)."""
    print("| " + " | ".join(header.values()) + " |\n|" + "---|" * len(header))
    for r in rows:
        print("| " + " | ".join(str(r[k]) for k in header) + " |")
    line = json.dumps(record)
    print(line)
    if json_path:
        json_path.write_text(line + "\n")


def main(argv: list[str] | None = None) -> dict:
    a = parse_args(argv)
    if a.rank_out:
        rank(a)
        return {}
    work = a.work or Path(tempfile.mkdtemp(prefix="bench_load_"))
    model, out = model_folder(a.shape, work, "bfloat16"), work / "rank"
    args = ["--work", str(work), "--root", str(a.root), "--rank-out", str(out)]
    run_ranks(__file__, a.ranks, [*args, "--save-hf-checkpoint", a.save_hf_checkpoint])
    ranks = [json.loads(out.with_suffix(f".{r}.json").read_text()) for r in range(a.ranks)]
    weights = sum(f.stat().st_size for f in model.glob("*.safetensors")) / 2**20
    record = {"shape": a.shape, "ranks": a.ranks, "root": str(a.root), "weights_mib": round(weights, 1)}
    record["per_rank"] = ranks
    record["same_weights"] = ranks[0]["same_weights"]
    record["peak_mib_sum"] = round(sum(r["peak_mib"] for r in ranks), 1)
    record["save_peak_mib_sum"] = round(sum(r["save_peak_mib"] for r in ranks), 1)
    print(f"{a.shape} ({record['weights_mib']} MiB of weights on disk) on {a.ranks} rank(s), scoring.py of {a.root}")
    print(
        f"same weights bit for bit: {record['same_weights']}; peaks summed: start {record['peak_mib_sum']} MiB, ",
        end="",
    )
    print(f"save {record['save_peak_mib_sum']} MiB")
    columns = ("rank", "start s", "start's peak MiB", "held after, MiB", "save s", "save's peak MiB")
    keys = ("rank", "start_s", "peak_mib", "rss_after_mib", "save_s", "save_peak_mib")
    report(dict(zip(keys, columns)), ranks, record, a.json)
    return record


if __name__ == "__main__":
    main()
