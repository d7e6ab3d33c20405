"""A reward for the dynamic sampling tests (tests/test_presets.py, tests/test_async.py): the groups of a taskset's
first `tied_below` tasks always tie (0 for every response); any other response gets a coin flip seeded by its draw
key and its text, so that a group of G responses ties with probability 2 / 2**G."""

import random


def tie_or_coin(response: str, reference: str, draw_key: str = "", tied_below: int = 8) -> dict[str, float]:
    index = int(draw_key.split("/")[2])  # "<taskset>/<epoch>/<task index>/<run>"
    if index < tied_below:
        return {"accuracy": 0.0}
    return {"accuracy": float(random.Random(f"{draw_key}/{response}").random() < 0.5)}
