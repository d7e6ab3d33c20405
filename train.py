"""train.py: the trainer. Claims experiences from the experience DB (or reads SFT / DPO files), computes
log-probs, values, advantages and the loss with the pieces named in the config (algos/), steps an FSDP2
model (and critic), publishes weights for the explorer and saves checkpoints.

Launch lines:
    python train.py --config tiny.yaml                   # a whole experiment (mode both / stages): hands
                                                          # over to launch.py, which starts explorer + trainer
    python train.py --config tiny.yaml --mode train      # the trainer alone (one plain process)
    torchrun --standalone --nproc_per_node 2 train.py --config tiny.yaml --mode train   # FSDP2 on 2 ranks
    python train.py --config tiny.yaml --dry-run         # print the resolved config

What one train step does, straight down `train()`:
    read train_batch_size experiences (rank 0 claims them in the DB, the other ranks read the same ids)
    -> shard the batch over ranks (length-balanced) -> old log-probs (ref log-probs when a piece needs
    them, critic values for GAE) -> reward shaping and KL penalty -> advantages over the whole batch ->
    ppo_epochs x mini-batches x token-budget micro-batches of the value loss (critic), then of policy
    loss + KL loss + entropy loss (actor): gradient accumulation, grad clip, AdamW -> publish weights
    (checkpoint files or the process group)
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
- PPO: the critic is AutoModelForTokenClassification (one label) on the actor's architecture, as veRL's;
  each step updates the critic first, then the actor, on the same mini-batches. Advantages for every
  algorithm are computed here, in the trainer, on the whole batch (Trinity computes group advantages in
  the explorer); a DPO pair stays on one rank and in one micro-batch.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

import algos
import configs
import launch
import sync
from algos import overlong, value_loss
from algos.correction import rollout_is_weights
from algos.kl import adapt as kl_adapt, loss as kl_loss, penalty as kl_penalty, place_scores
from algos.sample import tied_groups
from algos.utils import masked_mean
from buffer import DataError, Experience, ExperienceDB, read_rows
from configs.schema import OptimizerConfig
from models import (collate, fingerprint, file_units, load_critic, load_model, load_tokenizer, micro_batches, pick, score,
                    token_logprobs, token_values)
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


def build_model(path: str, cfg: configs.Config, device: torch.device, trainable: bool, critic: bool = False) -> torch.nn.Module:
    """An HF causal LM (or, `critic`, the value model) sharded with FSDP2: each decoder layer, then the root."""
    t = cfg.trainer
    model = load_critic(path) if critic else load_model(path, dtype="float32", device="cpu")
    if trainable and (t.critic.gradient_checkpointing if critic else t.gradient_checkpointing):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    cuda = device.type == "cuda"
    # bf16 compute with fp32 master weights and fp32 gradient reduction on GPU; fp32 throughout on CPU.
    policy = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} if cuda else {}
    if cuda and (t.critic.param_offload if critic else t.param_offload if trainable else t.ref_param_offload):
        policy["offload_policy"] = CPUOffloadPolicy()
    for layer in model.model.layers:
        fully_shard(layer, **policy)
    fully_shard(model, **policy)  # NOTE: last, so tied embeddings / lm_head share one root group
    model.train(trainable)
    if not trainable:
        model.requires_grad_(False)
    return model


def lr_at(step: int, o: OptimizerConfig, total: int) -> float:
    """Learning rate for optimizer step `step` (1-based): linear warm-up, then constant or cosine."""
    warmup = o.lr_warmup_steps if o.lr_warmup_steps >= 0 else int(o.lr_warmup_steps_ratio * total)
    if step <= warmup:
        return o.lr * step / max(warmup, 1)
    if o.lr_scheduler_type == "cosine":
        progress = (step - warmup) / max(total - warmup, 1)
        return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))
    return o.lr


# --- reading experiences


class Source:
    """Where train batches come from: the experience DB (claims), or offline data files
    (`experience_buffer.storage_type: file`, schema_type sft or dpo) read in a seeded order per epoch.
    A sample strategy may add expert rows from an auxiliary buffer to each batch (mix).
    `ended` (rank 0): the DB will get no more experiences (every explorer that wrote to it finished)."""

    def __init__(self, cfg: configs.Config, tokenizer, rank: int, device: torch.device) -> None:
        self.cfg, self.rank, self.device, self.ended = cfg, rank, device, False
        eb, aux = cfg.buffer.trainer_input.experience_buffer, cfg.buffer.trainer_input.auxiliary_buffers
        self.units: list[list[Experience]] = []  # file data: one row's experiences (a DPO pair: chosen, rejected)
        self.expert: list[list[Experience]] = []  # the auxiliary buffer's rows (mix)
        self.expert_ratio, self.refills, self.dropped_groups = 0.0, False, 0
        self.paired = eb.storage_type == "file" and eb.schema_type == "dpo"
        if eb.storage_type == "file":
            self.units = file_units(eb, tokenizer, cfg.model.max_model_len)
            self.per_step = max(cfg.buffer.train_batch_size // len(self.units[0]), 1)  # rows (pairs) per step
            return
        self.db = ExperienceDB(eb.path)
        self.db.check_identity(fingerprint(cfg.model.model_path, tokenizer), "the trainer")
        a = cfg.algorithm
        self.strategy = lookup("sample_strategy", a.sample_strategy, a.sample_strategy_args)
        first = self.strategy[0](1, self.strategy[1])  # what the strategy asks of the reader (algos/sample.py)
        self.refills = "refill_rounds" in first
        expert = first.get("expert")  # (auxiliary buffer name, fraction of the batch)
        if expert:
            if expert[0] not in aux:
                raise DataError(f"algorithm.sample_strategy {a.sample_strategy} reads buffer.trainer_input.auxiliary_buffers."
                                f"{expert[0]}, which is not configured (have: {', '.join(aux) or 'none'})")
            self.expert, self.expert_ratio = file_units(aux[expert[0]], tokenizer, cfg.model.max_model_len), expert[1]
            for x in (x for unit in self.expert for x in unit):
                x.info["expert"] = True

    def total_steps(self) -> int:
        b = self.cfg.buffer
        if b.total_steps:
            return b.total_steps
        if self.units:
            return math.ceil(len(self.units) / self.per_step) * b.total_epochs
        tasks = sum(len(read_rows(ts.path, ts.subset_name, ts.split)) for ts in b.explorer_input.tasksets)
        return math.ceil(tasks * b.total_epochs * self.cfg.algorithm.repeat_times / b.train_batch_size)

    def read(self, step: int) -> list[Experience]:
        """The batch of train step `step`, identical on every rank; [] when none came (see `ended`)."""
        n = self.cfg.buffer.train_batch_size
        if self.units:  # a pure function of the step, so a resumed run continues exactly
            return pick(self.units, (step - 1) * self.per_step, self.per_step, "sft")
        # mix: expert rows on top of the train_batch_size RL experiences, `ratio` of the whole batch
        n_expert = round(n * self.expert_ratio / (1 - self.expert_ratio)) if self.expert else 0
        expert = pick(self.expert, (step - 1) * n_expert, n_expert, "expert")
        eb = self.cfg.buffer.trainer_input.experience_buffer
        ids = torch.zeros(n + 2, dtype=torch.long, device=self.device)  # [count, ended, ids...]
        if self.rank == 0:
            fn, strategy_cfg = self.strategy
            want = fn(step, strategy_cfg)
            claim = functools.partial(self.db.claim, step=step, timeout=eb.max_read_timeout, priority=eb.use_priority_queue,
                                      reuse_cooldown=eb.reuse_cooldown_time, decay=eb.priority_decay, partial=False,
                                      waiting=self.waiting(step), min_version=want.get("min_version", 0))
            got, self.dropped_groups = claim(n), 0
            for _ in range(want.get("refill_rounds", 0)):  # dynamic sampling: replace groups whose rewards tie
                tied = tied_groups([x.group_id or str(x.id) for x in got], [x.reward for x in got])
                kept = [x for x in got if (x.group_id or str(x.id)) not in tied]
                # NOTE: refills take what is already written and never wait: a synchronous explorer writes
                # the next step only after this one, so there the tied groups are just dropped.
                more = claim(len(got) - len(kept), timeout=0.0, partial=True) if tied else []
                if not tied or not kept + more:  # nothing to replace them with: keep them (zero advantage)
                    break
                self.dropped_groups += len(tied)
                got = kept + more
            ids[:2] = torch.tensor([len(got), self.ended])
            ids[2 : len(got) + 2] = torch.tensor([x.id for x in got], dtype=torch.long)
        dist.broadcast(ids, src=0)
        self.ended = bool(ids[1])
        got = got if self.rank == 0 else self.db.get(ids[2 : int(ids[0]) + 2].tolist())
        return got + expert if got else []

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


# --- batches


def gather_rows(rows: list[torch.Tensor], mine: list[int], B: int, T: int, device: torch.device) -> torch.Tensor:
    """[B,T] on every rank from each rank's 1-D rows (row k of this rank is batch row mine[k])."""
    out = torch.zeros(B, T, dtype=torch.float64, device=device)
    for k, i in enumerate(mine):
        out[i, : len(rows[k])] = rows[k].to(device)
    dist.all_reduce(out)
    return out.float().cpu()


# --- weights out: publish for the explorer, save a checkpoint, resume


# --- main


def lookup(kind: str, name: str, args: dict):
    """(function, validated Config) of an algos/ piece named in the config."""
    return algos.REGISTRIES[kind][name][0], algos.make_config(kind, name, args, f"algorithm.{kind}_args")


def reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """Sum over ranks of each number (an all-reduce of one small tensor)."""
    x = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(x)
    return x.tolist()


def update(model, optim, my: list[Experience], extra: dict, minis: list[list[list[int]]], loss_fn, mode: str,
           fixed: int | None, grad_clip: float, lr: float, prefix: str, cfg: configs.Config, device, world: int, step: int):
    """ppo_epochs x mini-batches (lists of units of `my`) x micro-batches (a token budget, or `fixed`
    sequences) of loss_fn(micro-batch) -> (loss, metrics): gradients accumulated with each micro-batch's share
    of the mini-batch's tokens (token-mean `mode`) or sequences, clipped, then one AdamW step at `lr` per
    mini-batch. Returns (this rank's metrics averaged over updates, gradient norms, skipped steps)."""
    t = cfg.trainer
    lengths, filler = [len(x.tokens) for x in my], next((u for m in minis for u in m), [0])
    sums: dict[str, float] = {}
    norms, skipped = [], 0
    for _ in range(t.ppo_epochs):
        for mini in minis:
            micro = micro_batches(lengths, t.max_token_len_per_gpu, fixed, mini) if mini else []
            counted = [collate(my, {}, m, torch.device("cpu"))["response_mask"] for m in micro]
            count = [float(c.sum()) if mode == "token-mean" else float(c.any(-1).sum()) for c in counted]
            (total_count,) = reduce_sum([sum(count)], device)
            # NOTE: every rank must run the same number of forward/backward passes (FSDP collectives):
            # ranks with fewer micro-batches run a repeat of one with weight 0.
            n_micro = int(max(reduce_max(len(micro), device), 1))
            if total_count == 0:  # every row of this mini-batch was filtered out, on every rank
                continue
            optim.zero_grad(set_to_none=True)
            for k in range(n_micro):
                idx, share = (micro[k], count[k] / total_count) if k < len(micro) else (filler, 0.0)
                loss, m = loss_fn(collate(my, extra, idx, device))
                # NOTE: FSDP averages gradients over ranks, hence x world: the sum over ranks and
                # micro-batches of share x loss is the loss of the whole mini-batch.
                (loss * share * world).backward()
                for key, v in m.items():
                    key = key if key.startswith("rollout_corr/") else prefix + key
                    sums[key] = sums.get(key, 0.0) + v * share / (t.ppo_epochs * len(minis))
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            norm = (norm.full_tensor() if isinstance(norm, DTensor) else norm).item()
            if not math.isfinite(norm):  # veRL skips such steps too
                log.warning("step %d: %sgradient norm is %s; optimizer step skipped", step, prefix, norm)
                skipped += 1
                continue
            norms.append(norm)
            for g in optim.param_groups:
                g["lr"] = lr
            optim.step()
    return sums, norms, skipped


def train(cfg: configs.Config) -> int:
    """Train one stage (mode train, or the trainer half of mode both); returns the exit code."""
    # --- setup: process group, model (+ reference, + critic), optimizers, the loss pieces, checkpoint to resume
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
    rl = a.advantage_fn != "none"  # offline losses (sft, dpo) need neither old log-probs nor advantages
    advantage_fn, advantage_cfg = lookup("advantage_fn", a.advantage_fn, a.advantage_fn_args) if rl else (None, None)
    policy_fn, policy_cfg = lookup("policy_loss_fn", a.policy_loss_fn, a.policy_loss_fn_args)
    entropy_fn, entropy_cfg = lookup("entropy_loss_fn", a.entropy_loss_fn, a.entropy_loss_fn_args)
    kl_cfgs = {k: algos.make_config(k, getattr(a, k), getattr(a, k + "_args"), f"algorithm.{k}_args")
               for k in ("kl_loss_fn", "kl_penalty_fn")}
    # A piece's Config may list batch keys it needs beyond the defaults (NEEDS): ref_logprobs, values.
    use_ref = a.kl_loss_fn != "none" or a.kl_penalty_fn != "none" or "ref_logprobs" in getattr(policy_cfg, "NEEDS", ())
    ref = build_model(cfg.model.model_path, cfg, device, trainable=False) if use_ref else None
    critic = critic_optim = None
    if rl and "values" in getattr(advantage_cfg, "NEEDS", ()):  # GAE (ppo): a value model trained beside the actor
        critic = build_model(str(sync.weights_path(job, resume).parent.parent / "critic" / "huggingface") if resume
                             else cfg.model.critic_model_path, cfg, device, trainable=True, critic=True)
        critic_optim = torch.optim.AdamW(critic.parameters(), lr=t.critic.lr, betas=tuple(a.optimizer.betas),
                                         weight_decay=t.critic.weight_decay)
        critic_opt = dataclasses.replace(a.optimizer, lr=t.critic.lr, lr_warmup_steps=-1, lr_scheduler_type="constant",
                                         lr_warmup_steps_ratio=t.critic.lr_warmup_steps_ratio)  # its lr schedule
    source = Source(cfg, tokenizer, rank, device)
    total = source.total_steps()
    state = {k: c.kl_coef for k, c in kl_cfgs.items()}  # the KL coefficients (adaptive ones change)
    if resume:
        saved_state = sync.load_checkpoint(model, optim, job, resume, rank, (critic, critic_optim) if critic else None)
        state |= {k: v for k, v in saved_state.items() if k in kl_cfgs and kl_cfgs[k].adaptive}  # the config's otherwise
        if rank == 0:
            sync.set_latest(job, resume)
            log.info("resumed from checkpoint step %d of %s", resume, job)
    if rank == 0 and not source.units:
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
        log.info("trainer: %d rank(s) on %s, steps %d..%d, %s + %s, reference model: %s, critic: %s, sync %s every %d "
                 "step(s)", world, device.type, resume + 1, total, a.advantage_fn, a.policy_loss_fn, ref is not None,
                 critic is not None, s.sync_method, s.sync_interval)

    def actor_loss(mb: dict) -> tuple[torch.Tensor, dict[str, float]]:
        """The actor's loss on one micro-batch: policy loss + KL loss + entropy term."""
        logp, ent = token_logprobs(model, mb, temperature, entropy=True)  # [B,T], [B,T]
        if rl and "old_logprobs" not in mb:
            mb["old_logprobs"] = logp.detach()  # [B,T] one update per step: ratio exactly 1 (see one_update)
        m = {}
        if "rollout_logprobs" in mb:  # truncated IS weights (rollout -> old policy) scale the advantages
            rc = a.rollout_correction
            w, m = rollout_is_weights(mb["old_logprobs"], mb["rollout_logprobs"],  # [B,T]
                                      mb["response_mask"] & (mb["has_rollout_logprobs"] > 0), rc.rollout_is, rc.rollout_is_threshold)
            mb["advantages"] = mb["advantages"] * w  # [B,T]
        loss, pm = policy_fn(logp, mb, policy_cfg, a.loss_agg_mode)  # []
        m |= pm
        if a.kl_loss_fn != "none":
            kl_cfg = dataclasses.replace(kl_cfgs["kl_loss_fn"], kl_coef=state["kl_loss_fn"])
            kl_term, km = kl_loss(logp, mb, kl_cfg, a.loss_agg_mode, a.kl_loss_fn)  # []
            loss, m = loss + kl_term, m | km
        ent_loss, em = entropy_fn(ent, mb, entropy_cfg, a.loss_agg_mode)  # []
        return loss + ent_loss.to(loss.device), m | em | {"entropy": masked_mean(ent.detach(), mb["response_mask"]).item()}

    def logprobs_of(m, mb: dict) -> torch.Tensor:
        return token_logprobs(m, mb, temperature, False)[0]  # [B,T] no entropy

    def critic_loss(mb: dict) -> tuple[torch.Tensor, dict[str, float]]:
        """The critic's clipped value loss on one micro-batch."""
        return value_loss.compute(token_values(critic, mb), mb, value_loss.Config(t.critic.cliprange_value), a.loss_agg_mode)

    code, done, saved = 0, resume, resume  # done: the last finished step; saved: the last checkpoint
    for step in range(resume + 1, total + 1):
        timing, t0 = {}, time.monotonic()
        # --- read the batch, shard it over ranks (longest units first, dealt round-robin: balanced tokens)
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
        # a unit stays together on one rank and in one micro-batch: a DPO pair (chosen, rejected), else one row
        units = [[i, i + 1] for i in range(0, len(exps), 2)] if source.paired else [[i] for i in range(len(exps))]
        if len(units) < world:
            raise RuntimeError(f"train step {step}: {len(exps)} experiences cannot be shared by {world} ranks")
        units.sort(key=lambda u: -max(len(exps[i].tokens) for i in u))
        mine, my_units = [], []  # this rank's rows (batch indices), and its units as indices into `my`
        for u in units[rank::world]:
            my_units.append(list(range(len(mine), len(mine) + len(u))))
            mine += u
        my = [exps[i] for i in mine]
        rl_rows = [i for i, x in enumerate(exps) if not x.info.get("expert")]  # mix: expert SFT rows have no reward
        extra: dict[str, list[torch.Tensor]] = {}
        metrics: dict[str, float] = {}
        if source.expert:
            extra["expert_mask"] = [torch.full((x.response_length,), float(x.info.get("expert", False))) for x in my]

        # --- old and reference log-probs, values
        t1 = time.monotonic()
        n_mini = max(1, round(len(exps) / t.ppo_mini_batch_size))
        # NOTE: with one update per step (one epoch, one mini-batch) the weights have not moved when a
        # micro-batch's loss is computed, so old log-probs = the current ones, detached: no extra pass.
        one_update = t.ppo_epochs == 1 and n_mini == 1 and a.kl_penalty_fn == "none"
        if rl and not one_update:
            extra["old_logprobs"] = score(model, my, cfg, device, logprobs_of)
        if rl and any(x.logprobs is not None for x in my):  # the rollout engine's, for the off-policy correction
            extra["rollout_logprobs"] = [x.logprobs if x.logprobs is not None else torch.zeros(x.response_length) for x in my]
            extra["has_rollout_logprobs"] = [torch.full((x.response_length,), float(x.logprobs is not None)) for x in my]
        if ref is not None:
            extra["ref_logprobs"] = score(ref, my, cfg, device, logprobs_of)
        if critic is not None:
            extra["values"] = score(critic, my, cfg, device, token_values)
        timing["time/old_ref_logprobs"] = time.monotonic() - t1

        # --- reward (shaped, with the KL penalty folded in) and advantages over the whole batch
        if rl:
            full = collate(exps, {}, list(range(len(exps))), torch.device("cpu"))
            B, T = full["response_mask"].shape
            scores = torch.tensor([x.reward for x in exps], dtype=torch.float32)  # [B]
            if a.overlong_reward.enable:  # DAPO's soft overlong punishment
                lengths = torch.tensor([float(x.response_length) for x in exps])  # [B]
                shaping = overlong.penalty(lengths, cfg.model.max_response_tokens, a.overlong_reward)  # [B]
                scores = scores + shaping  # [B]
                metrics["critic/overlong_penalty/mean"] = shaping[rl_rows].mean().item()
            token_rewards = place_scores(scores, full["response_mask"])  # [B,T] on the last valid token
            if a.kl_penalty_fn != "none":
                mb = collate(my, extra, list(range(len(my))), torch.device("cpu"))
                mb["rewards"] = scores[mine]  # [B_rank]
                kl_cfg = dataclasses.replace(kl_cfgs["kl_penalty_fn"], kl_coef=state["kl_penalty_fn"])
                penalised, kl_metrics = kl_penalty(mb, kl_cfg, a.kl_penalty_fn)  # [B_rank,T]
                token_rewards = gather_rows([penalised[k, : x.response_length] for k, x in enumerate(my)], mine, B, T, device)  # [B,T]
                metrics.update({f"critic/{k}": v for k, v in kl_metrics.items()})
            group = {g: i for i, g in enumerate(dict.fromkeys(exps[i].group_id or str(exps[i].id) for i in rl_rows))}
            batch = {"rewards": token_rewards.sum(-1)[rl_rows], "token_level_rewards": token_rewards[rl_rows],
                     "response_mask": full["response_mask"][rl_rows],
                     "group_index": torch.tensor([group[exps[i].group_id or str(exps[i].id)] for i in rl_rows])}
            if critic is not None:
                batch["values"] = gather_rows(extra["values"], mine, B, T, device)[rl_rows]  # [B_rl,T]
            adv, adv_metrics = advantage_fn(batch, advantage_cfg)
            advantages, returns = torch.zeros(B, T), torch.zeros(B, T)  # [B,T] expert rows keep 0
            advantages[rl_rows], returns[rl_rows] = adv["advantages"], adv["returns"]
            extra["advantages"] = [advantages[i, : exps[i].response_length] for i in mine]
            extra["returns"] = [returns[i, : exps[i].response_length] for i in mine]
            keep = torch.ones(B, dtype=torch.bool)  # [B]
            keep[rl_rows] = adv.get("keep", torch.ones(len(rl_rows), dtype=torch.bool))
            # Filtered groups (std_threshold) leave the loss: their rows keep their place (every rank
            # still runs the same passes) with an empty mask.
            my = [x if keep[i] else dataclasses.replace(x, action_mask=torch.zeros(x.response_length, dtype=torch.bool))
                  for x, i in zip(my, mine)]
            valid = batch["response_mask"]
            metrics.update({f"critic/{k}": v for k, v in adv_metrics.items()})
            metrics.update({"critic/score/mean": batch["rewards"].mean().item(), "critic/score/max": batch["rewards"].max().item(),
                            "critic/score/min": batch["rewards"].min().item(),
                            "critic/advantages/mean": adv["advantages"][valid].mean().item(),
                            "critic/advantages/max": adv["advantages"].max().item(),
                            "critic/advantages/min": adv["advantages"].min().item(),
                            "critic/returns/mean": adv["returns"][valid].mean().item()})
            if critic is not None:
                metrics["critic/values/mean"] = batch["values"][valid].mean().item()

        # --- update: the critic (ppo), then the actor: ppo_epochs x mini-batches x micro-batches
        t2 = time.monotonic()
        minis = [my_units[k::n_mini] for k in range(n_mini)]
        grad_norms, skipped, sums = [], 0, {}
        if critic is not None:
            fixed = None if t.use_dynamic_bsz else t.critic.micro_batch_size_per_gpu
            sums, critic_norms, _ = update(critic, critic_optim, my, extra, minis, critic_loss, a.loss_agg_mode, fixed,
                                           t.critic.grad_clip, lr_at(step, critic_opt, total), "critic/", cfg, device,
                                           world, step)
            sums |= {"critic/grad_norm": sum(critic_norms) / max(len(critic_norms), 1) / world,
                     "critic/lr": lr_at(step, critic_opt, total) / world}
        if critic is None or step > t.critic_warmup:  # critic_warmup: the first steps train the critic alone
            fixed = None if t.use_dynamic_bsz else t.micro_batch_size_per_gpu
            mode = getattr(policy_cfg, "AGG", a.loss_agg_mode)  # a loss with a fixed aggregation says so
            actor_sums, grad_norms, skipped = update(model, optim, my, extra, minis, actor_loss, mode, fixed, t.grad_clip,
                                                     lr_at(step, a.optimizer, total), "actor/", cfg, device, world, step)
            sums |= actor_sums
        keys = sorted(sums)
        metrics.update(zip(keys, reduce_sum([sums[k] for k in keys], device)))
        for k in ("kl_loss_fn", "kl_penalty_fn"):  # the adaptive KL controller (Ziegler et al.)
            measured = metrics.get({"kl_loss_fn": "actor/kl_loss", "kl_penalty_fn": "critic/kl"}[k])
            if kl_cfgs[k].adaptive and measured is not None:
                state[k] = kl_adapt(state[k], measured, len(exps), kl_cfgs[k])
                metrics[f"{'actor' if k == 'kl_loss_fn' else 'critic'}/kl_coef"] = state[k]
        timing["time/update"] = time.monotonic() - t2

        # --- sync: publish the new weights (files, or the process group) for the explorer
        t3 = time.monotonic()
        # NOTE: a fixed-style explorer asks for step s at its step s + sync_offset, so none asks for the last
        # sync_offset steps; a dynamic-style one may ask for any newer weights at any sync point.
        explorer_waits = step % s.sync_interval == 0 and (step + s.sync_offset < total or s.sync_style != "fixed")
        weights = None
        if rl and s.sync_method == "nccl" and explorer_waits:
            sync.send_model(sender, model, step)  # sender is None on ranks > 0
        if (explorer_waits and s.sync_method == "checkpoint") or step == total:
            weights = sync.full_state(model)
            if rank == 0:
                sync.publish_hf(model, tokenizer, job, step, state_dict=weights)
        timing["time/sync"] = time.monotonic() - t3
        # --- checkpoint
        t4 = time.monotonic()
        if (t.save_interval and step % t.save_interval == 0) or step == total:
            sync.save_checkpoint(model, optim, tokenizer, job, step, rank, weights, t.max_checkpoints_to_keep,
                                 (critic, critic_optim) if critic else None, state)
            saved = step
        timing["time/save_checkpoint"] = time.monotonic() - t4
        done = step

        # --- log
        timing["time/step"] = time.monotonic() - t0
        tokens = sum(len(x.tokens) for x in exps)
        lengths = [x.response_length for x in exps]
        metrics.update(timing)
        metrics.update({"actor/lr": lr_at(step, a.optimizer, total), "actor/grad_norm": sum(grad_norms) / max(len(grad_norms), 1),
                        "actor/skipped_steps": skipped, "response_length/mean": sum(lengths) / len(lengths),
                        "response_length/max": max(lengths), "prompt_length/mean": sum(x.prompt_length for x in exps) / len(exps),
                        "perf/total_num_tokens": tokens, "perf/throughput": tokens / timing["time/step"] / world,
                        "perf/train_tokens_per_s": tokens / max(timing["time/update"], 1e-9),
                        "batch/size": len(exps)})
        if rl:  # the weights versions that generated the batch, and how far behind version step - 1 they are
            versions = [exps[i].model_version for i in rl_rows]
            metrics.update({"sample/model_version/min": min(versions), "sample/model_version/max": max(versions),
                            "sample/model_version/mean": sum(versions) / len(versions),
                            "batch/staleness/mean": step - 1 - sum(versions) / len(versions),
                            "batch/staleness/max": step - 1 - min(versions)})
            for name in sorted({exps[i].explorer for i in rl_rows}):
                metrics[f"sample/experience_count/{name or 'unknown'}"] = sum(exps[i].explorer == name for i in rl_rows)
            if source.expert:
                metrics["sample/expert_count"] = len(exps) - len(rl_rows)
            if source.refills and rank == 0:
                metrics["sample/dropped_tied_groups"] = source.dropped_groups
        if monitor is not None:
            monitor.log(metrics, step=step)
        if rank == 0 and not source.units:
            set_status(source.db, step, "training")
    # --- the end: publish and save the last step unless done above (data ran out, or stopped waiting)
    if saved < done:
        weights = sync.full_state(model)
        if rank == 0:
            sync.publish_hf(model, tokenizer, job, done, state_dict=weights)
        sync.save_checkpoint(model, optim, tokenizer, job, done, rank, weights, t.max_checkpoints_to_keep,
                             (critic, critic_optim) if critic else None, state)
    if rank == 0 and not source.units:
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
