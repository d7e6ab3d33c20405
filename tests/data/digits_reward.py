"""A reward the untrained tiny model can learn in a few steps, for tests/test_learn_table.py: the fraction of the
response's characters that are digits, as "accuracy" (so held-out accuracy is that fraction, greedy). The embedded
task itself needs 600 SFT steps (about 10 minutes on 2 cores) before a reward can teach it anything; this one needs
none. Example: score("12 apples", None) == {"accuracy": 2 / 9}."""

from __future__ import annotations

from typing import Any


def score(response: str, reference: Any = None) -> dict[str, float]:
    return {"accuracy": sum(c.isdigit() for c in response) / max(len(response), 1)}
