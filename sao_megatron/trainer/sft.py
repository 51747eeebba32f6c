"""Supervised warm-up: next-token cross-entropy on the action tokens of gold demonstrations.

Loss (global token mean): L = -sum_t m_t log pi_theta(x_t | x_<t) / N, with m_t = 1 on
demonstrated action tokens and N the number of such tokens in the global batch (all
micro-batches and data-parallel ranks), so the gradient does not depend on how the batch is
split. Sequences are drawn without replacement from a seeded permutation (a new permutation per
epoch), so a run is reproducible and resumable from (epoch, index).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
import torch.distributed as dist

from sao_megatron.data.batch import pad_token_sequences
from sao_megatron.data.trajectory import TokenSequence
from sao_megatron.models.forward import ModelInputs, forward_backward
from sao_megatron.optim.builder import TrainState
from sao_megatron.parallel.state import ParallelState


@dataclass
class SequenceSampler:
    """Seeded epoch-wise sampler of sequence indices; its cursor is checkpointable."""

    num_sequences: int
    seed: int
    epoch: int = 0
    index: int = 0

    def _order(self) -> list[int]:
        order = list(range(self.num_sequences))
        random.Random(f"sft:{self.seed}:{self.epoch}").shuffle(order)
        return order

    def next(self, k: int) -> list[int]:
        """The next `k` indices (crossing epochs as needed)."""
        out: list[int] = []
        order = self._order()
        while len(out) < k:
            if self.index >= self.num_sequences:
                self.epoch, self.index = self.epoch + 1, 0
                order = self._order()
            take = min(k - len(out), self.num_sequences - self.index)
            out += order[self.index : self.index + take]
            self.index += take
        return out

    def state_dict(self) -> dict:
        """The cursor: {"epoch", "index", "seed"} (a checkpoint's Stateful ``sampler``)."""
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        """Continue at `state`'s epoch and index (the seed is the job's)."""
        self.epoch, self.index = int(state["epoch"]), int(state["index"])


def sft_step(
    state: TrainState,
    parallel: ParallelState,
    seqs: list[TokenSequence],
    *,
    pad_token_id: int,
    micro_batch_size: int,
) -> dict[str, float]:
    """One optimiser step on the global batch `seqs` (identical list on every rank).

    Each data-parallel rank takes rows ``dp_rank::dp``; the batch is padded to a multiple of
    ``micro_batch_size * dp`` rows with empty rows so every rank runs the same number of
    micro-batches. Returns loss (nats per action token), token accuracy, grad norm, lr.
    """
    dp, rank = parallel.dp, parallel.dp_rank
    mine = seqs[rank::dp]
    n_rows = -(-len(seqs) // (micro_batch_size * dp)) * micro_batch_size
    tp = parallel.cfg.tp if parallel.cfg.sequence_parallel else 1
    padded = pad_token_sequences(mine, pad_token_id=pad_token_id, pad_to_multiple_of=tp)
    extra = n_rows - len(mine)
    if extra:
        for k, v in padded.items():
            fill = torch.zeros((extra, *v.shape[1:]), dtype=v.dtype)
            padded[k] = torch.cat([v, fill])
        padded["loss_mask"][len(mine) :, 0] = True  # one visible token keeps attention finite
    target_mask = padded["action_mask"][:, 1:]
    n_local = int(target_mask.sum())
    n_global = torch.tensor([n_local], dtype=torch.float64)
    if dp > 1:
        dist.all_reduce(n_global, group=parallel.pg_collection.dp)
    n_global = max(float(n_global), 1.0)

    def loss_fn(outputs, mb):
        mask = mb.extras["target_mask"]
        lp = torch.where(mask, outputs["logprobs"], 0.0)
        loss = -lp.sum() / n_global
        correct = torch.where(mask, outputs["logprobs"] > -0.6931, False).sum()  # p > 0.5
        return loss, {"correct": correct.float()}

    batch = ModelInputs(
        input_ids=padded["token_ids"],
        attention_mask=padded["loss_mask"],
        position_ids=padded["position_ids"],
        extras={"target_mask": target_mask},
    )
    state.zero_grad()
    recs = forward_backward(
        state.model,
        parallel,
        batch,
        kind="policy",
        loss_fn=loss_fn,
        micro_batch_size=micro_batch_size,
    )
    ok, grad_norm = state.step()
    sums = torch.tensor(
        [sum(float(r["loss"]) for r in recs), sum(float(r["correct"]) for r in recs)],
        dtype=torch.float64,
    )
    if dp > 1:
        dist.all_reduce(sums, group=parallel.pg_collection.dp)
    return {
        "sft/loss": float(sums[0]),
        "sft/token_accuracy": float(sums[1]) / n_global,
        "sft/grad_norm": float("nan") if grad_norm is None else float(grad_norm),
        "sft/lr": float(state.optimizer.param_groups[0]["lr"]),
        "sft/update_ok": float(ok),
        "sft/num_action_tokens": n_global,
    }
