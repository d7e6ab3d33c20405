"""train.py: the trainer. Claims experiences from the experience DB (or reads an SFT file), computes
log-probs, advantages and the loss with the pieces named in the config (algos/), steps an FSDP2
model, publishes weights for the explorer and saves checkpoints.

Launch lines:
    python train.py --config tiny.yaml                   # a whole experiment (mode both / stages): hands
                                                          # over to launch.py, which starts explorer + trainer
    python train.py --config tiny.yaml --mode train      # the trainer alone (one plain process)
    torchrun --standalone --nproc_per_node 2 train.py --config tiny.yaml --mode train   # FSDP2 on 2 ranks
    python train.py --config tiny.yaml --dry-run         # print the resolved config

What one train step does, straight down `train()`:
    read train_batch_size experiences (rank 0 claims them in the DB, the other ranks read the same ids)
    -> shard the batch over ranks (length-balanced) -> old log-probs (and ref log-probs when a KL term is
    on) -> KL penalty into the reward (when kl_penalty_fn is set) -> advantages over the whole batch ->
    ppo_epochs x mini-batches x token-budget micro-batches of policy loss + KL loss + entropy loss,
    gradient accumulation, grad clip, AdamW -> publish weights (checkpoint files or the process group)
    every sync_interval steps -> checkpoint every save_interval steps -> log.

Deviations from veRL / Trinity-RFT:
- Padding is not removed by packing (that needs flash-attn's varlen kernels); instead sequences are
  sorted by length and cut into micro-batches under a token budget (`max_token_len_per_gpu`, counted
  with padding), which leaves little padding in practice.
- The learning rate is a function of the step (warm-up, then constant or cosine down to
  min_lr_ratio), set before each optimizer step; the scheduler has no state to save.
- Checkpoints are the HF folder plus the full optimizer state in safetensors (gathered on rank 0)
  instead of per-rank sharded .pt files; no pickle anywhere.
- A GRPO group split across two batches (possible only when an explorer drops a task) is normalised
  within each part.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import random
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

import algos
from algos.kl import loss as kl_loss
from algos.utils import masked_mean
import configs
import launch
import sync
from algos.kl import penalty as kl_penalty
from algos.correction import rollout_is_weights
from buffer import DataError, Experience, ExperienceDB, format_row, read_rows
from models import fingerprint, load_model, load_tokenizer
from monitor import Monitor

log = logging.getLogger("nanorft.train")


# --- distributed set-up and the model


def setup_distributed() -> tuple[int, int, torch.device]:
    """torchrun's process group (or a one-process group); this rank, world size and device."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    backend = "nccl" if cuda else "gloo"
    if "RANK" in os.environ:  # under torchrun
        dist.init_process_group(backend)
    else:  # a plain process: a group of one, no rendezvous needed
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size(), device


def build_model(path: str, cfg: configs.Config, device: torch.device, trainable: bool) -> torch.nn.Module:
    """An HF causal LM sharded with FSDP2: each decoder layer, then the root (embeddings, head)."""
    t = cfg.trainer
    model = load_model(path, dtype="float32", device="cpu")
    if trainable and t.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    cuda = device.type == "cuda"
    # bf16 compute with fp32 master weights and fp32 gradient reduction on GPU; fp32 throughout on CPU.
    policy = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} if cuda else {}
    if cuda and (t.param_offload if trainable else t.ref_param_offload):
        policy["offload_policy"] = CPUOffloadPolicy()
    for layer in model.model.layers:
        fully_shard(layer, **policy)
    fully_shard(model, **policy)  # NOTE: last, so tied embeddings / lm_head share one root group
    model.train(trainable)
    if not trainable:
        model.requires_grad_(False)
    return model


def lr_at(step: int, cfg: configs.Config, total: int) -> float:
    """Learning rate for optimizer step `step` (1-based): linear warm-up, then constant or cosine."""
    o = cfg.algorithm.optimizer
    warmup = o.lr_warmup_steps if o.lr_warmup_steps >= 0 else int(o.lr_warmup_steps_ratio * total)
    if step <= warmup:
        return o.lr * step / max(warmup, 1)
    if o.lr_scheduler_type == "cosine":
        progress = (step - warmup) / max(total - warmup, 1)
        return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))
    return o.lr


# --- reading experiences


class Source:
    """Where train batches come from: the experience DB (claims) or, for offline data such as an SFT
    file (`experience_buffer.storage_type: file`), the file's rows in a seeded order per epoch.
    `ended` (rank 0): the DB will get no more experiences (every explorer that wrote to it finished)."""

    def __init__(self, cfg: configs.Config, tokenizer, rank: int, device: torch.device) -> None:
        self.cfg, self.rank, self.device, self.ended = cfg, rank, device, False
        eb = cfg.buffer.trainer_input.experience_buffer
        self.rows: list[Experience] = []
        if eb.storage_type == "file":
            self.rows = [sft_experience(format_row(row, eb.format, f"{eb.path}: row {n}", kind="sft"), tokenizer,
                                        cfg.model.max_model_len) for _, n, row in read_rows(eb.path, eb.subset_name, eb.split)]
            if not self.rows:
                raise DataError(f"experience_buffer {eb.name}: {eb.path} has no rows")
        else:
            self.db = ExperienceDB(eb.path)
            self.db.check_identity(fingerprint(cfg.model.model_path, tokenizer), "the trainer")
            a = cfg.algorithm
            self.strategy = lookup("sample_strategy", a.sample_strategy, a.sample_strategy_args)

    def total_steps(self) -> int:
        b = self.cfg.buffer
        if b.total_steps:
            return b.total_steps
        if self.rows:
            return math.ceil(len(self.rows) / b.train_batch_size) * b.total_epochs
        tasks = sum(len(read_rows(ts.path, ts.subset_name, ts.split)) for ts in b.explorer_input.tasksets)
        return math.ceil(tasks * b.total_epochs * self.cfg.algorithm.repeat_times / b.train_batch_size)

    def read(self, step: int) -> list[Experience]:
        """The batch of train step `step`, identical on every rank; [] when none came (see `ended`)."""
        n = self.cfg.buffer.train_batch_size
        if self.rows:  # a pure function of the step, so a resumed run continues exactly
            positions = [divmod(pos, len(self.rows)) for pos in range((step - 1) * n, step * n)]  # (epoch, index)
            orders = {e: random.Random(f"sft/{e}").sample(range(len(self.rows)), len(self.rows)) for e, _ in positions}
            return [self.rows[orders[e][i]] for e, i in positions]
        eb = self.cfg.buffer.trainer_input.experience_buffer
        ids = torch.zeros(n + 2, dtype=torch.long, device=self.device)  # [count, ended, ids...]
        if self.rank == 0:
            fn, strategy_cfg = self.strategy
            got = self.db.claim(n, step, timeout=eb.max_read_timeout, priority=eb.use_priority_queue,
                                reuse_cooldown=eb.reuse_cooldown_time, decay=eb.priority_decay, partial=False,
                                waiting=self.waiting(step), **fn(step, strategy_cfg))
            ids[:2] = torch.tensor([len(got), self.ended])
            ids[2 : len(got) + 2] = torch.tensor([x.id for x in got], dtype=torch.long)
        dist.broadcast(ids, src=0)
        self.ended = bool(ids[1])
        return got if self.rank == 0 else self.db.get(ids[2 : int(ids[0]) + 2].tolist())

    def explorers(self) -> str:
        """What the explorers that write to the DB last recorded, for log lines."""
        now, states = time.time(), {k[9:]: json.loads(v) for k, v in self.db.meta_items("explorer/").items()}
        return "; ".join(f"{name} at step {x['step']}" + (" (finished)" if x.get("finished") else
                         f", last wrote {now - x.get('time', now):.0f} s ago") for name, x in states.items()) or \
            "none has written to this DB yet"

    def waiting(self, step: int):
        """The claim's `waiting` callback: a log line every 30 s, and "no more will come" once every
        explorer that wrote to the DB has finished."""
        eb, next_note = self.cfg.buffer.trainer_input.experience_buffer, [5.0]

        def check(have: int, waited: float) -> bool:
            states = [json.loads(v) for v in self.db.meta_items("explorer/").values()]
            if states and all(x.get("finished") for x in states):
                self.ended = True
                return True
            if waited >= next_note[0]:
                next_note[0] = waited + 30
                set_status(self.db, step - 1, "waiting")
                log.info("train step %d: waiting for experiences: %d of %d ready after %.0f s (gives up after "
                         "max_read_timeout %g s); explorers: %s", step, have, self.cfg.buffer.train_batch_size,
                         waited, eb.max_read_timeout, self.explorers())
            return False

        return check


def set_status(db: ExperienceDB, step: int, status: str) -> None:
    """The trainer's state in the DB (an explorer waiting for weights reads it): its last finished
    step and "training", "waiting" (for experiences), "finished" or "stopped"."""
    db.set_meta("trainer", json.dumps({"step": step, "status": status, "time": time.time(), "pid": os.getpid()}))


def sft_experience(row: dict, tokenizer, max_len: int) -> Experience:
    """One SFT conversation as an Experience: the chat-templated prompt, then the last assistant turn
    up to and including its end-of-turn token (the loss sees only those)."""
    msgs = row["messages"]
    prompt = tokenizer.apply_chat_template(msgs[:-1], add_generation_prompt=True, tokenize=True, return_dict=False)
    full = tokenizer.apply_chat_template(msgs, tokenize=True, return_dict=False)
    if full[: len(prompt)] != prompt:
        raise DataError("the chat template renders the conversation's prompt differently with and without the answer")
    response = full[len(prompt):]
    if tokenizer.eos_token_id in response:  # drop what the template adds after the end of the turn
        response = response[: response.index(tokenizer.eos_token_id) + 1]
    tokens = torch.tensor((prompt + response)[:max_len], dtype=torch.long)
    return Experience(tokens=tokens, prompt_length=min(len(prompt), max_len - 1), reward=0.0)


# --- batches


def micro_batches(lengths: list[int], budget: int, fixed: int | None) -> list[list[int]]:
    """Indices cut into micro-batches, longest first: at most `budget` tokens each counting padding
    (use_dynamic_bsz), or `fixed` sequences each. A sequence longer than the budget goes alone."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    out: list[list[int]] = []
    for i in order:
        if out and (len(out[-1]) < fixed if fixed else (len(out[-1]) + 1) * lengths[out[-1][0]] <= budget):
            out[-1].append(i)
        else:
            out.append([i])
    return out


def collate(exps: list[Experience], extra: dict[str, list[torch.Tensor]], idx: list[int], device: torch.device) -> dict:
    """Right-padded model inputs [B,L] and response-aligned tensors [B,T] for the experiences `idx`."""
    rows = [exps[i] for i in idx]
    B, L, T = len(rows), max(len(x.tokens) for x in rows), max(max(x.response_length for x in rows), 1)
    batch = {"input_ids": torch.zeros(B, L, dtype=torch.long), "attention_mask": torch.zeros(B, L, dtype=torch.long),
             "positions": torch.zeros(B, T, dtype=torch.long), "targets": torch.zeros(B, T, dtype=torch.long),
             "response_mask": torch.zeros(B, T, dtype=torch.bool), "rewards": torch.tensor([x.reward for x in rows])}
    for b, x in enumerate(rows):
        n, p, r = len(x.tokens), x.prompt_length, x.response_length
        batch["input_ids"][b, :n] = x.tokens
        batch["attention_mask"][b, :n] = 1
        # NOTE: the logits at position t predict token t + 1, so response token p + j is read at p + j - 1.
        batch["positions"][b, :r] = torch.arange(p - 1, n - 1).clamp(min=0)
        batch["targets"][b, :r] = x.tokens[p:]
        batch["response_mask"][b, :r] = True if x.action_mask is None else x.action_mask
        batch["response_mask"][b, 0] &= p > 0  # a response with no prompt has no logit for its first token
    for name, values in extra.items():
        batch[name] = torch.zeros(B, T)
        for b, i in enumerate(idx):
            batch[name][b, : len(values[i])] = values[i]
    return {k: v.to(device) for k, v in batch.items()}


def token_logprobs(model, mb: dict, temperature: float, entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(response token) [B,T] under `model` at the rollout temperature, and the entropy [B,T]."""
    logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], use_cache=False).logits  # [B,L,V]
    rows = torch.arange(logits.shape[0], device=logits.device)[:, None]  # [B,1]
    logits = logits[rows, mb["positions"]].float() / temperature  # [B,T,V] response positions only
    logp = torch.log_softmax(logits, dim=-1)  # [B,T,V]
    out = logp.gather(-1, mb["targets"][..., None]).squeeze(-1)  # [B,T]
    ent = -(logp.exp() * logp).sum(-1) if entropy else None  # [B,T]
    return out, ent


@torch.no_grad()
def score(model, exps: list[Experience], cfg: configs.Config, device, temperature: float) -> list[torch.Tensor]:
    """Per-experience response log-probs (1-D, length R) under `model`, in micro-batches, no grad."""
    t, out = cfg.trainer, [torch.empty(0)] * len(exps)
    was_training = model.training
    model.eval()
    for idx in micro_batches([len(x.tokens) for x in exps], t.max_token_len_per_gpu, None if t.use_dynamic_bsz else t.log_prob_micro_batch_size_per_gpu):
        logp, _ = token_logprobs(model, collate(exps, {}, idx, device), temperature, entropy=False)
        for b, i in enumerate(idx):
            out[i] = logp[b, : exps[i].response_length].float().cpu()
    model.train(was_training)
    return out


# --- weights out: publish for the explorer, save a checkpoint, resume


def send_weights(model, sender, step: int) -> None:
    """Process-group sync: one full parameter at a time, gathered on every rank, sent by rank 0."""
    params = dict(model.named_parameters())  # tied weights appear once
    specs = [(k, tuple(v.shape), v.dtype) for k, v in params.items()]
    tensors = (v.full_tensor() if isinstance(v, DTensor) else v for v in params.values())
    with torch.no_grad():  # NOTE: ranks > 0 (sender None) only drain `tensors`: each all-gather needs every rank
        sync.send_weights(sender, step, specs, tensors)


# --- main


def lookup(kind: str, name: str, args: dict):
    """(function, validated Config) of an algos/ piece named in the config."""
    return algos.REGISTRIES[kind][name][0], algos.make_config(kind, name, args, f"algorithm.{kind}_args")


def reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """Sum over ranks of each number (an all-reduce of one small tensor)."""
    x = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(x)
    return x.tolist()


def train(cfg: configs.Config) -> int:
    """Train one stage (mode train, or the trainer half of mode both); returns the exit code."""
    # --- setup: process group, model (+ reference), optimizer, the loss pieces, checkpoint to resume
    rank, world, device = setup_distributed()
    a, t, s, job = cfg.algorithm, cfg.trainer, cfg.synchronizer, Path(cfg.checkpoint_job_dir)
    torch.manual_seed(cfg.explorer.rollout_model.seed + rank)
    resume = sync.latest_checkpoint(cfg.checkpoint_job_dir)
    if resume and not cfg.continue_from_checkpoint:  # launch.py renames the run in the other modes
        log.error("%s already has checkpoint step %d and continue_from_checkpoint is false: set it true to resume, "
                  "or choose another name (the explorer and trainer must share one)", job, resume)
        return 2
    tokenizer = load_tokenizer(cfg.model.model_path)
    model = build_model(str(sync.weights_path(job, resume)) if resume else cfg.model.model_path, cfg, device, trainable=True)
    optim = torch.optim.AdamW(model.parameters(), lr=a.optimizer.lr, betas=tuple(a.optimizer.betas),
                              weight_decay=a.optimizer.weight_decay)
    rl = a.advantage_fn != "none"  # offline losses (sft) need neither old log-probs nor advantages
    advantage_fn, advantage_cfg = lookup("advantage_fn", a.advantage_fn, a.advantage_fn_args) if rl else (None, None)
    policy_fn, policy_cfg = lookup("policy_loss_fn", a.policy_loss_fn, a.policy_loss_fn_args)
    entropy_fn, entropy_cfg = lookup("entropy_loss_fn", a.entropy_loss_fn, a.entropy_loss_fn_args)
    kl_loss_cfg = algos.make_config("kl_loss_fn", a.kl_loss_fn, a.kl_loss_fn_args, "algorithm.kl_loss_fn_args")
    kl_penalty_cfg = algos.make_config("kl_penalty_fn", a.kl_penalty_fn, a.kl_penalty_fn_args, "algorithm.kl_penalty_fn_args")
    use_ref = a.kl_loss_fn != "none" or a.kl_penalty_fn != "none"
    ref = build_model(cfg.model.model_path, cfg, device, trainable=False) if use_ref else None
    source = Source(cfg, tokenizer, rank, device)
    total = source.total_steps()
    if resume:
        sync.load_checkpoint(model, optim, job, resume, rank)
        if rank == 0:
            sync.set_latest(job, resume)
            log.info("resumed from checkpoint step %d of %s", resume, job)
    if rank == 0 and not source.rows:
        # NOTE: also with no checkpoint yet: a trainer killed before its first save claimed steps 1, 2, ...
        if cfg.continue_from_checkpoint:
            log.info("%d experience claims of steps after %d released", source.db.release_after(resume), resume)
        set_status(source.db, resume, "training")
    tasksets = cfg.buffer.explorer_input.tasksets
    temperature = tasksets[0].rollout_args.temperature if tasksets else cfg.model.temperature
    temperature = temperature or 1.0  # greedy rollouts are scored at T = 1
    sender = sync.open_sender(job, device, s.sync_timeout) if rl and s.sync_method == "nccl" and rank == 0 else None
    monitor = Monitor(cfg, role=t.name) if rank == 0 else None
    if rank == 0:
        log.info("trainer: %d rank(s) on %s, steps %d..%d, %s + %s, reference model: %s, sync %s every %d step(s)",
                 world, device.type, resume + 1, total, a.advantage_fn, a.policy_loss_fn, use_ref, s.sync_method, s.sync_interval)

    code, done, saved = 0, resume, resume  # done: the last finished step; saved: the last checkpoint
    for step in range(resume + 1, total + 1):
        timing, t0 = {}, time.monotonic()
        # --- read the batch, shard it over ranks (longest first, dealt round-robin: balanced tokens)
        exps = source.read(step)
        if not exps and source.ended:
            if rank == 0:
                log.info("every explorer writing to the experience DB has finished and no experiences are left: "
                         "training ends after step %d of %d", done, total)
            break
        if not exps:
            if rank == 0:
                log.error("no full batch for train step %d after %g s (buffer.trainer_input.experience_buffer."
                          "max_read_timeout); explorers: %s. Stopping; a restart continues after checkpoint step %d.",
                          step, cfg.buffer.trainer_input.experience_buffer.max_read_timeout, source.explorers(), done)
            code = 1
            break
        timing["time/read"] = time.monotonic() - t0
        if len(exps) < world:
            raise RuntimeError(f"train step {step}: {len(exps)} experiences cannot be shared by {world} ranks")
        order = sorted(range(len(exps)), key=lambda i: -len(exps[i].tokens))
        mine = order[rank::world]
        my = [exps[i] for i in mine]
        extra: dict[str, list[torch.Tensor]] = {}
        metrics: dict[str, float] = {}

        # --- old and reference log-probs
        t1 = time.monotonic()
        n_mini = max(1, round(len(exps) / t.ppo_mini_batch_size))
        # NOTE: with one update per step (one epoch, one mini-batch) the weights have not moved when a
        # micro-batch's loss is computed, so old log-probs = the current ones, detached: no extra pass.
        one_update = t.ppo_epochs == 1 and n_mini == 1 and a.kl_penalty_fn == "none"
        if rl and not one_update:
            extra["old_logprobs"] = score(model, my, cfg, device, temperature)
        if rl and any(x.logprobs is not None for x in my):  # the rollout engine's, for the off-policy correction
            extra["rollout_logprobs"] = [x.logprobs if x.logprobs is not None else torch.zeros(x.response_length) for x in my]
            extra["has_rollout_logprobs"] = [torch.full((x.response_length,), float(x.logprobs is not None)) for x in my]
        if ref is not None:
            extra["ref_logprobs"] = score(ref, my, cfg, device, temperature)
        timing["time/old_ref_logprobs"] = time.monotonic() - t1

        # --- reward (with the KL penalty folded in) and advantages over the whole batch
        if rl:
            rewards = torch.tensor([x.reward for x in exps], dtype=torch.float32)  # [B]
            if a.kl_penalty_fn != "none":
                mb = collate(my, extra, list(range(len(my))), torch.device("cpu"))
                token_rewards, kl_metrics = kl_penalty(mb, kl_penalty_cfg, a.kl_penalty_fn)  # [B_rank,T]
                mine_scores = torch.zeros(len(exps))
                mine_scores[mine] = token_rewards.sum(-1)
                rewards = torch.tensor(reduce_sum(mine_scores.tolist(), device), dtype=torch.float32)  # [B]
                metrics.update({f"critic/{k}": v for k, v in kl_metrics.items()})
            groups = {g: i for i, g in enumerate(dict.fromkeys(x.group_id or str(x.id) for x in exps))}
            full = collate(exps, {}, list(range(len(exps))), torch.device("cpu"))
            adv, adv_metrics = advantage_fn({"rewards": rewards, "response_mask": full["response_mask"],
                                             "group_index": torch.tensor([groups[x.group_id or str(x.id)] for x in exps])},
                                            advantage_cfg)
            extra["advantages"] = [adv["advantages"][i, : exps[i].response_length] for i in mine]
            keep = adv.get("keep", torch.ones(len(exps), dtype=torch.bool))
            # Filtered groups (std_threshold) leave the loss: their rows keep their place (every rank
            # still runs the same passes) with an empty mask.
            my = [x if keep[i] else dataclasses.replace(x, action_mask=torch.zeros(x.response_length, dtype=torch.bool))
                  for x, i in zip(my, mine)]
            metrics.update({f"critic/{k}": v for k, v in adv_metrics.items()})
            metrics.update({"critic/score/mean": rewards.mean().item(), "critic/score/max": rewards.max().item(),
                            "critic/score/min": rewards.min().item(),
                            "critic/advantages/mean": adv["advantages"][full["response_mask"]].mean().item(),
                            "critic/advantages/max": adv["advantages"].max().item(),
                            "critic/advantages/min": adv["advantages"].min().item()})

        # --- update: ppo_epochs x mini-batches x micro-batches (token budget), gradient accumulation
        t2 = time.monotonic()
        minis = [list(range(len(my)))[k::n_mini] for k in range(n_mini)]
        sums: dict[str, float] = {}
        grad_norms, skipped = [], 0
        for _ in range(t.ppo_epochs):
            for mini in minis:
                fixed = None if t.use_dynamic_bsz else t.micro_batch_size_per_gpu
                micro = [[mini[j] for j in m] for m in micro_batches([len(my[i].tokens) for i in mini], t.max_token_len_per_gpu, fixed)] if mini else []
                counted = [collate(my, {}, m, torch.device("cpu"))["response_mask"] for m in micro]
                count = [float(c.sum()) if a.loss_agg_mode == "token-mean" else float(c.any(-1).sum()) for c in counted]
                (total_count,) = reduce_sum([sum(count)], device)
                # NOTE: every rank must run the same number of forward/backward passes (FSDP collectives):
                # ranks with fewer micro-batches run a repeat of one with weight 0.
                n_micro = int(max(reduce_max(len(micro), device), 1))
                if total_count == 0:  # every row of this mini-batch was filtered out, on every rank
                    continue
                optim.zero_grad(set_to_none=True)
                for k in range(n_micro):
                    idx, share = (micro[k], count[k] / total_count) if k < len(micro) else ([0], 0.0)
                    mb = collate(my, extra, idx, device)
                    logp, ent = token_logprobs(model, mb, temperature, entropy=True)  # [B,T], [B,T]
                    if rl and one_update:
                        mb["old_logprobs"] = logp.detach()  # [B,T] ratio exactly 1 (see above)
                    m = {}
                    if "rollout_logprobs" in mb:  # truncated IS weights (rollout -> old policy) scale the advantages
                        rc = a.rollout_correction
                        w, m = rollout_is_weights(mb["old_logprobs"], mb["rollout_logprobs"],  # [B,T]
                                                  mb["response_mask"] & (mb["has_rollout_logprobs"] > 0), rc.rollout_is, rc.rollout_is_threshold)
                        mb["advantages"] = mb["advantages"] * w  # [B,T]
                    loss, pm = policy_fn(logp, mb, policy_cfg, a.loss_agg_mode)  # []
                    m |= pm
                    if a.kl_loss_fn != "none":
                        kl_term, km = kl_loss(logp, mb, kl_loss_cfg, a.loss_agg_mode, a.kl_loss_fn)  # []
                        loss, m = loss + kl_term, m | km
                    ent_loss, em = entropy_fn(ent, mb, entropy_cfg, a.loss_agg_mode)  # []
                    m |= em | {"entropy": masked_mean(ent.detach(), mb["response_mask"]).item()}
                    # NOTE: FSDP averages gradients over ranks, hence x world: the sum over ranks and
                    # micro-batches of share x loss is the loss of the whole mini-batch.
                    ((loss + ent_loss.to(loss.device)) * share * world).backward()
                    for key, v in m.items():
                        key = key if "/" in key else f"actor/{key}"
                        sums[key] = sums.get(key, 0.0) + v * share / (t.ppo_epochs * n_mini)
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
                norm = (norm.full_tensor() if isinstance(norm, DTensor) else norm).item()
                if not math.isfinite(norm):  # veRL skips such steps too
                    log.warning("step %d: gradient norm is %s; optimizer step skipped", step, norm)
                    skipped += 1
                    continue
                grad_norms.append(norm)
                for g in optim.param_groups:
                    g["lr"] = lr_at(step, cfg, total)
                optim.step()
        keys = sorted(sums)
        metrics.update(zip(keys, reduce_sum([sums[k] for k in keys], device)))
        timing["time/update"] = time.monotonic() - t2

        # --- sync: publish the new weights (files, or the process group) for the explorer
        t3 = time.monotonic()
        # NOTE: a fixed-style explorer asks for step s at its step s + sync_offset, so none asks for the last
        # sync_offset steps; a dynamic-style one may ask for any newer weights at any sync point.
        explorer_waits = step % s.sync_interval == 0 and (step + s.sync_offset < total or s.sync_style != "fixed")
        weights = None
        if rl and s.sync_method == "nccl" and explorer_waits:
            send_weights(model, sender, step)  # sender is None on ranks > 0
        if (explorer_waits and s.sync_method == "checkpoint") or step == total:
            weights = sync.full_state(model)
            if rank == 0:
                sync.publish_hf(model, tokenizer, job, step, state_dict=weights)
        timing["time/sync"] = time.monotonic() - t3
        # --- checkpoint
        t4 = time.monotonic()
        if (t.save_interval and step % t.save_interval == 0) or step == total:
            sync.save_checkpoint(model, optim, tokenizer, job, step, rank, weights, t.max_checkpoints_to_keep)
            saved = step
        timing["time/save_checkpoint"] = time.monotonic() - t4
        done = step

        # --- log
        timing["time/step"] = time.monotonic() - t0
        tokens = sum(len(x.tokens) for x in exps)
        lengths = [x.response_length for x in exps]
        metrics.update(timing)
        metrics.update({"actor/lr": lr_at(step, cfg, total), "actor/grad_norm": sum(grad_norms) / max(len(grad_norms), 1),
                        "actor/skipped_steps": skipped, "response_length/mean": sum(lengths) / len(lengths),
                        "response_length/max": max(lengths), "prompt_length/mean": sum(x.prompt_length for x in exps) / len(exps),
                        "perf/total_num_tokens": tokens, "perf/throughput": tokens / timing["time/step"] / world,
                        "perf/train_tokens_per_s": tokens / max(timing["time/update"], 1e-9),
                        "batch/size": len(exps)})
        if rl:  # the weights versions that generated the batch, and how far behind version step - 1 they are
            versions = [x.model_version for x in exps]
            metrics.update({"sample/model_version/min": min(versions), "sample/model_version/max": max(versions),
                            "sample/model_version/mean": sum(versions) / len(exps),
                            "batch/staleness/mean": step - 1 - sum(versions) / len(exps),
                            "batch/staleness/max": step - 1 - min(versions)})
            for name in sorted({x.explorer for x in exps}):
                metrics[f"sample/experience_count/{name or 'unknown'}"] = sum(x.explorer == name for x in exps)
        if monitor is not None:
            monitor.log(metrics, step=step)
        if rank == 0 and not source.rows:
            set_status(source.db, step, "training")
    # --- the end: publish and save the last step unless done above (data ran out, or stopped waiting)
    if saved < done:
        weights = sync.full_state(model)
        if rank == 0:
            sync.publish_hf(model, tokenizer, job, done, state_dict=weights)
        sync.save_checkpoint(model, optim, tokenizer, job, done, rank, weights, t.max_checkpoints_to_keep)
    if rank == 0 and not source.rows:
        set_status(source.db, done, "stopped" if code else "finished")
    if sender is not None:
        sync.close_sender(sender, finished=code == 0)
    if monitor is not None:
        monitor.close()
    dist.destroy_process_group()
    return code


def reduce_max(value: float, device: torch.device) -> float:
    x = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return x.item()


def main(argv: list[str]) -> int:
    cfg = configs.entry(argv, "nanorft trainer")
    if "RANK" not in os.environ and launch.LAUNCHED not in os.environ:
        return launch.run(cfg)  # the same code path as `bash run.sh CONFIG`: config saved, stages, summary
    return launch.run_in_process(cfg, {"train": train, "both": train}, "trainer")


if __name__ == "__main__":
    code = main(sys.argv[1:])
    # NOTE: leave without the interpreter's teardown. With everything saved and the process group destroyed,
    # about 1 exit in 10 here still aborted there ("terminate called without an active exception", exit -6,
    # no Python frame: a gloo worker thread of a process-group object that FSDP2's meshes still referenced).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
