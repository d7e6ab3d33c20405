"""ulysses.py: sequence parallelism for long sequences (DeepSpeed-Ulysses, Jacobs et al., arXiv:2309.14509; veRL's
trainer.ulysses_sequence_parallel_size). The P ranks of one group take the same packed micro-batch, and each runs the
model on 1/P of its columns: embeddings, MLPs, norms and the LM head see only their slice, so activations shrink
P-fold. Attention is the one place where tokens meet: there each rank trades its slice of the sequence for all heads
for the whole sequence of 1/P of the heads (an all-to-all), attends with the micro-batch's segments as an unsplit run
does (models.segment_attention), and trades back. The scored positions' log-probs (or values) are then gathered, so
that every rank of the group computes the whole micro-batch's loss.

    sp = SeqParallel.make(2)                        # every rank, once: its group of 2 consecutive ranks (or None)
    sp.check(hf.config)                             # a head count it cannot split: ConfigError naming the key
    inputs, keep, local = sp.split(mb)              # TokenScorer: this rank's columns; which scored positions it holds
    out = sp.attend(q, k, v, attend_fn)             # models.gqa_sdpa, under the model's attention layers
    logp = sp.gather(logp_of_mine, keep)            # [N], every scored position, differentiable

Ranks: groups are consecutive ranks (0..P-1, P..2P-1, ...), as veRL's (dp, sp) device mesh; FSDP2 still shards over
all ranks, and the data is dealt to world / P data-parallel groups (train.make_batch). How the gradient comes out
right: every rank of a group computes the same loss L; the gather's backward (an all-to-all) sums the P ranks'
gradients into each rank's own values, so the group's gradients sum to P x dL; FSDP2 averages over all world ranks,
so train.optimize scales the loss by the number of data-parallel groups (world / P), as an unsplit run scales by its
world: the update equals the unsplit run's (tests/test_ulysses.py).

Where it departs from veRL's: one group size for the actor, reference and critic; the KV heads are repeated up to P
where there are fewer of them than ranks (veRL does the same), and a head count that neither divides nor is divided by
P is refused. NOTE: the all-to-all is torch.distributed._functional_collectives's all_to_all_single_autograd, the
differentiable one (torch.distributed.nn's is deprecated).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from batching import segment_part
from errors import ConfigError

KEY = "trainer.ulysses_sequence_parallel_size"


@dataclasses.dataclass(frozen=True)
class SeqParallel:
    """This rank's sequence-parallel group: its process group, its size P and this rank's place in it."""

    group: Any  # a torch.distributed ProcessGroup
    size: int
    index: int

    @staticmethod
    def make(size: int) -> SeqParallel | None:
        """This rank's group of `size` consecutive ranks (None for size 1). Every rank must call it, in the same order
        (creating groups is collective). A world size it does not divide: ConfigError naming the key."""
        world = dist.get_world_size()
        if size < 1 or world % size:
            raise ConfigError(f"{KEY} = {size} must be a positive divisor of the trainer's {world} rank(s)")
        if size == 1:
            return None
        mine = None
        for first in range(0, world, size):  # NOTE: every rank creates every group, in order
            group = dist.new_group(list(range(first, first + size)))
            if first <= dist.get_rank() < first + size:
                mine = SeqParallel(group, size, dist.get_rank() - first)
        return mine

    def check(self, config: Any) -> None:
        """Refuse by name a model whose attention heads cannot be split over P ranks: the query heads must divide by
        P, and the KV heads must divide by P or divide P (then they are repeated up to P)."""
        heads = config.num_attention_heads
        kv = getattr(config, "num_key_value_heads", None) or heads
        if heads % self.size or (kv % self.size and self.size % kv):
            raise ConfigError(
                f"{KEY} = {self.size}: {config.model_type} has {heads} attention heads and {kv} key/value heads; "
                f"sequence parallelism needs both to divide by it (or the key/value heads to divide it)"
            )

    def split(self, mb: dict) -> tuple[dict, torch.Tensor, torch.Tensor]:
        """The model inputs of this rank's columns of the packed micro-batch `mb` (batching.micro_batch), its rows
        [R,W] padded to a width Wp that P divides; `keep` [N]: which scored positions (mb["index"]) it holds, and
        `local` [keep.sum()]: where they are in its flattened [R*Wp/P] output. Segments keep the whole width (attention
        runs on the whole sequence); padded rows without packing get one causal segment each."""
        ids, pos = mb["input_ids"], mb["position_ids"]  # [R,W] each
        R, W = ids.shape
        Wp = -(-W // self.size) * self.size
        wide = Wp // self.size  # this rank's columns: [first, first + wide)
        first = self.index * wide
        ids, pos = (torch.nn.functional.pad(x, (0, Wp - W)) for x in (ids, pos))  # [R,Wp] each
        inputs = {
            "input_ids": ids[:, first : first + wide],
            "position_ids": pos[:, first : first + wide],
            "attention_mask": None,
            "use_cache": False,
            "segments": self.segments(mb, W, Wp),
            "ulysses": self,
        }
        row, col = mb["index"] // W, mb["index"] % W  # [N] each
        keep = (col >= first) & (col < first + wide)  # [N]
        return inputs, keep, row[keep] * wide + col[keep] - first

    @staticmethod
    def segments(mb: dict, W: int, Wp: int) -> dict:
        """mb's segments (segment_attention's flat positions over [R,W]) moved to rows Wp wide; without packing, one
        causal segment per padded row (its attention_mask's length)."""
        if mb.get("segments") is None:
            lengths = mb["attention_mask"].sum(-1).tolist()  # [R]
            keys = [list(range(r * W, r * W + n)) for r, n in enumerate(lengths)]
            parts = [tuple(x.to(mb["input_ids"].device) for x in segment_part(keys, [0] * len(keys)))]
        else:
            parts = mb["segments"]["parts"]
        moved = [(qi // W * Wp + qi % W, ki // W * Wp + ki % W, mask, valid) for qi, ki, mask, valid in parts]
        return {"parts": moved}

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, fn: Callable) -> torch.Tensor:
        """Attention of this rank's columns: query [R,H,w,d], key and value [R,KV,w,d] (w = Wp / P) to the whole
        sequence of H/P heads, `fn(q, k, v)` -> [R,Wp,H/P,d] over it, and back: [R,w,H,d]."""
        kv = key.shape[1]
        if kv % self.size:  # fewer KV heads than ranks: each repeated so that every rank gets one
            key, value = (x.repeat_interleave(self.size // kv, dim=1) for x in (key, value))  # [R,P,w,d] each
        q, k, v = (self.to_heads(x) for x in (query, key, value))  # [R,H/P,Wp,d], [R,KV/P,Wp,d] x 2
        return self.to_columns(fn(q, k, v))  # [R,w,H,d]

    def to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[R,h,w,d] (all heads, this rank's columns) -> [R,h/P,Wp,d] (this rank's heads, all columns)."""
        R, h, w, d = x.shape
        send = x.reshape(R, self.size, h // self.size, w, d).transpose(0, 1).contiguous()  # [P,R,h/P,w,d]
        got = self.exchange(send)  # [P,R,h/P,w,d]: from each rank, its columns of my heads
        return got.permute(1, 2, 0, 3, 4).reshape(R, h // self.size, self.size * w, d)

    def to_columns(self, x: torch.Tensor) -> torch.Tensor:
        """[R,Wp,h,d] (this rank's h heads, all columns) -> [R,w,h*P,d] (all heads, this rank's columns)."""
        R, Wp, h, d = x.shape
        send = x.reshape(R, self.size, Wp // self.size, h, d).transpose(0, 1).contiguous()  # [P,R,w,h,d]
        got = self.exchange(send)  # [P,R,w,h,d]: from each rank, my columns of its heads
        return got.permute(1, 2, 0, 3, 4).reshape(R, Wp // self.size, self.size * h, d)

    def exchange(self, x: torch.Tensor) -> torch.Tensor:
        """Slice j of x [P,...] to rank j of the group; slice j of the result [P,...] came from rank j (differentiable:
        the gradient goes back the same way)."""
        out = funcol.all_to_all_single_autograd(x.flatten(), None, None, self.group)  # [P*...]
        return funcol.wait_tensor(out).view(x.shape)

    def gather(self, mine: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """[N]: the values of every scored position, from `mine` [keep.sum()] (this rank's, where `keep` [N]) and the
        other ranks'. NOTE: differentiable; its backward sums the group's gradients of each value into the rank that
        computed it (the loss is the same on every rank of the group: module docstring)."""
        full = mine.new_zeros(keep.shape[0]).index_put((keep.nonzero()[:, 0],), mine)  # [N]
        return self.exchange(full.expand(self.size, -1).contiguous()).sum(0)  # [N]
