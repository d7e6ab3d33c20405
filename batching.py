"""The trainer's step batch and its packing: a step's experiences as dense tensors, built once (step_batch), cut
into units (the sequences laid out together: a group sharing its prompt, a DPO pair), mini-batches (mini_batches) and
micro-batches, each packed into model inputs (packed_inputs) that segment attention (models.segment_attention) reads;
and the advantages an explorer-side advantage fn computes over a task's whole group before it is written
(group_advantages), on a step batch of that group.

    batch = step_batch(exps, width=cfg.model.max_response_tokens)  # [B] / [B,P] / [B,T] tensors
    units = pack_units(batch, list(range(B)), share=True, budget=4096)
    for mini in mini_batches(units, n=2):  # ppo_mini_batch_size B / 2
        for micro in micro_batches(batch, mini, budget=4096, fixed=None):
            mb = micro_batch(batch, micro, share=True, device=device, keys=("advantages",))  # a scorer's input
"""

from __future__ import annotations

import torch

import algos
from buffer import Experience
from configs import piece_config
from configs.schema import AlgorithmConfig


def episode_key(x: Experience, b: int) -> tuple:
    """The turns of one multi-turn episode share it (their group and info["episode"]); any other row is its own."""
    return (x.group_id, x.info["episode"]) if x.group_id and "episode" in x.info else ("row", b)


def step_batch(
    exps: list[Experience], width: int, temperatures: dict[str, float] | None = None
) -> dict[str, torch.Tensor]:
    """The step's experiences as dense tensors, built once; the trainer's later phases read and extend it. Per sequence
    [B]: prompt_lengths, response_lengths, rewards, group_index (a task's repeats share it; an experience without a
    group is its own), episode_index (the turns of one episode share it), prompt_index (same prompt token ids, same
    index: packed_inputs() shares them), expert (mix: expert SFT rows), has_rollout_logprobs, temperature (the one it
    was sampled at, recorded by the rollout handle; else that of the taskset that produced it, from `temperatures`; else
    1). A response to a truncated prompt gets an empty response_mask. Prompts [B,P] right-padded. Per response token
    [B,T]: responses (the token ids), response_mask (action tokens; the first token of a response without a prompt has
    no logit to score it), rollout_logprobs (0 where the engine gave none), expert_mask (1.0 on expert rows),
    eos_masked (bool: where the engine could not sample an EOS id, eos_masked() below; the scorer masks them too).
    has_stored_advantages [B], and only when some row carries them, stored_advantages [B,T] (an explorer-side advantage
    fn's, step_wise_grpo: no other algorithm pays for them); so too has_teacher_logprobs [B] and teacher_logprobs [B,T]
    (a teacher's log-probs of the response tokens: on-policy distillation).
    NOTE: T = max(width, the longest response): the trainer passes model.max_response_tokens, so that
    seq-mean-token-sum-norm divides by Dr.GRPO's constant whatever the batch holds."""
    B, P = len(exps), max(max(x.prompt_length for x in exps), 1)
    T = max(width, max(x.response_length for x in exps), 1)
    batch = {
        "prompts": torch.zeros(B, P, dtype=torch.long),
        "responses": torch.zeros(B, T, dtype=torch.long),
        "response_mask": torch.zeros(B, T, dtype=torch.bool),
        "rollout_logprobs": torch.zeros(B, T),
        "eos_masked": torch.zeros(B, T, dtype=torch.bool),
    }
    groups: dict[str, int] = {}
    episodes: dict[tuple, int] = {}
    prompts: dict[tuple[int, ...], int] = {}
    for b, x in enumerate(exps):
        p, r = x.prompt_length, x.response_length
        batch["prompts"][b, :p] = x.tokens[:p]
        batch["responses"][b, :r] = x.tokens[p:]
        batch["response_mask"][b, :r] = True if x.action_mask is None else x.action_mask
        batch["response_mask"][b, 0] &= p > 0
        if x.truncate_status == "prompt_truncated":  # the model saw a cut prompt: no loss (Trinity-RFT's rule)
            batch["response_mask"][b] = False
        if x.logprobs is not None:
            batch["rollout_logprobs"][b, :r] = x.logprobs
        batch["eos_masked"][b, :r] = eos_masked(x)
        groups.setdefault(x.group_id or f"id/{x.id}/{b}", len(groups))
        episodes.setdefault(episode_key(x, b), len(episodes))
        prompts.setdefault(tuple(x.tokens[:p].tolist()), len(prompts))
    batch |= {
        "prompt_lengths": torch.tensor([x.prompt_length for x in exps]),  # [B]
        "response_lengths": torch.tensor([x.response_length for x in exps]),  # [B]
        "rewards": torch.tensor([float(x.reward or 0.0) for x in exps]),  # [B]
        "group_index": torch.tensor([groups[x.group_id or f"id/{x.id}/{b}"] for b, x in enumerate(exps)]),  # [B]
        "episode_index": torch.tensor([episodes[episode_key(x, b)] for b, x in enumerate(exps)]),  # [B]
        "prompt_index": torch.tensor([prompts[tuple(x.tokens[: x.prompt_length].tolist())] for x in exps]),  # [B]
        "expert": torch.tensor([bool(x.info.get("expert")) for x in exps]),  # [B]
        "has_rollout_logprobs": torch.tensor([x.logprobs is not None for x in exps]),  # [B]
        "temperature": torch.tensor(
            [x.info.get("temperature") or (temperatures or {}).get(x.info.get("taskset"), 1.0) for x in exps]
        ),  # [B]
    }
    batch["expert_mask"] = batch["expert"][:, None].float().expand(B, T).contiguous()  # [B,T]
    for field, key in (("advantages", "stored_advantages"), ("teacher_logprobs", "teacher_logprobs")):
        batch |= carried(exps, field, key, T)
    return batch


def eos_masked(x: Experience) -> torch.Tensor:
    """[R] bool: the response positions at which the rollout engine masked every EOS id (min_tokens: EOS logits -inf
    for the first min_tokens tokens of each request's output, vLLM's MinTokensLogitsProcessor and the HF engine's
    Sampler alike). The rollout handle records the request's min_tokens in info["min_tokens"]: an int (one request),
    or a list, one per turn, for a conversation kept as one experience, whose turns are the runs of its action_mask
    (its sampled tokens). No record (rows from a file, an endpoint): nothing masked.
    NOTE: the behaviour policy is the masked distribution; the trainer's log-probs (old and current) mask the same
    positions, so that the importance ratio pi_old / pi_rollout compares the same thing (algos/correction.py)."""
    R, m = x.response_length, x.info.get("min_tokens") or 0
    out = torch.zeros(R, dtype=torch.bool)  # [R]
    if isinstance(m, int):
        out[:m] = True
        return out
    sampled = [True] * R if x.action_mask is None else x.action_mask.tolist()
    turn, at = -1, 0  # the turn of position t, and t's place in it
    for t in range(R):
        if sampled[t]:
            turn, at = (turn + 1, 0) if t == 0 or not sampled[t - 1] else (turn, at + 1)
            out[t] = turn < len(m) and at < m[turn]
    return out


def carried(exps: list[Experience], field: str, key: str, T: int) -> dict[str, torch.Tensor]:
    """has_<key> [B]: which experiences carry the per-token tensor `field`; and only when some do, <key> [B,T] (0
    elsewhere). Only an explorer-side advantage fn's rows carry advantages (step_wise_grpo: group_advantages), only a
    distillation workflow's teacher_logprobs: no other algorithm pays for them."""
    out = {f"has_{key}": torch.tensor([getattr(x, field) is not None for x in exps])}  # [B]
    if out[f"has_{key}"].any():
        out[key] = torch.zeros(len(exps), T)  # [B,T]
        for b, x in enumerate(exps):
            if getattr(x, field) is not None:
                out[key][b, : x.response_length] = getattr(x, field)
    return out


def group_advantages(exps: list[Experience], algorithm: AlgorithmConfig) -> None:
    """With an advantage fn computed in the explorer (algos.EXPLORER_ADVANTAGE_FNS: step_wise_grpo), its advantages
    over one task's whole group, before it is written: exp.advantages [R]; a row it filters out (std_threshold)
    gets an empty action_mask (it leaves the loss, as in the trainer). A no-op for every other advantage fn."""
    fn = algos.EXPLORER_ADVANTAGE_FNS.get(algorithm.advantage_fn)
    if fn is None or not exps:
        return
    batch = step_batch(exps, 0)
    keys = ("rewards", "group_index", "episode_index", "response_mask")
    out, _ = fn(
        {k: batch[k] for k in keys}, piece_config("advantage_fn", algorithm.advantage_fn, algorithm.advantage_fn_args)
    )
    keep = out.get("keep", torch.ones(len(exps), dtype=torch.bool))  # [B]
    for b, x in enumerate(exps):
        x.advantages = out["advantages"][b, : x.response_length].float()  # [R]
        if not keep[b]:
            x.action_mask = torch.zeros(x.response_length, dtype=torch.bool)  # [R]


def pack_units(
    batch: dict[str, torch.Tensor], idx: list[int], share: bool, budget: int, paired: bool = False
) -> list[list[int]]:
    """The sequences idx cut into the units packed_inputs() lays out together: with `share`, those with the same
    prompt (a GRPO group, a DPO pair), split where one unit would pass `budget` tokens; else one each, or
    (`paired`: DPO rows, chosen then rejected) one pair each. Units keep idx's order inside."""
    if not share:
        return [idx[k : k + 2] for k in range(0, len(idx), 2)] if paired else [[i] for i in idx]
    by_prompt: dict[int, list[int]] = {}
    for i in idx:
        by_prompt.setdefault(int(batch["prompt_index"][i]), []).append(i)
    units = []
    for members in by_prompt.values():
        size = int(batch["prompt_lengths"][members[0]])
        units.append([])
        for i in members:
            n = int(batch["response_lengths"][i])
            if units[-1] and size + n > budget and len(units[-1]) % 2 == 0:  # NOTE: even: never split a DPO pair
                units.append([])
                size = int(batch["prompt_lengths"][i])
            units[-1].append(i)
            size += n
    return units


def unit_length(batch: dict[str, torch.Tensor], unit: list[int]) -> int:
    """Tokens of a unit laid out by packed_inputs(): its prompt once, then each member's response."""
    return int(batch["prompt_lengths"][unit[0]]) + int(batch["response_lengths"][unit].sum())


def mini_batches(units: list[list[int]], n: int, paired: bool = False) -> list[list[list[int]]]:
    """Units dealt to n mini-batches (trainer.ppo_mini_batch_size) of as equal a number of rows as can be: largest unit
    first, each to the mini-batch with the most room left; a unit larger than that room is cut (a group, whose prompt is
    then laid out once per part), at an even row with `paired` (a DPO pair stays whole). Every rank cuts alike."""
    rows = sum(len(u) for u in units)
    step = 2 if paired else 1  # rows come in pairs
    whole = rows // step
    target = [step * (whole // n + (k < whole % n)) for k in range(n)]  # rows of each mini-batch
    target[0] += rows - sum(target)  # an odd row of `paired` rows (none should be): never left over
    out: list[list[list[int]]] = [[] for _ in range(n)]
    for u in sorted(units, key=len, reverse=True):
        while u:
            k = max(range(n), key=lambda k: target[k])  # the most room left (the first such)
            take = min(len(u), target[k])
            out[k].append(u[:take])
            target[k] -= take
            u = u[take:]
    return out


def micro_batches(
    batch: dict[str, torch.Tensor], units: list[list[int]], budget: int, fixed: int | None
) -> list[list[list[int]]]:
    """Units cut into micro-batches, largest first: at most `budget` packed tokens each (use_dynamic_bsz), or
    `fixed` sequences each. A unit larger than the budget goes alone."""
    out: list[list[list[int]]] = []
    size = 0
    for u in sorted(units, key=lambda u: -unit_length(batch, u)):
        n = len(u) if fixed else unit_length(batch, u)
        limit = fixed or budget
        if out and size + n <= limit:
            out[-1].append(u)
            size += n
        else:
            out.append([u])
            size = n
    return out


def micro_batch(
    batch: dict[str, torch.Tensor],
    units: list[list[int]],
    share: bool,
    device: torch.device,
    keys: tuple[str, ...] = (),
) -> dict:
    """packed_inputs() plus what the loss reads: targets [N], temperature [N], eos_masked [N], width T, and the step
    batch's [B,T] / [B] tensors `keys` (and response_mask) at the micro-batch's rows, in layout order."""
    mb = packed_inputs(batch, units, share, device)
    rows = mb["rows"]
    mb["width"] = T = batch["responses"].shape[1]
    dest = mb["dest"].cpu()
    mb["targets"] = batch["responses"][rows].flatten()[dest].to(device)  # [N]
    mb["temperature"] = batch["temperature"][rows, None].expand(len(rows), T).flatten()[dest].to(device)  # [N]
    if "eos_masked" in batch:
        mb["eos_masked"] = batch["eos_masked"][rows].flatten()[dest].to(device)  # [N]
    for k in ("response_mask", *keys):
        mb[k] = batch[k][rows].to(device)
    return mb


def packed_inputs(batch: dict[str, torch.Tensor], units: list[list[int]], share: bool, device: torch.device) -> dict:
    """Model inputs for the sequences of `units` (one micro-batch), each unit laid out as its prompt followed by
    each member's response (shared prompts: the prompt runs once for the whole group), the units bin-packed into
    rows as wide as the largest: input_ids / position_ids [R,W]; segments: what segment_attention needs so that
    a token sees the tokens before it in its own unit, except other members' responses; rows [n]: the batch rows
    of the micro-batch's sequences, in order; index [N]: where, in the flattened [R*W] rows, the state that
    predicts each valid response token is, and dest [N] where that token is in the flattened [n,T] (N = sum of
    response_mask over the rows). Without `share`, one sequence per row, right-padded, and a [R,W] mask."""
    rows_of_units = bin_pack([unit_length(batch, u) for u in units]) if share else [[k] for k in range(len(units))]
    W = max(unit_length(batch, u) for u in units)
    R, T = len(rows_of_units), batch["responses"].shape[1]
    ids, pos = torch.zeros(R, W, dtype=torch.long), torch.zeros(R, W, dtype=torch.long)
    order = [i for row in rows_of_units for k in row for i in units[k]]  # the micro-batch's rows, in layout order
    source = torch.zeros(len(order), T, dtype=torch.long)  # [n,T] flat position of each token's predictor
    prompts, responses = [], []  # flat positions of each unit's prompt; of each response, after its prompt's
    for r, row in enumerate(rows_of_units):
        col = r * W  # flat position of the next token
        for k in row:
            first = units[k][0]
            p = int(batch["prompt_lengths"][first])
            ids.view(-1)[col : col + p], pos.view(-1)[col : col + p] = batch["prompts"][first, :p], torch.arange(p)
            prompts.append(list(range(col, col + p)))
            col += p
            for i in units[k]:
                length = int(batch["response_lengths"][i])
                ids.view(-1)[col : col + length] = batch["responses"][i, :length]
                pos.view(-1)[col : col + length] = torch.arange(p, p + length)
                # NOTE: the state at position t predicts token t + 1: the response's first token is scored at the
                # prompt's last position, shared by the unit's members
                # (a response without a prompt has no state before its first token: response_mask drops it)
                predictors = (prompts[-1][-1:] or [col]) + list(range(col, col + length - 1))
                source[len(responses), :length] = torch.tensor(predictors[:length], dtype=torch.long)
                responses.append((prompts[-1], list(range(col, col + length))))
                col += length
    valid = batch["response_mask"][order]  # [n,T]
    mb = {"input_ids": ids, "position_ids": pos, "index": source[valid], "dest": valid.flatten().nonzero()[:, 0]}
    if share:  # the prompt part (causal in itself), then each response after its prompt
        parts = [
            segment_part([q for q in prompts if q], [0 for q in prompts if q]),
            segment_part([[*p, *q] for p, q in responses if q], [len(p) for p, q in responses if q]),
        ]
        mb["segments"] = {"parts": [tuple(x.to(device) for x in part) for part in parts if part[0].numel()]}
    else:
        lengths = torch.tensor([unit_length(batch, u) for u in units])  # [R]
        mb["attention_mask"] = (torch.arange(W)[None, :] < lengths[:, None]).long()  # [R,W]
    return {**{k: v.to(device) if torch.is_tensor(v) else v for k, v in mb.items()}, "rows": torch.tensor(order)}


def segment_part(keys: list[list[int]], prefix: list[int]) -> tuple[torch.Tensor, ...]:
    """segment_attention's tensors for segments whose keys are `keys[s]` (flat positions): the first `prefix[s]`
    are seen by every query, the rest are the queries themselves (causal). (queries [S,Q], keys [S,K],
    mask [S,1,Q,K], valid queries [S,Q]); padding is position 0, and a padding query sees key 0 only."""
    S = len(keys)
    K = max((len(k) for k in keys), default=1)
    Q = max((len(k) - p for k, p in zip(keys, prefix)), default=1)
    ki = torch.tensor([k + [0] * (K - len(k)) for k in keys], dtype=torch.long).view(S, K)  # [S,K]
    qi = torch.tensor([k[p:] + [0] * (Q - len(k) + p) for k, p in zip(keys, prefix)], dtype=torch.long).view(S, Q)
    first = torch.tensor(prefix)[:, None, None]  # [S,1,1] prefix keys
    n_keys = torch.tensor([len(k) for k in keys])[:, None, None]  # [S,1,1]
    q, k = torch.arange(Q)[None, :, None], torch.arange(K)[None, None, :]  # [1,Q,1], [1,1,K]
    valid = (q < n_keys - first)[:, :, 0]  # [S,Q]
    mask = (k < first) | ((k - first <= q) & (k < n_keys))  # [S,Q,K]
    mask = (mask & valid[:, :, None]) | (~valid[:, :, None] & (k == 0))  # [S,Q,K] padding queries see key 0
    return qi, ki, mask[:, None], valid


def bin_pack(lengths: list[int]) -> list[list[int]]:
    """First-fit decreasing: indices of `lengths` in rows as wide as the largest."""
    width, rows, room = max(lengths), [], []
    for k in sorted(range(len(lengths)), key=lambda k: -lengths[k]):
        r = next((r for r, free in enumerate(room) if free >= lengths[k]), None)
        if r is None:
            rows.append([])
            room.append(width)
            r = len(rows) - 1
        rows[r].append(k)
        room[r] -= lengths[k]
    return rows
