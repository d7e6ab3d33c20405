"""The trainer's models and what runs them: the process group (setup_distributed), an HF causal LM or critic
sharded with FSDP2 (build_model) inside a TokenScorer, which turns a packed micro-batch (batching.micro_batch) into
per-token log-probs and entropies (actor, reference) or values (critic); `score` runs it over a step's micro-batches
without gradients (old and reference log-probs, values).

    rank, world, device = setup_distributed()
    actor = build_model(cfg.model.model_path, cfg.trainer, device, trainable=True)
    logprobs, entropy = actor(micro_batch(batch, units, share, device), entropy=True)  # [n,T] each
    old_logprobs = score(actor, batch, mine, share, device)  # [B,T], this rank's rows
"""

from __future__ import annotations

import datetime
import logging
import os

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel

import lora
from batching import micro_batch
from configs.schema import LoRAConfig, TrainerConfig
from models import load_critic, load_model, loading
from ulysses import SeqParallel

log = logging.getLogger("nanorft.scoring")


def setup_distributed(timeout_s: float | None = None) -> tuple[int, int, torch.device]:
    """torchrun's process group (or a one-process group); this rank, world size and device. `timeout_s`: how long a
    collective waits for the other ranks (launch.group_timeout; torch's default where None)."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    backend = "nccl" if cuda else "gloo"
    if "RANK" in os.environ:  # under torchrun
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s) if timeout_s else None)
    else:  # a plain process: a group of one, no rendezvous needed
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size(), device


def build_model(
    path: str,
    t: TrainerConfig,
    device: torch.device,
    trainable: bool,
    critic: bool = False,
    adapter: tuple[LoRAConfig, str] | None = None,
    eos: list[int] | tuple[int, ...] = (),
    sp: SeqParallel | None = None,
) -> TokenScorer:
    """An HF causal LM (or, `critic`, the value model) in a TokenScorer, sharded with FSDP2: each decoder
    layer (wrap_units), then the scorer (the root: embeddings, final norm and head). `adapter` (lora.start): a LoRA
    adapter is put into the HF model first (lora.wrap), so that each layer's FSDP2 group holds its frozen weights and
    its A and B. `eos`: the ids the engines stop on (models.eos_ids), masked where the engine masked them
    (TokenScorer). On several ranks the weights are read once: rank 0 loads the model, the others build it on the
    meta device (no memory), and each rank's shards get rank 0's values once sharded (spread). `sp`: this rank's
    sequence-parallel group (ulysses.py), which the scorer runs its micro-batches with."""
    cuda = device.type == "cuda"
    offload = cuda and (t.critic.param_offload if critic else t.param_offload if trainable else t.ref_param_offload)
    # NOTE: with CPU-offloaded shards (GPU only) every rank loads the whole model, as before: spreading into them is
    # not checked here (no GPU)
    first, many = dist.get_rank() == 0, dist.get_world_size() > 1 and not offload
    where = "cpu" if first or not many else "meta"
    with loading(path):
        hf = load_critic(path, device=where) if critic else load_model(path, dtype="float32", device=where)
    if sp is not None:
        sp.check(hf.config)
    lora_adapter = lora.wrap(hf, *adapter) if adapter else None
    if trainable and (t.critic.gradient_checkpointing if critic else t.gradient_checkpointing):
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # bf16 compute with fp32 master weights and fp32 gradient reduction on GPU; fp32 throughout on CPU.
    policy = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} if cuda else {}
    if offload:
        policy["offload_policy"] = CPUOffloadPolicy()
    model = TokenScorer(hf, critic=critic, adapter=lora_adapter, eos_ids=eos, sp=sp)
    full = model.state_dict() if first and many else None  # rank 0's whole weights, until spread hands them out
    for layer in wrap_units(hf):
        fully_shard(layer, **policy)
    fully_shard(model, **policy)  # NOTE: last, so tied embeddings / lm_head share one root group
    if many:
        spread(model, full, device)
    del full
    model.train(trainable)
    if not trainable:
        model.requires_grad_(False)
    return model


def spread(model: torch.nn.Module, full: dict[str, torch.Tensor] | None, device: torch.device) -> None:
    """Rank 0's weights into every rank's shards of the FSDP2-sharded `model`, which the other ranks built on the meta
    device: their shards get memory, then rank 0's values (`full`, its state dict from before sharding; None on the
    others) one tensor at a time (torch.distributed.checkpoint's set_model_state_dict, broadcast from rank 0); the
    buffers no state dict holds (rotary frequencies) are broadcast whole."""
    if dist.get_rank() > 0:
        model.to_empty(device=device)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full or {}, options=options)
    saved = set(model.state_dict())  # NOTE: FSDP2's state dict holds each rank's shards: nothing is gathered
    for name, buffer in model.named_buffers():
        if name not in saved:
            dist.broadcast(buffer, 0)


def wrap_units(hf: PreTrainedModel) -> list[torch.nn.Module]:
    """The modules that get an FSDP2 group each: those whose class transformers names in the model's
    `_no_split_modules` (its decoder layer class: Qwen2DecoderLayer, LlamaDecoderLayer, ...), so that no layout
    (`model.model.layers`) is assumed. A model that names none is sharded as one group (the root's),
    with a warning: correct, but every rank then gathers all the weights at once."""
    names = set(getattr(hf, "_no_split_modules", None) or ())
    found = [(name.count("."), m) for name, m in hf.named_modules() if type(m).__name__ in names]
    if not found:
        log.warning(
            "%s names no _no_split_modules that it holds (%s): the whole model is one FSDP2 group",
            type(hf).__name__,
            sorted(names) or "none",
        )
    # NOTE: deepest first (a nested unit's fully_shard must come before its parent's), else in model order
    return [m for _, m in sorted(found, key=lambda x: -x[0])]


CHUNK_ELEMENTS = 2**25  # logits materialised at once: [tokens, V] fp32 of at most 128 MB


class TokenScorer(torch.nn.Module):
    """What the trainer shards with FSDP2 (its root): an HF causal LM, or a critic, run on a packed micro-batch
    (batching.micro_batch), returning a value per response token of the micro-batch's sequences, as dense [n,T] tensors
    (0 on masked tokens): the log-prob of each token at `temperature` and, if asked, the entropy of the distribution it
    was drawn from (causal LM); the value of the state before it (critic, veRL's convention). NOTE: the vocabulary
    projection runs on the scored positions only, in chunks of CHUNK_ELEMENTS logits, each recomputed in the backward
    pass (activation checkpointing): Qwen's 152k vocabulary at 16k tokens would be ~10 GB per fp32 tensor otherwise. A
    model whose head does more than a linear map (soft-capping, scaling) is refused rather than scored wrongly.
    `adapter`: the model's LoRA adapter (lora.wrap), or None. `eos_ids` (models.eos_ids): masked (logit -inf) at
    the response positions where the rollout engine masked them (mb["eos_masked"], min_tokens: batching.eos_masked),
    so that the log-probs are of the distribution the engine sampled from, as vLLM's processed log-probs are. `sp`
    (sequence parallelism, ulysses.py): the model runs on this rank's columns of the micro-batch, and the values of
    the scored positions are gathered from the group's ranks, so that each returns the whole [n,T]."""

    def __init__(
        self,
        model: PreTrainedModel,
        critic: bool = False,
        adapter: lora.Adapter | None = None,
        eos_ids: list[int] | tuple[int, ...] = (),
        sp: SeqParallel | None = None,
    ) -> None:
        super().__init__()
        self.model, self.critic, self.adapter, self.eos_ids, self.sp = model, critic, adapter, list(eos_ids), sp
        extras = [
            k for k in ("final_logit_softcapping", "logit_scale", "logits_scaling") if getattr(model.config, k, None)
        ]
        if extras and not critic:
            raise ValueError(
                f"{model.config.model_type}: the trainer's scorer supports a plain linear LM head; "
                f"this model also applies {extras}"
            )

    def forward(
        self, mb: dict, entropy: bool = False, entropy_grad: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        n, T = len(mb["rows"]), mb["width"]
        inputs = {
            "input_ids": mb["input_ids"],
            "attention_mask": mb.get("attention_mask"),
            "position_ids": mb["position_ids"],
            "use_cache": False,
            "segments": mb.get("segments"),
        }
        index, keep = mb["index"], None  # [N]: the flat positions of the states that score a response token
        if self.sp is not None:  # this rank's columns; `keep` [N]: the scored positions among them, at `index`
            inputs, keep, index = self.sp.split(mb)
        if self.critic:
            values = self.model(**inputs).logits.flatten(0, 1)[index, 0].float()  # [N]
            return scatter(self.whole(values, keep), mb["dest"], n, T), None
        hidden = self.model.base_model(**inputs).last_hidden_state.flatten(0, 1)[index]  # [N,H]
        targets, temperature = mb["targets"], mb["temperature"]  # [N], [N]
        masked = mb.get("eos_masked", torch.zeros_like(targets, dtype=torch.bool))  # [N]
        if keep is not None:
            targets, temperature, masked = targets[keep], temperature[keep], masked[keep]
        head, step = self.model.get_output_embeddings(), max(1, CHUNK_ELEMENTS // self.model.config.vocab_size)
        chunks = [
            (hidden[i : i + step], targets[i : i + step], temperature[i : i + step], masked[i : i + step])
            for i in range(0, max(len(targets), 1), step)
        ]
        eos = torch.tensor(self.eos_ids, dtype=torch.long, device=targets.device)  # [E]
        how = {"head": head, "eos": eos, "entropy": entropy, "entropy_grad": entropy_grad}
        parts = [
            checkpoint(head_logprobs, *c, **how, use_reentrant=False) if len(chunks) > 1 else head_logprobs(*c, **how)
            for c in chunks
        ]
        logp = scatter(self.whole(torch.cat([p[0] for p in parts]), keep), mb["dest"], n, T)  # [n,T]
        ent = scatter(self.whole(torch.cat([p[1] for p in parts]), keep), mb["dest"], n, T) if entropy else None
        return logp, ent

    def whole(self, values: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        """The values [N] of every scored position: `values` itself, or under sequence parallelism this rank's (where
        keep [N]) and the group's other ranks' (ulysses.SeqParallel.gather)."""
        return values if keep is None else self.sp.gather(values, keep)


def head_logprobs(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: torch.Tensor,
    masked: torch.Tensor,
    head: torch.nn.Module,
    eos: torch.Tensor,
    entropy: bool,
    entropy_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log_softmax(head(hidden [N,H]) / temperature [N]) at the targets [N], the ids `eos` [E] masked (-inf) at the
    positions `masked` [N]; and the entropy [N] (no gradient unless entropy_grad: an entropy term with coefficient 0
    is a metric only). NOTE: a position whose own target is an EOS id is left unmasked (-inf would be no log-prob;
    such a row was not sampled under the mask it claims)."""
    logits = head(hidden).float() / temperature[:, None]  # [N,V]
    drop = None
    if eos.numel() and masked.any():
        masked = masked & ~torch.isin(targets, eos)  # [N]
        drop = torch.zeros_like(logits, dtype=torch.bool).index_fill_(1, eos, True) & masked[:, None]  # [N,V]
        logits = logits.masked_fill(drop, float("-inf"))  # [N,V]
    lse = logits.logsumexp(-1)  # [N]
    logp = logits.gather(-1, targets[:, None])[:, 0] - lse  # [N]
    if not entropy:
        return logp, logp.new_zeros(0)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        finite = logits if drop is None else logits.masked_fill(drop, 0.0)  # [N,V] NOTE: 0 * -inf is nan
        ent = lse - (logits.softmax(-1) * finite).sum(-1)  # [N]
    return logp, ent


def scatter(values: torch.Tensor, dest: torch.Tensor, n: int, T: int) -> torch.Tensor:
    """[n,T] zeros with values [N] at the flat positions dest [N] (differentiable in values). NOTE: not a view of
    a flat tensor: FSDP2 warns that an in-place op on a view returned by its root would skip its hooks."""
    return values.new_zeros(n, T).index_put((dest // T, dest % T), values)


@torch.no_grad()
def score(
    scorer: TokenScorer, batch: dict[str, torch.Tensor], mine: list[list[list[int]]], share: bool, device: torch.device
) -> torch.Tensor:
    """log-probs (or values) [B,T] of this rank's micro-batches `mine`, zero on the other ranks' rows."""
    out = torch.zeros(batch["responses"].shape)  # [B,T]
    was_training = scorer.training
    scorer.eval()
    for units in mine:
        mb = micro_batch(batch, units, share, device)
        out[mb["rows"]] = scorer(mb)[0].float().cpu()
    scorer.train(was_training)
    return out
