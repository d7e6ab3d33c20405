"""train.py: the trainer. Claims experiences from the experience DB (or reads SFT / DPO files), computes
log-probs, values, advantages and the loss with the pieces named in the config (algos/), steps an FSDP2
model (and critic), publishes weights for the explorer and saves checkpoints.

Launch lines:
    python train.py --config tiny.yaml                   # a whole experiment (mode both / stages): hands
                                                          # over to launch.py, which starts explorer + trainer
    python train.py --config tiny.yaml --mode train      # the trainer alone (one plain process)
    torchrun --standalone --nproc_per_node 2 train.py --config tiny.yaml --mode train   # FSDP2 on 2 ranks
    python train.py --config tiny.yaml --dry-run         # print the resolved config
    torchrun --nnodes 2 --node-rank 1 --nproc-per-node 8 --rdzv-backend static --rdzv-endpoint NODE0:29500 ...  # a node
        # of a cluster.node_num 2 run: the launcher on node 0 prints this line in full (launch.py)

One train step, straight down `train()`, a phase function each:
    read        train_batch_size experiences: rank 0 claims them in the DB, the other ranks read the same ids
    batch       the step batch, dense tensors built once (batching.step_batch) that every later phase reads and
                extends; cut into mini-batches (ppo_mini_batch_size), this rank's share of each as micro-batches of
                packed units
    score       old log-probs (not when the step makes one update: they are the current ones), reference
                log-probs, critic values; each summed over ranks, so that every rank holds the whole batch
    rewards     scores (+ DAPO's overlong shaping) on each response's last token, minus the KL penalty
    advantages  the advantage function over the whole batch
    update      ppo_epochs x mini-batches x micro-batches of the value loss (critic), then of the policy
                loss + KL loss + entropy term (actor): accumulated gradients, clipped, one AdamW step each
    publish     the weights for the explorer (checkpoint files or the process group) when one waits for them
    checkpoint  every save_interval steps
    log         metrics

Deviations from veRL / Trinity-RFT:
- Packing (trainer.use_remove_padding, on by default) lays each group's prompt out once, followed by each of
  its responses, with an attention mask that lets a response see the prompt and itself (batching.packed_inputs): the
  model runs on every distinct token once. veRL packs sequences but repeats a group's prompt n times. The
  micro-batch token budget counts packed tokens (veRL's default 16384 tokens per GPU).
- The learning rate is a function of the step (warm-up, then constant or cosine down to min_lr_ratio), set
  before each optimizer step; the scheduler has no state to save.
- Checkpoints are the HF folder plus the full optimizer state in safetensors (gathered on rank 0) instead of
  per-rank sharded .pt files; no pickle anywhere.
- A GRPO group split across two batches (possible only when an explorer drops a task) is normalised within
  each part.
- A step the explorers wrote short (dropped tasks) is trained on as it is, once they wait for its weights
  (source.py, sync.holds); an empty one makes no update and still publishes its (unchanged) weights, so that the
  train step numbers, and the versions the explorers wait for, never shift.
- PPO: the critic is AutoModelForTokenClassification (one label) on the actor's architecture, as veRL's; each
  step updates the critic first, then the actor, on the same mini-batches. Advantages for every algorithm are
  computed here, in the trainer, on the whole batch (Trinity computes group advantages in the explorer); a
  DPO pair stays on one rank and in one micro-batch. Except step_wise_grpo's: computed in the explorer over each
  whole group (a group's turns may be split between two train steps) and read back here.
- seq-mean-token-sum-norm divides by model.max_response_tokens (Dr.GRPO's constant), whatever the batch.
- LoRA (model.lora_configs): vLLM engines serve the adapter (the adapter alone at each sync), the HF engine gets
  merged weights; the reference is the base (lora.py).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import configs

# NOTE: --help answers here, before torch and the project's modules below are imported (~5 s): configs/ loads
# without them
if __name__ == "__main__":
    configs.answer_help(sys.argv[1:], __doc__)

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import algos
import checkpoint
import launch
import lease
import lora
import sync
import wire
from algos import overlong, value_loss
from algos.correction import rollout_is_weights, rollout_rs_mask
from algos.kl import adapt as kl_adapt
from algos.kl import loss as kl_loss
from algos.kl import penalty as kl_penalty
from algos.kl import place_scores
from algos.utils import masked_mean
from batching import micro_batch, micro_batches, mini_batches, pack_units, step_batch, unit_length
from buffer import Experience
from configs.schema import AlgorithmConfig, OptimizerConfig
from engines import engine_kind
from models import config_tokenizer, eos_ids, generation_config, torch_dtype
from monitor import Monitor, preview, score_metrics, timer
from scoring import TokenScorer, build_model, score, setup_distributed
from source import Source
from ulysses import SeqParallel

log = logging.getLogger("nanorft.train")


def lr_at(step: int, o: OptimizerConfig, total: int) -> float:
    """Learning rate for optimizer step `step` (1-based): linear warm-up, then constant or cosine."""
    warmup = o.lr_warmup_steps if o.lr_warmup_steps >= 0 else int(o.lr_warmup_steps_ratio * total)
    if step <= warmup:
        return o.lr * step / max(warmup, 1)
    if o.lr_scheduler_type == "cosine":
        progress = (step - warmup) / max(total - warmup, 1)
        return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))
    return o.lr


def lookup(kind: str, name: str, args: dict) -> tuple[Callable, Any]:
    """(function, validated Config) of an algos/ piece named in the config."""
    return algos.lookup(kind, name), configs.piece_config(kind, name, args)


# --- set-up: what every phase uses


@dataclasses.dataclass
class Parts:
    """What set-up builds; the step's phases read it (and the KL coefficients change)."""

    cfg: configs.Config
    rank: int
    world: int
    device: torch.device
    sp: SeqParallel | None  # this rank's sequence-parallel group (trainer.ulysses_sequence_parallel_size > 1)
    tokenizer: Any
    actor: TokenScorer  # the FSDP2 root around the HF model
    optim: torch.optim.Optimizer
    ref: TokenScorer | None  # the reference model, when a piece needs reference log-probs
    critic: TokenScorer | None  # the value model (GAE)
    critic_optim: torch.optim.Optimizer | None
    pieces: algos.Pieces  # algos/ kind -> (function, Config)
    kl_coef: dict[str, float]  # kl_loss_fn / kl_penalty_fn coefficients (adaptive ones change; checkpointed)
    source: Source
    total: int  # the last step
    resume: int  # the checkpoint step this run started from
    temperatures: dict[str, float]  # taskset name -> the temperature its rollouts were sampled at
    sender: wire.WeightLink | None  # process-group weight sync (rank 0)
    monitor: Monitor | None  # rank 0
    transfer: Any = None  # the trainer's side of vLLM engines' weight-transfer engine (every rank), at the first send
    skipped: int = 0  # train steps of this process whose actor made no optimizer step (actor/skipped_steps)

    @property
    def rl(self) -> bool:  # offline losses (sft, dpo) need neither old log-probs nor advantages
        return "advantage_fn" in self.pieces

    @property
    def engine_dtype(self) -> torch.dtype:  # the dtype the rollout engine runs in: weights are published in it
        return engine_dtype(self.cfg, self.device)

    def saves(self, step: int) -> bool:  # a checkpoint at `step`
        return bool(self.cfg.trainer.save_interval and step % self.cfg.trainer.save_interval == 0) or step == self.total

    @property
    def sp_size(self) -> int:  # ranks that split each micro-batch's columns (ulysses.py); 1 without
        return self.sp.size if self.sp is not None else 1

    @property
    def data_rank(self) -> int:  # this rank's data-parallel group: the ranks of one sequence-parallel group share it
        return self.rank // self.sp_size

    @property
    def data_world(self) -> int:  # data-parallel groups, among which the step's micro-batches are dealt
        return self.world // self.sp_size

    @property
    def share(self) -> bool:  # trainer.use_remove_padding: pack, each group's prompt laid out once
        return self.cfg.trainer.use_remove_padding


def engine_dtype(cfg: configs.Config, device: torch.device) -> torch.dtype:
    """The rollout engine's dtype, which weights are sent and published in: explorer.rollout_model.dtype on CUDA (a
    torch name after configs.derive: bf16 and auto are bfloat16 there), float32 on the CPU."""
    return torch_dtype(cfg.explorer.rollout_model.dtype) if device.type == "cuda" else torch.float32


def set_up(cfg: configs.Config) -> Parts | None:
    """Process group, models and optimizers, loss pieces, data source; resumes from the last checkpoint.
    None (after a message) when the run directory has checkpoints and continue_from_checkpoint is false."""
    rank, world, device = setup_distributed(launch.group_timeout(cfg))
    a, t, job = cfg.algorithm, cfg.trainer, Path(cfg.checkpoint_job_dir)
    monitor = Monitor(cfg, role=t.name) if rank == 0 else None  # first: log/<name>.log gets set-up's records too
    torch.manual_seed(cfg.explorer.rollout_model.seed + rank)
    resume = checkpoint.latest_checkpoint(job)
    if resume and not cfg.continue_from_checkpoint:  # launch.py renames the run in the other modes
        log.error(
            "%s already has checkpoint step %d and continue_from_checkpoint is false: set it true to resume, "
            "or choose another name (the explorer and trainer must share one)",
            job,
            resume,
        )
        if monitor is not None:
            monitor.close(failed=True)
        return None
    if resume:  # NOTE: before any model is built: another base model or algorithm is refused by name
        checkpoint.check_resume(job, resume, checkpoint.trained_with(cfg.model.model_path, a.algorithm_type))
    tokenizer = config_tokenizer(cfg.model)
    pieces = loss_pieces(a)
    actor, ref, critic = trainer_models(cfg, pieces, resume, device, tokenizer)
    source = Source(cfg, tokenizer, rank, device)
    if getattr(source, "db", None) is not None:  # rank 0 of a trainer reading the DB: one trainer per DB (lease.py)
        lease.hold(source.db, "trainer")
    p = Parts(
        cfg=cfg,
        rank=rank,
        world=world,
        device=device,
        sp=actor.sp,
        tokenizer=tokenizer,
        actor=actor,
        optim=adamw(actor, a.optimizer.lr, a.optimizer),
        ref=ref,
        critic=critic,
        critic_optim=adamw(critic, t.critic.lr, a.optimizer, t.critic.weight_decay) if critic else None,
        pieces=pieces,
        kl_coef={k: pieces[k][1].kl_coef for k in ("kl_loss_fn", "kl_penalty_fn")},
        source=source,
        total=source.total_steps(),
        resume=resume,
        temperatures={ts.name: ts.rollout_args.temperature or 1.0 for ts in cfg.buffer.explorer_input.tasksets},
        sender=None,
        monitor=monitor,
    )
    resume_state(p)
    if p.rl and cfg.synchronizer.sync_method == "nccl" and rank == 0:
        # NOTE: NCCL cannot join two ranks on one GPU: a colocated explorer gets the weights through host memory
        p.sender = wire.open_sender(
            job,
            "cpu" if cfg.cluster.colocate else device,
            cfg.synchronizer.sync_timeout,
            cfg.synchronizer.sync_host,
            p.resume,
        )  # a restarted explorer reads `resume`
    if rank == 0:
        log_set_up(p)
    return p


def loss_pieces(a: AlgorithmConfig) -> algos.Pieces:
    """The algos/ pieces the config names (advantage fn, policy loss, entropy, KL loss and penalty), each as
    (function, validated Config); no advantage fn for the offline losses (advantage_fn none)."""
    return {
        k: lookup(k, getattr(a, k), getattr(a, k + "_args"))
        for k in ("advantage_fn", "policy_loss_fn", "entropy_loss_fn", "kl_loss_fn", "kl_penalty_fn")
        if not (k == "advantage_fn" and a.advantage_fn == "none")
    }


def trainer_models(
    cfg: configs.Config, pieces: algos.Pieces, resume: int, device: torch.device, tokenizer: Any
) -> tuple[TokenScorer, TokenScorer | None, TokenScorer | None]:
    """The actor, the reference model (when a KL piece or a loss reads ref_logprobs) and the critic (when a piece
    reads values), each FSDP2-sharded; the actor and critic from checkpoint step `resume` when there is one (its
    model/ shards over the model the config names; a checkpoint of older code, its huggingface/ folders). The
    actor and reference mask the ids the engines stop on where the engines masked them (min_tokens:
    scoring.TokenScorer). All three split their micro-batches over one sequence-parallel group (ulysses.py), when
    trainer.ulysses_sequence_parallel_size asks for one."""
    a, t, job = cfg.algorithm, cfg.trainer, Path(cfg.checkpoint_job_dir)
    sp = SeqParallel.make(t.ulysses_sequence_parallel_size)
    eos = eos_ids(tokenizer, generation_config(cfg.model.model_path))
    adapter = lora.start(cfg, resume)  # LoRA: model.model_path + the checkpoint's, a saved or a new adapter
    saved = sync.weights_path(job, resume).parent  # the checkpoint's actor folder (when resuming)
    whole = resume and not (saved / checkpoint.MODEL_DIR).is_dir()  # older code's: the weights in huggingface/
    actor_path = str(saved / "huggingface") if whole and not adapter else cfg.model.model_path
    actor = build_model(actor_path, t, device, trainable=True, adapter=adapter, eos=eos, sp=sp)
    needs = piece_needs(pieces)
    use_ref = a.kl_loss_fn != "none" or a.kl_penalty_fn != "none" or "ref_logprobs" in needs
    critic_path = str(saved.parent / "critic" / "huggingface") if whole else cfg.model.critic_model_path
    critic = build_model(critic_path, t, device, trainable=True, critic=True, sp=sp) if "values" in needs else None
    if resume and not whole:  # NOTE: each rank reads the parts of the saved shards that it holds
        checkpoint.load_model_shards(actor, saved)
        if critic is not None:
            checkpoint.load_model_shards(critic, saved.parent / "critic")
    ref = (
        (lora.WithoutAdapter(actor) if adapter else build_model(cfg.model.model_path, t, device, False, eos=eos, sp=sp))
        if use_ref
        else None
    )  # with LoRA, the actor with its adapter switched off: the base model
    return actor, ref, critic


def piece_needs(pieces: algos.Pieces) -> set[str]:
    """The batch keys the pieces need beyond the defaults (their Config's NEEDS): ref_logprobs (a reference model),
    values (a critic), old_logprobs (scored before the advantages), teacher_logprobs (written by the explorer)."""
    return {k for fn, c in pieces.values() for k in getattr(c, "NEEDS", ())}


def log_set_up(p: Parts) -> None:
    """Rank 0's line saying what this trainer runs."""
    a, s, t = p.cfg.algorithm, p.cfg.synchronizer, p.cfg.trainer
    n_mini = n_mini_batches(p.cfg.buffer.train_batch_size, t.ppo_mini_batch_size, p.source.paired)
    log.info(
        "trainer: %d rank(s) on %s, steps %d..%d, %s + %s, reference model: %s, critic: %s, sync %s every "
        "%d step(s), packing: %s, %d rank(s) per micro-batch (sequence parallelism), %d optimizer step(s) per train "
        "step (ppo_epochs %d x %d mini-batch(es))",
        p.world,
        p.device.type,
        p.resume + 1,
        p.total,
        a.advantage_fn,
        a.policy_loss_fn,
        p.ref is not None,
        p.critic is not None,
        s.sync_method,
        s.sync_interval,
        "shared prompts" if p.share else "off (padded rows)",
        p.sp_size,
        t.ppo_epochs * n_mini,
        t.ppo_epochs,
        n_mini,
    )


def adamw(
    model: torch.nn.Module, lr: float, o: OptimizerConfig, weight_decay: float | None = None
) -> torch.optim.AdamW:
    """AdamW over the weights that train (a LoRA actor's: its adapter's alone)."""
    return torch.optim.AdamW(
        [q for q in model.parameters() if q.requires_grad],
        lr=lr,
        betas=tuple(o.betas),
        weight_decay=o.weight_decay if weight_decay is None else weight_decay,
    )


def resume_state(p: Parts) -> None:
    """Optimizer states, RNG and adaptive KL coefficients of the checkpoint the weights came from; rank 0 rewinds
    the published-weights pointer and gives back the DB claims of later steps."""
    job = p.cfg.checkpoint_job_dir
    if p.resume:
        critic = (p.critic, p.critic_optim) if p.critic else None
        saved = checkpoint.load_checkpoint(p.actor, p.optim, job_dir=job, step=p.resume, rank=p.rank, critic=critic)
        adaptive = {k for k in p.kl_coef if p.pieces[k][1].adaptive}  # the config's coefficient otherwise
        p.kl_coef |= {k: v for k, v in saved.items() if k in adaptive}
        with checkpoint.publishing(job, p.resume):  # LoRA: the merged weights first, where missing
            lora.rewind_pointer(p.actor, p.tokenizer, job, p.resume, sync.serves_adapter(p.cfg))
        if p.rank == 0:
            log.info("resumed from checkpoint step %d of %s", p.resume, job)
    if p.rank == 0 and not p.source.examples:
        # NOTE: also with no checkpoint yet: a trainer killed before its first save claimed steps 1, 2, ...
        if p.cfg.continue_from_checkpoint:
            log.info("%d experience claims of steps after %d released", p.source.db.release_after(p.resume), p.resume)
        p.source.db.set_trainer_status(p.resume, "training")


# --- one step's phases, in run order

LOSS_KEYS = (
    "old_logprobs",
    "ref_logprobs",
    "advantages",
    "returns",
    "values",
    "rollout_logprobs",
    "has_rollout_logprobs",
    "expert_mask",
    "rewards",
    "group_index",
    "step",
)  # step batch keys a loss may read


def make_batch(p: Parts, exps: list[Experience], step: int) -> tuple[dict, list[list[list[list[int]]]]]:
    """The step batch (batching.step_batch, and the train step as step [B]: mix_chord's schedule reads it), and this
    rank's share of it as a plan: mini-batches of the whole batch (n_mini_batches: ppo_mini_batch_size experiences
    each, over all ranks), each as this rank's micro-batches of units (lists of batch rows laid out together: a group
    sharing its prompt, a DPO pair)."""
    t, paired = p.cfg.trainer, p.source.paired
    budget = token_budget(p)
    batch = step_batch(exps, p.cfg.model.max_response_tokens, p.temperatures)
    batch["step"] = torch.full((len(exps),), step)  # [B]
    rows = list(range(len(exps)))
    if len(pack_units(batch, rows, False, budget, paired)) < p.data_world:
        raise RuntimeError(f"{len(exps)} experiences cannot be shared by {p.data_world} data-parallel ranks")
    units = pack_units(batch, rows, p.share, budget, paired)
    fixed = None if t.use_dynamic_bsz else t.micro_batch_size_per_gpu
    plan = []
    for k, mini in enumerate(mini_batches(units, n_mini_batches(len(exps), t.ppo_mini_batch_size, paired), paired)):
        if len(mini) < p.data_world:  # too few units for the ranks: share them out sequence by sequence (pairs whole)
            mini = pack_units(batch, [i for u in mini for i in u], False, budget, paired)
        mini.sort(key=lambda u: -unit_length(batch, u))  # dealt round-robin, largest first: balanced ranks
        # NOTE: dealt to data-parallel groups (the ranks of a sequence-parallel group run the same micro-batches), from
        # group k: not always group 0 first
        mine = [u for j, u in enumerate(mini) if (j + k) % p.data_world == p.data_rank]
        plan.append(micro_batches(batch, mine, budget, fixed))
    return batch, plan


def token_budget(p: Parts) -> int:
    """Packed tokens of one micro-batch: trainer.max_token_len_per_gpu, times the ranks of a sequence-parallel group
    (each holds 1/P of its columns), as veRL's ppo_max_token_len_per_gpu."""
    return p.cfg.trainer.max_token_len_per_gpu * p.sp_size


def n_mini_batches(rows: int, mini_batch_size: int, paired: bool = False) -> int:
    """Optimizer steps per epoch of a step of `rows` experiences: rows / ppo_mini_batch_size rounded, at least 1, at
    most one per experience (per pair)."""
    return min(max(1, round(rows / mini_batch_size)), max(rows // (2 if paired else 1), 1))


def all_sum(x: torch.Tensor, p: Parts) -> torch.Tensor:
    """Sum over ranks of a [B,T] tensor that each rank filled at its own rows (zeros elsewhere); the rows of a
    sequence-parallel group, which each of its ranks holds whole, counted once."""
    if p.world > 1:
        y = x.to(p.device, torch.float64)
        if p.rank % p.sp_size:
            y.zero_()
        dist.all_reduce(y)
        x = y.to("cpu", x.dtype)
    return x


def score_batch(p: Parts, batch: dict, plan: list, timing: dict[str, float]) -> None:
    """old_logprobs (when needed), ref_logprobs, values: [B,T] each, the same on every rank."""
    a, t = p.cfg.algorithm, p.cfg.trainer
    mine = [micro for mini in plan for micro in mini]
    if not t.use_dynamic_bsz:  # forward-only passes take log_prob_micro_batch_size_per_gpu sequences each
        units = [u for micro in mine for u in micro]
        mine = micro_batches(batch, units, token_budget(p), t.log_prob_micro_batch_size_per_gpu)
    # NOTE: FSDP's forward is a collective: every rank runs as many passes (a repeat of its own first micro-batch
    # writes the same values again)
    mine += [filler(plan)] * (int(reduce_max(len(mine), p.device)) - len(mine))
    # NOTE: with one update per step (one epoch, one mini-batch, no KL penalty reading them) the weights have
    # not moved when a micro-batch's loss is computed: old log-probs are the current ones, detached; no pass.
    # (unless a piece reads them before the update: on_policy_distill's advantages)
    one_update = t.ppo_epochs == 1 and len(plan) == 1 and a.kl_penalty_fn == "none"
    for key, model, wanted in (  # each pass timed (time/old_logprobs, ...: veRL's timing_s/old_log_prob, ...)
        ("old_logprobs", p.actor, p.rl and (not one_update or "old_logprobs" in piece_needs(p.pieces))),
        ("ref_logprobs", p.ref, p.ref is not None),
        ("values", p.critic, p.critic is not None),
    ):
        if wanted:
            with timer(timing, f"time/{key}"):
                batch[key] = all_sum(score(model, batch, mine, p.share, p.device), p)


def shape_rewards(p: Parts, batch: dict) -> dict[str, float]:
    """token_level_rewards [B,T]: each score (+ DAPO's overlong shaping) on its response's last token, minus
    kl_coef x KL(old, ref) on every token with a KL penalty."""
    if not p.rl:
        return {}
    a, metrics = p.cfg.algorithm, {}
    scores, rl = batch["rewards"], ~batch["expert"]  # [B], [B]
    if a.overlong_reward.enable:
        shaping = overlong.penalty(
            batch["response_lengths"].float(), p.cfg.model.max_response_tokens, a.overlong_reward
        )  # [B]
        scores = scores + shaping  # [B]
        metrics["critic/overlong_penalty/mean"] = shaping[rl].mean().item()
    batch["scores"] = scores  # [B] (veRL's token_level_scores, summed: critic/score/*)
    if a.kl_penalty_fn == "none":
        batch["token_level_rewards"] = place_scores(scores, batch["response_mask"])  # [B,T]
        batch["sequence_rewards"] = sequence_rewards(scores, batch)  # [B]
        return metrics
    kl_cfg = dataclasses.replace(p.pieces["kl_penalty_fn"][1], kl_coef=p.kl_coef["kl_penalty_fn"])
    inputs = {k: batch[k] for k in ("response_mask", "old_logprobs", "ref_logprobs")} | {"rewards": scores}
    batch["token_level_rewards"], kl_metrics = kl_penalty(inputs, kl_cfg, a.kl_penalty_fn)  # [B,T]
    batch["sequence_rewards"] = sequence_rewards(scores, batch)  # [B]
    if kl_cfg.adaptive:  # the next step's beta, from the KL measured now (veRL's apply_kl_penalty); logged: this one's
        p.kl_coef["kl_penalty_fn"] = kl_adapt(kl_cfg.kl_coef, kl_metrics["kl"], len(scores), kl_cfg)
    return metrics | {f"critic/{k}": v for k, v in kl_metrics.items()}


def sequence_rewards(scores: torch.Tensor, batch: dict) -> torch.Tensor:
    """Each response's whole reward [B]: the sum of its token-level rewards, or its score when its response_mask is
    empty. NOTE: a response with no action tokens (cut at max_tokens and masked: mask_truncated, DAPO's overlong
    filtering; a cut prompt) has no token to hold its score, and token_level_rewards.sum(-1) made its reward 0: its
    group's mean and std counted a 0 instead of its reward (a group of -0.1s with one unmasked response gave that one
    a non-zero advantage), and the trainer logged reward 0 where the explorer logged -0.1. Its reward still counts in
    its group; it has no tokens to train."""
    masked = ~batch["response_mask"].any(-1)  # [B] rows without one action token
    return batch["token_level_rewards"].sum(-1) + torch.where(masked, scores.to(torch.float32), 0.0)  # [B]


DISTILL_KEYS = ("old_logprobs", "teacher_logprobs", "has_teacher_logprobs")  # on_policy_distill, jsd


def compute_advantages(p: Parts, batch: dict) -> dict[str, float]:
    """advantages / returns [B,T] of the RL rows (expert rows keep 0); groups that the advantage function
    filters out (std_threshold) leave the loss: their rows keep their place with an empty response_mask."""
    if not p.rl:
        return {}
    fn, adv_cfg = p.pieces["advantage_fn"]
    rl = ~batch["expert"]  # [B]
    sub = {
        "token_level_rewards": batch["token_level_rewards"][rl],
        "response_mask": batch["response_mask"][rl],
        "group_index": batch["group_index"][rl].unique(return_inverse=True)[1],  # groups numbered 0..G-1
        "episode_index": batch["episode_index"][rl].unique(return_inverse=True)[1],  # episodes 0..E-1
        **{k: batch[k][rl] for k in DISTILL_KEYS + ("stored_advantages", "has_stored_advantages") if k in batch},
    }  # step_wise_grpo's stored advantages; the distillation advantage fns' log-probs
    sub["rewards"] = batch["sequence_rewards"][rl]  # [B_rl] masked rows' too (sequence_rewards)
    if "values" in batch:
        sub["values"] = batch["values"][rl]  # [B_rl,T]
    adv, adv_metrics = fn(sub, adv_cfg)
    if "stored_advantages" in sub:  # a reuse's rows (or step_wise_grpo's): the advantages stored at their first use
        has = sub["has_stored_advantages"][:, None]  # [B_rl,1]
        stored = sub["stored_advantages"] * sub["response_mask"]  # [B_rl,T]
        adv["advantages"] = torch.where(has, stored, adv["advantages"])  # [B_rl,T]
    batch["advantages"], batch["returns"] = (
        torch.zeros_like(batch["rollout_logprobs"]),
        torch.zeros_like(batch["rollout_logprobs"]),
    )
    batch["advantages"][rl], batch["returns"][rl] = adv["advantages"], adv["returns"]
    if "keep" in adv:
        rows = rl.nonzero()[:, 0][~adv["keep"]]  # [dropped]
        batch["response_mask"][rows] = False
    valid = sub["response_mask"]
    valid_adv = adv["advantages"][valid]  # [n] the response tokens' (veRL's max / min are over these only)
    metrics = {f"critic/{k}": v for k, v in adv_metrics.items()} | {
        **score_metrics(batch["scores"][rl], sub["rewards"], sub["group_index"]),
        "critic/advantages/mean": masked_mean(adv["advantages"], valid).item(),
        "critic/advantages/max": valid_adv.max().item() if valid_adv.numel() else 0.0,
        "critic/advantages/min": valid_adv.min().item() if valid_adv.numel() else 0.0,
        "critic/returns/mean": masked_mean(adv["returns"], valid).item(),
    }
    if "values" in sub:
        metrics["critic/values/mean"] = masked_mean(sub["values"], valid).item()
    return metrics


def actor_loss(p: Parts, mb: dict) -> tuple[torch.Tensor, dict[str, float]]:
    """The actor's loss on one micro-batch: policy loss + KL loss + entropy term."""
    a = p.cfg.algorithm
    (policy_fn, policy_cfg), (entropy_fn, entropy_cfg) = p.pieces["policy_loss_fn"], p.pieces["entropy_loss_fn"]
    logp, ent = p.actor(mb, entropy=True, entropy_grad=entropy_cfg.entropy_coef != 0)  # [n,T], [n,T]
    if p.rl and "old_logprobs" not in mb:
        mb["old_logprobs"] = logp.detach()  # [n,T] one update per step: ratio exactly 1 (score_batch)
    m = {}
    if p.rl and mb["has_rollout_logprobs"].any():  # truncated IS weights x the rejection mask scale the advantages
        rc, valid = a.rollout_correction, mb["response_mask"] & mb["has_rollout_logprobs"][:, None]  # [n,T]
        w, m = rollout_is_weights(
            mb["old_logprobs"], mb["rollout_logprobs"], valid, rc.rollout_is, rc.rollout_is_threshold
        )
        keep, rs = rollout_rs_mask(
            mb["old_logprobs"],
            mb["rollout_logprobs"],
            valid,
            rc.rollout_rs,
            rc.rollout_rs_threshold,
            rc.rollout_rs_threshold_lower,
        )
        mb["advantages"], m = mb["advantages"] * w * keep, m | rs  # [n,T]
    loss, pm = policy_fn(logp, mb, policy_cfg, a.loss_agg_mode)  # []
    m |= pm
    if a.kl_loss_fn != "none":
        kl_cfg = dataclasses.replace(p.pieces["kl_loss_fn"][1], kl_coef=p.kl_coef["kl_loss_fn"])
        kl_term, km = kl_loss(logp, mb, kl_cfg, a.loss_agg_mode, a.kl_loss_fn)  # []
        loss, m = loss + kl_term, m | km
    ent_loss, em = entropy_fn(ent, mb, entropy_cfg, a.loss_agg_mode)  # []
    return loss + ent_loss.to(loss.device), m | em | {"entropy": masked_mean(ent.detach(), mb["response_mask"]).item()}


def critic_loss(p: Parts, mb: dict) -> tuple[torch.Tensor, dict[str, float]]:
    """The critic's clipped value loss on one micro-batch."""
    values = p.critic(mb)[0]  # [n,T]
    return value_loss.compute(
        values, mb, value_loss.Config(p.cfg.trainer.critic.cliprange_value), p.cfg.algorithm.loss_agg_mode
    )


def update(p: Parts, batch: dict, plan: list, step: int) -> dict[str, float]:
    """The critic (when there is one), then the actor (after critic_warmup steps): see optimize(). Returns the
    metrics averaged over ranks and updates; the adaptive KL controllers take their step."""
    a, t = p.cfg.algorithm, p.cfg.trainer
    sums = update_critic(p, batch, plan, step) if p.critic is not None else {}
    norms, skipped = [], 0
    trains = p.critic is None or step > t.critic_warmup  # critic_warmup: the first steps train the critic alone
    if trains:
        actor_sums, norms, skipped = optimize(
            p,
            model=p.actor,
            optim=p.optim,
            batch=batch,
            plan=plan,
            loss_fn=actor_loss,
            # a loss with a fixed aggregation says so
            mode=getattr(p.pieces["policy_loss_fn"][1], "AGG", a.loss_agg_mode),
            lr=lr_at(step, a.optimizer, p.total),
            grad_clip=t.grad_clip,
            prefix="actor/",
            step=step,
        )
        sums |= actor_sums
    keys = sorted(sums)
    metrics = dict(zip(keys, reduce_sum([sums[k] for k in keys], p.device)))
    adapt_kl(p, metrics, len(batch["rewards"]))
    metrics |= {"actor/lr": lr_at(step, a.optimizer, p.total), "actor/nonfinite_grad_steps": skipped}
    if norms:  # NOTE: no optimizer step, no gradient norm (not 0: a 0 reads as a converged model)
        metrics["actor/grad_norm"] = sum(norms) / len(norms)
    return metrics | skip_metrics(p, trains and not norms)


def skip_metrics(p: Parts, skipped: bool) -> dict[str, float]:
    """actor/update_skipped (1: this step's actor made no optimizer step: nothing to train, no experiences, or every
    gradient norm not finite) and actor/skipped_steps (how many steps of this process did so far: a resumed trainer
    counts from its resume)."""
    p.skipped += skipped
    return {"actor/update_skipped": float(skipped), "actor/skipped_steps": p.skipped}


def nothing_to_train(p: Parts, exps: list[Experience], metrics: dict[str, float], step: int) -> None:
    """The line of a step whose actor made no optimizer step (update()'s actor/update_skipped), saying why: no
    experience had a token to train (each counted by its reason), or every gradient norm was not finite."""
    if p.rank != 0 or not metrics.get("actor/update_skipped"):
        return
    n = metrics["actor/skipped_steps"]
    if metrics.get("actor/nonfinite_grad_steps"):
        why = f"every optimizer step's gradient norm was not finite ({metrics['actor/nonfinite_grad_steps']:g})"
    else:
        why = f"none of its {len(exps)} experiences has a token to train: " + untrainable(p, exps)
    log.warning("train step %d: actor update skipped (actor/skipped_steps %d): %s", step, n, why)


def untrainable(p: Parts, exps: list[Experience]) -> str:
    """Why the experiences of a step have no token to train, counted: a cut prompt, a response cut at the token limit
    and masked (mask_truncated), no action tokens otherwise, or a group the advantage function filtered out."""
    reasons = {
        "prompt_truncated": "with a prompt cut to model.max_prompt_tokens",
        "masked": f"cut at the token limit (model.max_response_tokens {p.cfg.model.max_response_tokens}) and masked "
        "(the workflow's mask_truncated: DAPO's overlong filtering)",
        "no_action": "with no action tokens",
        "filtered": "in groups the advantage function filtered out (advantage_fn_args.std_threshold)",
    }
    counts = dict.fromkeys(reasons, 0)
    for x in exps:
        empty = x.action_mask is not None and not bool(x.action_mask.any())
        if x.truncate_status == "prompt_truncated":
            counts["prompt_truncated"] += 1
        elif empty:
            counts["masked" if x.truncate_status == "response_truncated" else "no_action"] += 1
        else:
            counts["filtered"] += 1
    return ", ".join(f"{n} {reasons[k]}" for k, n in counts.items() if n) + "; the weights stay as they were"


def update_critic(p: Parts, batch: dict, plan: list, step: int) -> dict[str, float]:
    """The critic's update over the actor's mini-batches (optimize()), at its own learning rate (constant after
    trainer.critic.lr_warmup_steps_ratio's warm-up); this rank's metrics, grad_norm and lr divided by the world
    size (update() sums them over ranks)."""
    a, t = p.cfg.algorithm, p.cfg.trainer
    schedule = dataclasses.replace(
        a.optimizer,
        lr=t.critic.lr,
        lr_warmup_steps=-1,
        lr_scheduler_type="constant",
        lr_warmup_steps_ratio=t.critic.lr_warmup_steps_ratio,
    )
    lr = lr_at(step, schedule, p.total)
    # the same mini-batches in micro-batches of the critic's own size (the update is exact whatever the cut)
    critic_plan = (
        plan
        if t.use_dynamic_bsz
        else [micro_batches(batch, [u for m in mini for u in m], 0, t.critic.micro_batch_size_per_gpu) for mini in plan]
    )
    sums, norms, _ = optimize(
        p,
        model=p.critic,
        optim=p.critic_optim,
        batch=batch,
        plan=critic_plan,
        loss_fn=critic_loss,
        mode=a.loss_agg_mode,
        lr=lr,
        grad_clip=t.critic.grad_clip,
        prefix="critic/",
        step=step,
    )
    return sums | {"critic/grad_norm": sum(norms) / max(len(norms), 1) / p.world, "critic/lr": lr / p.world}


def adapt_kl(p: Parts, metrics: dict[str, float], batch_size: int) -> None:
    """The adaptive KL loss controller's step (Ziegler et al.) on the KL loss measured this step; its new coefficient
    goes into p.kl_coef and the metrics. (The KL penalty's takes its step in shape_rewards, where it is measured.)"""
    measured = metrics.get("actor/kl_loss")
    if p.pieces["kl_loss_fn"][1].adaptive and measured is not None:
        p.kl_coef["kl_loss_fn"] = kl_adapt(p.kl_coef["kl_loss_fn"], measured, batch_size, p.pieces["kl_loss_fn"][1])
        metrics["actor/kl_coef"] = p.kl_coef["kl_loss_fn"]


def optimize(
    p: Parts,
    *,
    model: TokenScorer,
    optim: torch.optim.Optimizer,
    batch: dict,
    plan: list,
    loss_fn: Callable,
    mode: str,
    lr: float,
    grad_clip: float,
    prefix: str,
    step: int,
) -> tuple[dict[str, float], list[float], int]:
    """ppo_epochs x the plan's mini-batches x their micro-batches of loss_fn(p, micro-batch) -> (loss, metrics):
    gradients accumulated with each micro-batch's share of the mini-batch's tokens (token-mean `mode`) or of its
    sequences with tokens (the seq-mean modes), so that any cut (micro-batches, ranks) gives the gradient of the
    whole mini-batch; clipped, then one AdamW step at `lr`. Returns (this rank's metrics averaged over the updates
    (mini-batches with tokens), gradient norms, skipped steps)."""
    sums, norms, skipped, updates = {}, [], 0, 0
    keys = tuple(k for k in LOSS_KEYS if k in batch)
    for _ in range(p.cfg.trainer.ppo_epochs):
        for mini in plan:
            masks = [batch["response_mask"][[i for u in micro for i in u]] for micro in mini]  # [n,T] each
            count = [float(m.sum()) if mode == "token-mean" else float(m.any(-1).sum()) for m in masks]
            (total_count,) = reduce_sum([sum(count)], p.device)
            total_count /= p.sp_size  # NOTE: the ranks of a sequence-parallel group count the same micro-batches
            # NOTE: every rank must run the same number of forward/backward passes (FSDP collectives):
            # ranks with fewer micro-batches run a repeat of their first with weight 0.
            n_micro = int(max(reduce_max(len(mini), p.device), 1))
            if total_count == 0:  # every row of this mini-batch was filtered out, on every rank
                continue
            updates += 1
            optim.zero_grad(set_to_none=True)
            for k in range(n_micro):
                units, share = (mini[k], count[k] / total_count) if k < len(mini) else (filler(plan), 0.0)
                loss, m = loss_fn(p, micro_batch(batch, units, p.share, p.device, keys))
                # NOTE: FSDP averages gradients over ranks, hence x the data-parallel world: the sum over groups and
                # micro-batches of share x loss is the loss of the whole mini-batch. (The ranks of a sequence-parallel
                # group each hold the whole micro-batch's loss, and their gradients sum to P x its gradient: ulysses.py)
                (loss * share * p.data_world).backward()
                for key, v in m.items():
                    key = key if key.startswith("rollout_corr/") else prefix + key
                    sums[key] = sums.get(key, 0.0) + v * share / p.sp_size  # summed over all ranks by update()
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
    return {k: v / max(updates, 1) for k, v in sums.items()}, norms, skipped


def filler(plan: list) -> list[list[int]]:
    """A micro-batch for a rank that has run out of its own (any of its units; weighted 0)."""
    return next((micro for mini in plan for micro in mini), [[0]])


def reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """Sum over ranks of each number (an all-reduce of one small tensor)."""
    x = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(x)
    return x.tolist()


def reduce_max(value: float, device: torch.device) -> float:
    x = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return x.item()


def send(p: Parts, step: int) -> None:
    """The weights of `step` over the process group (every rank: gathering is a collective): a LoRA adapter alone to
    vLLM engines that serve it (lora.send_adapter, with wire.py: the explorer writes it as a folder its engines load);
    else the full weights (LoRA merged) to vLLM engines through the trainer's side of their weight-transfer engine
    (weight_transfer.trainer_engine, built by vLLM's trainer factory at the first transfer), to the HF engine with
    wire.py itself (it needs no vLLM)."""
    if sync.serves_adapter(p.cfg):
        lora.send_adapter(p.sender, p.actor, step, p.engine_dtype)  # sender is None on ranks > 0
        return
    if engine_kind(p.cfg.explorer.rollout_model)[0] == "hf":
        lora.send_model(p.sender, p.actor, step, p.engine_dtype)
        return
    import vllm_engine
    import weight_transfer

    if p.transfer is None:
        backend = vllm_engine.weight_backend(torch.cuda.is_available(), p.cfg.cluster.colocate)
        source = weight_transfer.SpecSource(lambda: lora.weight_stream(p.actor, p.engine_dtype))
        p.transfer = weight_transfer.trainer_engine(backend, p.sender, p.rank, source, p.cfg.synchronizer)
    if p.sender is not None:
        p.transfer.client.version = step
    with torch.no_grad():
        p.transfer.send_weights()


def publish(p: Parts, step: int) -> dict[str, torch.Tensor] | None:
    """The weights of `step` for the explorer when one will wait for them (sync.publishes): sent over the process
    group, or written as the step's published folder (`publish_files`); the last step's always as an HF folder.
    Returns the full state it gathered (rank 0; {} elsewhere), which the checkpoint then reuses, or None."""
    s = p.cfg.synchronizer
    wanted = p.rl and sync.publishes(step, p.cfg, p.total)  # no explorer waits for an offline stage's weights
    if s.sync_method == "nccl" and wanted:
        send(p, step)
    if (wanted and s.sync_method == "checkpoint") or step == p.total:
        return publish_files(p, step, hf=step == p.total, exact=p.saves(step))
    return None


def publish_files(p: Parts, step: int, hf: bool, exact: bool) -> dict[str, torch.Tensor] | None:
    """Step `step`'s published folder (lora.publish, the pointer moved after it): the LoRA adapter alone for vLLM
    engines that serve it (sync.serves_adapter), plus the full HF folder (merged) where `hf` asks (the last step:
    the next stage, bench mode and users read it); else the full HF folder. In the engine's dtype (bf16 on GPU by
    default: half the bytes of the fp32 master weights), except an HF folder that is also a checkpoint's weights
    (`exact`, fp32: a resume continues from the exact weights). Returns the full state gathered (rank 0; {}
    elsewhere), or None (the adapter alone). Every rank calls it (gathering is a collective)."""
    served = sync.serves_adapter(p.cfg)
    adapter = lora.adapter_state(p.actor) if served else None
    weights = lora.full_state(p.actor) if hf or not served else None
    if p.rank == 0:
        folder = weights if weights is None or exact else sync.cast(weights, p.engine_dtype)
        adapter = None if adapter is None else sync.cast(adapter, p.engine_dtype)
        with checkpoint.publishing(p.cfg.checkpoint_job_dir, step):
            lora.publish(p.actor, p.tokenizer, p.cfg.checkpoint_job_dir, step, adapter, folder)
    return weights


def save(p: Parts, step: int, weights: dict[str, torch.Tensor] | None) -> None:
    """The checkpoint of `step`: weights, optimizer states, RNG, KL coefficients (checkpoint.save_checkpoint)."""
    checkpoint.save_checkpoint(
        p.actor,
        p.optim,
        tokenizer=p.tokenizer,
        job_dir=p.cfg.checkpoint_job_dir,
        step=step,
        rank=p.rank,
        weights=weights,
        keep=p.cfg.trainer.max_checkpoints_to_keep,
        critic=(p.critic, p.critic_optim) if p.critic else None,
        state=p.kl_coef,
        trained_with=checkpoint.trained_with(p.cfg.model.model_path, p.cfg.algorithm.algorithm_type),
        hf=p.cfg.trainer.save_hf_checkpoint == "always",
    )
    sync.pause_for_test("train.after_save", step)


def log_step(p: Parts, exps: list[Experience], batch: dict, metrics: dict[str, float], step: int) -> None:
    """The step's batch statistics and throughput, to the monitor (rank 0); the trainer's status to the DB."""
    tokens, lengths = sum(len(x.tokens) for x in exps), batch["response_lengths"].float()
    metrics |= {
        "response_length/mean": lengths.mean().item(),
        "response_length/max": lengths.max().item(),
        "response_length/min": lengths.min().item(),
        "response_length/clip_ratio": sum(x.truncate_status == "response_truncated" for x in exps) / len(exps),
        "prompt_length/mean": batch["prompt_lengths"].float().mean().item(),
        "batch/size": len(exps),
        "perf/total_num_tokens": tokens,
        "perf/throughput": tokens / metrics["time/step"] / p.world,
        "perf/train_tokens_per_s": tokens / max(metrics["time/update"], 1e-9),
    }
    rl = [x for x in exps if not x.info.get("expert")]
    metrics |= preview(rl) if p.cfg.trainer.enable_preview and p.rank == 0 else {}
    if p.rl:  # the weights versions that generated the batch, and how far behind version step - 1 they are
        versions = [x.model_version for x in rl]
        metrics |= {
            "sample/model_version/min": min(versions),
            "sample/model_version/max": max(versions),
            "sample/model_version/mean": sum(versions) / len(versions),
            "batch/staleness/mean": step - 1 - sum(versions) / len(versions),
            "batch/staleness/max": step - 1 - min(versions),
        }
        for name in sorted({x.explorer for x in rl}):
            metrics[f"sample/experience_count/{name or 'unknown'}"] = sum(x.explorer == name for x in rl)
        if p.source.expert:
            metrics["sample/expert_count"] = len(exps) - len(rl)
        if p.source.refills and p.rank == 0:
            metrics["sample/dropped_tied_groups"] = p.source.dropped_groups
    if p.monitor is not None:
        p.monitor.log(metrics, step=step)
    if p.rank == 0 and not p.source.examples:
        p.source.db.set_trainer_status(step, "training")


def log_empty_step(p: Parts, metrics: dict[str, float], step: int) -> None:
    """An empty step (every task of its explorer step dropped): no update, and the step still counts, its weights
    published as they are (publish), so that the explorer waiting for them goes on. Logged as batch/size 0 and a
    skipped update (skip_metrics)."""
    metrics |= skip_metrics(p, True)
    if p.rank == 0:
        log.warning(
            "train step %d: actor update skipped (actor/skipped_steps %d): no experiences were written for it; its "
            "weights published unchanged",
            step,
            metrics["actor/skipped_steps"],
        )
    if p.monitor is not None:
        p.monitor.log(metrics | {"batch/size": 0}, step=step)
    if p.rank == 0 and not p.source.examples:
        p.source.db.set_trainer_status(step, "training")


def no_batch(p: Parts, step: int, done: int) -> int:
    """Why no batch came for `step` (the explorers finished: exit 0; max_read_timeout: exit 1)."""
    if p.source.ended:
        if p.rank == 0:
            log.info(
                "every explorer writing to the experience DB has finished and no experiences are left: "
                "training ends after step %d of %d",
                done,
                p.total,
            )
        return 0
    if p.rank == 0:
        log.error(
            "no full batch for train step %d after %g s "
            "(buffer.trainer_input.experience_buffer.max_read_timeout);"
            " explorers: %s. Stopping; a restart continues after checkpoint step %d.",
            step,
            p.cfg.buffer.trainer_input.experience_buffer.max_read_timeout,
            p.source.explorers(),
            done,
        )
    return 1


def finish(p: Parts, done: int, saved: int, code: int) -> int:
    """Publish and save the last finished step unless done (data ran out, or stopped waiting); close up."""
    if saved < done:
        weights = publish_files(p, done, hf=True, exact=True)
        save(p, done, weights)
    if p.rank == 0 and not p.source.examples:
        p.source.db.set_trainer_status(done, "stopped" if code else "finished")
        lease.release(p.source.db)  # another trainer may start now
    if p.transfer is not None:
        p.transfer.shutdown()
    if p.sender is not None:
        wire.close_sender(p.sender, finished=code == 0)
    if p.monitor is not None:
        p.monitor.close(failed=code != 0)
    dist.destroy_process_group()
    return code


# --- main


def train(cfg: configs.Config) -> int:
    """Train one stage (mode train, or the trainer half of mode both); returns the exit code."""
    p = set_up(cfg)
    if p is None:
        return 2
    code, done, saved = 0, p.resume, p.resume  # done: the last finished step; saved: the last checkpoint
    for step in range(p.resume + 1, p.total + 1):
        timing: dict[str, float] = {}
        with timer(timing, "time/step"):
            # --- read
            with timer(timing, "time/read"):
                exps = p.source.read(step)
            sync.pause_for_test("train.after_read", step)  # tests: a kill here, the step's batch claimed
            if not exps and not p.source.short:
                code = no_batch(p, step, done)
                break
            batch, metrics = None, {"batch/short": float(p.source.short)} if p.rl else {}
            if exps:  # NOTE: else an empty step: the explorers wrote nothing for it and wait for its weights
                # --- batch: built once; this rank's share as mini-batches of micro-batches
                batch, plan = make_batch(p, exps, step)
                # --- score: old and reference log-probs, values
                with timer(timing, "time/old_ref_logprobs"):
                    score_batch(p, batch, plan, timing)
                # --- rewards, advantages
                with timer(timing, "time/adv"):
                    metrics |= shape_rewards(p, batch) | compute_advantages(p, batch)
                p.source.keep_advantages(exps, batch.get("advantages"), step)  # replay: for their reuses
                with timer(timing, "time/keep_trained"):
                    p.source.keep_trained(exps, batch, step)  # the per-token numbers, for the studio's viewer
                # --- update
                with timer(timing, "time/update"):
                    metrics |= update(p, batch, plan, step)
                nothing_to_train(p, exps, metrics, step)
            # --- publish the weights for the explorer, then checkpoint
            with timer(timing, "time/sync"):
                weights = publish(p, step)
            with timer(timing, "time/save_checkpoint"):
                if p.saves(step):
                    save(p, step, weights)
                    saved = step
            done = step
        # --- log
        if batch is None:
            log_empty_step(p, metrics | timing, step)
        else:
            log_step(p, exps, batch, metrics | timing, step)
    return finish(p, done, saved, code)


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
