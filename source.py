"""source.py: where the trainer's batches come from: the experience DB, or offline SFT / DPO data files.

    source = Source(cfg, tokenizer, rank, device)
    exps = source.read(step)      # train_batch_size experiences, the same on every rank; [] if none came
    source.ended                  # True once every explorer writing to the DB has finished
    source.short                  # this step's batch is what the explorers wrote for it: fewer, or none
    exp = sft_experience(messages, tokenizer, max_len=256)  # one SFT conversation as token ids + loss mask

From the DB, rank 0 claims the batch (waiting for it, with a log line every 30 s and the explorers' states)
and sends it to the other ranks over the process group: only rank 0 opens the DB. A step whose explorers wrote
fewer experiences than train_batch_size (dropped tasks) is taken partial, or empty, once every explorer has reached
the sync point that waits for this step's weights, as it records in the DB (sync.holds): never guessed from counts,
never after max_read_timeout. The sample strategy
(algos/sample.py) says what a step's claim wants: a staleness bound (min_version), dynamic-sampling refills of
groups whose rewards tie, expert rows from an auxiliary file (mix). The priority queue and dynamic sampling claim
whole groups; with reuse, the advantages of each experience's first use are stored for its reuses
(keep_advantages). File data (schema_type sft or dpo) is tokenized here, each row of the file an example: one
conversation rendered with the chat template, the loss on its assistant turn(s) (sft_experience), or a DPO pair,
chosen then rejected (dpo_experiences). Examples are read in a seeded order per epoch, a pure function of the step,
so that a resumed run continues exactly.
"""

from __future__ import annotations

import functools
import logging
import math
import random
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from transformers import PreTrainedTokenizerBase

import algos
import configs
import sync
from algos.sample import tied_groups
from buffer import Experience, ExperienceDB, deserialise_many, serialise_many
from chat_template import chat_ids
from configs.resolve import advantage_origin
from configs.schema import ExperienceBufferConfig
from errors import DataError
from models import fingerprint, with_template
from tasksets import format_row, read_rows, total_steps

log = logging.getLogger("nanorft.train")


# --- offline data (SFT / DPO files) as experiences


def render(tokenizer: PreTrainedTokenizerBase, messages: list[dict], generation_prompt: bool = False) -> list[int]:
    """The token ids of `messages` in the tokenizer's chat template (and the assistant's header: generation_prompt),
    the file's text tokenised as text: a row holding `<|im_end|>` trains on those characters, never on an EOS
    (chat_template.chat_ids)."""
    return chat_ids(tokenizer, messages, generation=generation_prompt)[1]


def sft_experience(
    messages: list[dict], tokenizer: PreTrainedTokenizerBase, max_len: int, multi_turn: bool = False
) -> Experience:
    """One conversation as an Experience for SFT (or one side of a DPO pair): the chat-templated tokens,
    with the loss on the last assistant turn up to and including its end-of-turn token, or on every
    assistant turn (`multi_turn`, Trinity's enable_concatenated_multi_turn). The prompt is everything
    before the first trained turn; tokens between trained turns (user turns) are masked out."""
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    turns = turns if multi_turn else turns[-1:]
    full = render(tokenizer, messages)
    spans = []
    for i in turns:
        before, upto = render(tokenizer, messages[:i], True), render(tokenizer, messages[: i + 1])
        start = len(before)
        if full[: len(upto)] != upto or upto[:start] != before:
            raise DataError("the chat template renders a conversation's prefix differently from the whole conversation")
        turn = upto[start:]
        if tokenizer.eos_token_id in turn:  # drop what the template adds after the end of the turn
            turn = turn[: turn.index(tokenizer.eos_token_id) + 1]
        spans.append((start, start + len(turn)))
    tokens = torch.tensor(full[: min(spans[-1][1], max_len)], dtype=torch.long)  # [L]
    prompt = min(spans[0][0], max_len - 1, len(tokens) - 1)
    mask = torch.zeros(len(tokens), dtype=torch.bool)  # [L]
    for start, end in spans:
        mask[start:end] = True
    return Experience(tokens=tokens, prompt_length=prompt, action_mask=mask[prompt:], reward=0.0)


def dpo_experiences(row: dict, tokenizer: PreTrainedTokenizerBase, max_len: int, pair: str) -> list[Experience]:
    """A DPO row (prompt messages, chosen, rejected: strings or assistant message lists) as two
    Experiences, chosen first, sharing group_id `pair` (the trainer keeps the two together, in order)."""
    out = []
    for run_id, key in enumerate(("chosen", "rejected")):
        answer = row[key] if isinstance(row[key], list) else [{"role": "assistant", "content": str(row[key])}]
        exp = sft_experience(row["messages"] + answer, tokenizer, max_len)
        exp.group_id, exp.run_id = pair, run_id
        out.append(exp)
    return out


def file_examples(eb: ExperienceBufferConfig, tokenizer, max_len: int) -> list[list[Experience]]:
    """An SFT or DPO data file as examples, one per row: [one experience] per SFT conversation, [chosen, rejected]
    per pair."""
    if eb.schema_type not in ("sft", "dpo"):
        raise DataError(
            f"buffer {eb.name}: a file buffer for the trainer needs schema_type sft or dpo, got {eb.schema_type!r}"
        )
    examples, tokenizer = [], with_template(tokenizer, eb.format.chat_template)
    for _, n, row in read_rows(eb.path, eb.subset_name, eb.split):
        f = format_row(row, eb.format, f"{eb.path}: row {n}", kind=eb.schema_type)
        examples.append(
            dpo_experiences(f, tokenizer, max_len, f"pair/{n}")
            if eb.schema_type == "dpo"
            else [sft_experience(f["messages"], tokenizer, max_len, eb.format.enable_concatenated_multi_turn)]
        )
    if not examples:
        raise DataError(f"buffer {eb.name}: {eb.path} has no rows")
    return examples


@functools.lru_cache(maxsize=4)
def epoch_order(tag: str, epoch: int, n: int) -> list[int]:
    """The seeded order of n examples in one epoch (tag/epoch seeds it). NOTE: cached: every step reads its batch from
    the same epoch's order, and drawing it (a permutation of the whole file) per example read took a quarter of the
    embedded default's SFT step (docs/LOG.md)."""
    return random.Random(f"{tag}/{epoch}").sample(range(n), n)


def pick(examples: list[list[Experience]], first: int, count: int, tag: str) -> list[Experience]:
    """The experiences of examples first .. first + count - 1 of a seeded order of `examples` per epoch
    (epoch_order)."""
    n = len(examples)
    positions = [divmod(pos, n) for pos in range(first, first + count)] if examples else []  # (epoch, index)
    return [x for e, i in positions for x in examples[epoch_order(tag, e, n)[i]]]


# --- the source of the trainer's batches


class Source:
    """Where train batches come from: the experience DB (claims), or offline data files
    (`experience_buffer.storage_type: file`, schema_type sft or dpo) read in a seeded order per epoch.
    A sample strategy may add expert rows from an auxiliary buffer to each batch (mix).
    `ended` (rank 0): the DB will get no more experiences (every explorer that wrote to it finished)."""

    def __init__(self, cfg: configs.Config, tokenizer, rank: int, device: torch.device) -> None:
        self.cfg, self.rank, self.device, self.ended, self.short = cfg, rank, device, False, False
        self.waits = sync.WaitNotes()  # how long the trainer's waits for experiences usually are (their log lines)
        eb, aux = cfg.buffer.trainer_input.experience_buffer, cfg.buffer.trainer_input.auxiliary_buffers
        self.examples: list[list[Experience]] = []  # file data: one row's experiences (a DPO pair: chosen, rejected)
        self.expert: list[list[Experience]] = []  # the auxiliary buffer's examples (mix)
        self.expert_ratio, self.refills, self.dropped_groups = 0.0, False, 0
        # replay (reuse on): the advantages of an experience's first use are stored for its reuses
        self.replays = (
            eb.use_priority_queue
            and eb.reuse_cooldown_time is not None
            and cfg.algorithm.advantage_fn not in ("none", *algos.EXPLORER_ADVANTAGE_FNS)
        )
        self.paired = eb.storage_type == "file" and eb.schema_type == "dpo"
        if eb.storage_type == "file":
            self.examples = file_examples(eb, tokenizer, cfg.model.max_model_len)
            self.per_step = max(cfg.buffer.train_batch_size // len(self.examples[0]), 1)  # examples (pairs) per step
            return
        self.db: ExperienceDB | None = None  # NOTE: rank 0 only; the other ranks get each batch from it
        if rank == 0:
            self.db = ExperienceDB(eb.path)
            self.db.check_identity(fingerprint(cfg.model.model_path, tokenizer), "the trainer")
            if cfg.algorithm.advantage_fn != "none":  # an RL trainer (sft / dpo from a DB read no advantages)
                self.db.check_advantages(advantage_origin(cfg.algorithm), "the trainer")
        a = cfg.algorithm
        self.strategy = (
            algos.lookup("sample_strategy", a.sample_strategy),
            configs.piece_config("sample_strategy", a.sample_strategy, a.sample_strategy_args),
        )
        first = self.strategy[0](1, self.strategy[1])  # what the strategy asks of the reader (algos/sample.py)
        self.refills = "refill_rounds" in first
        expert = first.get("expert")  # (auxiliary buffer name, fraction of the batch)
        if expert:
            if expert[0] not in aux:
                raise DataError(
                    f"algorithm.sample_strategy {a.sample_strategy} reads "
                    f"buffer.trainer_input.auxiliary_buffers.{expert[0]}, which is not configured "
                    f"(have: {', '.join(aux) or 'none'})"
                )
            self.expert = file_examples(aux[expert[0]], tokenizer, cfg.model.max_model_len)
            self.expert_ratio = expert[1]
            for x in (x for example in self.expert for x in example):
                x.info["expert"] = True

    def total_steps(self) -> int:
        b = self.cfg.buffer
        if b.total_steps:
            return b.total_steps
        if self.examples:
            return math.ceil(len(self.examples) / self.per_step) * b.total_epochs
        tasks = sum(len(read_rows(ts.path, ts.subset_name, ts.split)) for ts in b.explorer_input.tasksets)
        return total_steps(b, tasks, per_task=self.cfg.algorithm.repeat_times, per_step=b.train_batch_size)

    def read(self, step: int) -> list[Experience]:
        """The batch of train step `step`, identical on every rank; [] when none came (see `ended`, `short`)."""
        n = self.cfg.buffer.train_batch_size
        if self.examples:  # a pure function of the step, so a resumed run continues exactly
            return pick(self.examples, (step - 1) * self.per_step, self.per_step, "sft")
        # mix: expert rows on top of the train_batch_size RL experiences, `ratio` of the whole batch
        n_expert = round(n * self.expert_ratio / (1 - self.expert_ratio)) if self.expert else 0
        expert = pick(self.expert, (step - 1) * n_expert, n_expert, "expert")
        self.short = False
        got = self.fit_ranks(self.claim(step, n), step) if self.rank == 0 else []
        got = self.share(got)
        self.check_advantages(got)
        return got + expert if got else []

    def fit_ranks(self, got: list[Experience], step: int) -> list[Experience]:
        """Rank 0: a short step's batch of fewer experiences than trainer ranks cannot be shared out (each rank needs
        one): its claims are given back (pending again, for the next step) and the step is empty."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        if not (self.short and 0 < len(got) < world):
            return got
        log.warning(
            "train step %d: %d experience(s) for %d ranks: given back for the next step; this step is empty",
            step,
            len(got),
            world,
        )
        self.db.release_after(step - 1)
        return []

    def check_advantages(self, got: list[Experience]) -> None:
        """With an advantage fn computed in the explorer (step_wise_grpo), every experience must carry its advantages:
        a DataError naming the explorers of those without (their configs have another advantage_fn), on every rank.
        NOTE: the DB's record (ExperienceDB.check_advantages) refuses such an explorer at start; this catches what
        came before it (a DB of an earlier nanorft, rows written without an explorer)."""
        a = self.cfg.algorithm
        if a.advantage_fn in algos.EXPLORER_ADVANTAGE_FNS and (bad := [x for x in got if x.advantages is None]):
            who = ", ".join(sorted({x.explorer or "(unnamed)" for x in bad}))
            raise DataError(
                f"{len(bad)} of {len(got)} experiences carry no advantages, which algorithm.advantage_fn "
                f"{a.advantage_fn} computes in the explorer (batching.group_advantages): explorer(s) {who} "
                f"wrote them with another advantage_fn; give them {a.advantage_fn} too"
            )

    def keep_advantages(self, exps: list[Experience], advantages: torch.Tensor | None, step: int) -> None:
        """Replay (rank 0, reuse on): the advantages [B,T] step `step` computed for the batch's first uses (rows
        without stored ones), stored in the DB for their reuses (ExperienceDB.keep_advantages)."""
        if not self.replays or self.rank != 0 or advantages is None:
            return
        first = {
            x.id: advantages[b, : x.response_length]  # [R]
            for b, x in enumerate(exps)
            if x.id is not None and x.advantages is None and not x.info.get("expert")
        }
        if first:
            self.db.keep_advantages(step, first)

    def keep_trained(self, exps: list[Experience], batch: dict, step: int) -> None:
        """Rank 0, experiences read from the DB: what step `step` trained each one on, per response token, in the DB's
        trained table (ExperienceDB.keep_trained, for the studio's viewer): its advantages [R] and, where this step
        computed them (score_batch: not with one update and no piece reading them), its old_logprobs [R]."""
        advantages, logprobs = batch.get("advantages"), batch.get("old_logprobs")  # [B,T] each, or None
        if self.examples or self.rank != 0 or advantages is None:
            return
        rows = {}
        for b, x in enumerate(exps):
            if x.id is None:  # an auxiliary buffer's example (mix): not a row of this DB
                continue
            rows[x.id] = {"advantages": advantages[b, : x.response_length]}  # [R]
            if logprobs is not None:
                rows[x.id]["logprobs"] = logprobs[b, : x.response_length]  # [R]
        if rows:
            self.db.keep_trained(step, rows)

    def share(self, got: list[Experience]) -> list[Experience]:
        """Rank 0's batch on every rank, sent over the process group as bytes (buffer.serialise_many: no
        pickle), with `ended` and `short`: only rank 0 talks to the DB, wherever the other ranks run."""
        data = serialise_many(got) if self.rank == 0 else b""
        head = torch.tensor([len(data), self.ended, self.short], dtype=torch.long, device=self.device)  # [3]
        dist.broadcast(head, src=0)
        self.ended, self.short = bool(head[1]), bool(head[2])
        n = int(head[0])
        if dist.get_world_size() == 1 or n == 0:
            return got
        buf = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
            if self.rank == 0
            else torch.empty(n, dtype=torch.uint8, device=self.device)
        )
        dist.broadcast(buf, src=0)
        return got if self.rank == 0 else deserialise_many(buf.cpu().numpy().tobytes())

    def claim(self, step: int, n: int) -> list[Experience]:
        """Rank 0: claim n experiences for `step` (waiting for them); dynamic sampling replaces tied groups. Claims
        take whole groups with the priority queue (replay) or dynamic sampling (ExperienceDB.claim)."""
        eb = self.cfg.buffer.trainer_input.experience_buffer
        fn, strategy_cfg = self.strategy
        want = fn(step, strategy_cfg)
        claim = functools.partial(
            self.db.claim,
            step=step,
            timeout=eb.max_read_timeout,
            priority=eb.use_priority_queue,
            reuse_cooldown=eb.reuse_cooldown_time,
            decay=eb.priority_decay,
            partial=False,
            groups=self.refills,  # and always with the priority queue
            waiting=self.waiting(step),
            min_version=want.get("min_version", 0),
        )
        start = time.monotonic()
        got, self.dropped_groups = claim(n), 0
        self.waits.end(time.monotonic() - start)
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
        return got

    def explorers(self) -> str:
        """What the explorers that write to the DB last recorded, for log lines."""
        now = time.time()
        return (
            "; ".join(
                f"{name} at step {x['step']}"
                + (" (finished)" if x.get("finished") else f", last wrote {now - x.get('time', now):.0f} s ago")
                + (f", {x['written']} experiences" if "written" in x else "")
                + (f", then waits for the weights of step {x['sync_wait']}" if x.get("sync_wait") else "")
                for name, x in self.db.explorer_states().items()
            )
            or "none has written to this DB yet"
        )

    def waiting(self, step: int) -> Callable[[int, float], bool]:
        """The claim's `waiting` callback: the trainer's status "waiting" in the DB after 5 s and every 30 s, a log
        line saying what it waits for (INFO only when the wait is longer than usual: sync.WaitNotes, else DEBUG),
        and "no more will come" once every explorer that wrote to the DB has finished (`ended`), or has reached the
        sync point that waits for this step's weights (sync.holds, by the state it wrote with its last step): the step
        is `short`, its batch what is there."""
        eb, next_status = self.cfg.buffer.trainer_input.experience_buffer, [5.0]
        self.waits.begin()

        def check(have: int, waited: float) -> bool:
            states = self.db.explorer_states()
            if states and all(x.get("finished") for x in states.values()):
                self.ended = True
                return True
            if states and all(sync.holds(x, step, self.cfg) for x in states.values()):
                self.short = True
                log.info(
                    "train step %d: %d of %d experiences, and no more will come before its weights (explorers: "
                    "%s): the step trains on what there is%s",
                    step,
                    have,
                    self.cfg.buffer.train_batch_size,
                    self.explorers(),
                    "" if have else " (nothing: no update, its weights published as they are)",
                )
                return True
            if waited >= next_status[0]:
                next_status[0] = waited + 30
                self.db.set_trainer_status(step - 1, "waiting")
            if (level := self.waits.level(waited)) is not None and log.isEnabledFor(level):  # explorers(): a query
                log.log(
                    level,
                    "train step %d: waiting for experiences: %d of %d ready after %.0f s (gives up after "
                    "max_read_timeout %g s); explorers: %s",
                    step,
                    have,
                    self.cfg.buffer.train_batch_size,
                    waited,
                    eb.max_read_timeout,
                    self.explorers(),
                )
            return False

        return check
