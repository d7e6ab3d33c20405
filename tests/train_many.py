"""helpers.run_trains' script under torchrun: train.py's main for each (config, stderr file) pair, in turn, on each
rank of one launch. The exit codes go to a JSON file (rank 0's).

    torchrun --nproc_per_node=N tests/train_many.py CODES.json CONFIG1 STDERR1 [CONFIG2 STDERR2 ...]  # from the root

NOTE: each run's process group rendezvouses under its own key prefix: a second init on torchrun's store would read the
first run's keys (stale addresses: the ranks hung in their first all-reduce); and a run that stops in set-up leaves its
group, which a process's exit would have ended."""

import json
import os
import sys
import traceback

sys.path.insert(0, os.getcwd())
import torch.distributed as dist  # noqa: E402

import train  # noqa: E402

init, runs, codes = dist.init_process_group, [0], []
rank = int(os.environ.get("RANK", "0"))


def own_keys(backend, **kw):
    if "RANK" in os.environ and "store" not in kw:
        env = os.environ
        store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), int(env["WORLD_SIZE"]), False)
        kw.update(store=dist.PrefixStore(f"run{runs[0]}/", store), rank=rank, world_size=int(env["WORLD_SIZE"]))
    return init(backend, **kw)


dist.init_process_group = own_keys
out, pairs = sys.argv[1], sys.argv[2:]
for config, err in zip(pairs[::2], pairs[1::2]):
    sys.stdout.flush(), sys.stderr.flush()
    with open(err if rank == 0 else f"{err}.rank{rank}", "w") as f:
        os.dup2(f.fileno(), 2)
    try:
        code = train.main(["--config", config])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stderr.flush()
    codes.append(code)
    runs[0] += 1
if rank == 0:
    open(out, "w").write(json.dumps(codes))
sys.stdout.flush(), sys.stderr.flush()
os._exit(0)
