"""explore.py: the explorer. Rollout engines and workflow runners turn tasks into scored experiences; evaluates.

Launch lines:
    python explore.py --config tiny.yaml --dry-run      # load, validate, print the resolved config
    python explore.py --config tiny.yaml --mode bench --dry-run

Status: this version loads and validates configs only (`--dry-run`); engines, workflows and the explore
loop are the explorer issue's work and not written yet.
"""

import sys

import configs


def main(argv: list[str]) -> int:
    cfg = configs.entry(argv, "nanorft explorer")
    print(f"explore.py: the explorer is not implemented in this version; only --dry-run works "
          f"(config {cfg.name!r} is valid)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
