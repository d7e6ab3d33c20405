"""vllm.sampling_params (fake): `SamplingParams` and `RequestOutputKind`, the fields vllm_engine.py uses, with vLLM
0.32's names and defaults (top_k 0 or -1: off)."""

from __future__ import annotations

import dataclasses
import enum


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # every streamed output holds the sample's tokens so far (vLLM's default)
    DELTA = 1  # only the tokens since the previous output
    FINAL_ONLY = 2  # no intermediate outputs: one, at the end, with all n samples


@dataclasses.dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_tokens: int = 0
    max_tokens: int | None = 16
    stop: list[str] | None = None
    seed: int | None = None
    logprobs: int | None = None  # 0: the sampled token's log-prob only
    prompt_logprobs: int | None = None  # 0: each prompt token's own log-prob (at temperature 1, unprocessed)
    repetition_penalty: float = 1.0
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
