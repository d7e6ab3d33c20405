"""train.py: the trainer. Reads experiences from the experience DB, computes losses, steps, saves, publishes weights.

Launch lines:
    python train.py --config tiny.yaml --dry-run        # load, validate, print the resolved config
    python train.py --config gsm8k.yaml --algorithm.optimizer.lr 1e-6 --dry-run

Status: this version loads and validates configs only (`--dry-run`); the training loop (FSDP2, algos/,
checkpoints, weight sync) is the trainer issue's work and not written yet.
"""

import sys

import configs


def main(argv: list[str]) -> int:
    cfg = configs.entry(argv, "nanorft trainer")
    print(f"train.py: the training loop is not implemented in this version; only --dry-run works "
          f"(config {cfg.name!r} is valid)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
