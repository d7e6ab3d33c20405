"""A reward the untrained tiny model can learn in a few steps, for tests/test_learn_table.py: the fraction of the
response's characters that are the digit 7, as "accuracy" (so held-out accuracy is that fraction, greedy). The embedded
task itself needs 600 SFT steps (about 10 minutes on 2 cores) before a reward can teach it anything; this one needs
none. One character, not any digit: 4 steps at lr 2e-3 sharpen even a random-reward control onto a few repeated
characters, and with any digit counted, a control landed on digits (accuracy 1.0, CI of 2026-11-26); one of the 259
byte tokens is rarely where that lands. Example: score("77 apples", None) == {"accuracy": 2 / 9}."""

from __future__ import annotations

from typing import Any


def score(response: str, reference: Any = None) -> dict[str, float]:
    return {"accuracy": sum(c == "7" for c in response) / max(len(response), 1)}
