"""The train step's data layout: this DP rank's share of the global `TrainBatch`, padded.

Data parallelism: the caller hands every rank the same global batch; `shard_for_data_parallel`
deals whole trajectories (whole GRPO groups) to DP ranks, so GAE and group statistics stay local,
and `shard_batch` pads every rank to the same number of rows (expert-parallel all-to-alls need
equal micro-batch counts). The padding rows come last; `real_rows` drops them again.

Three layouts meet in a step:

* token positions t (every `TrainBatch` tensor, [R, T]);
* prediction positions p = 0..T-2 (what `forward_backward` returns: position p scores token
  p+1), so every token-position tensor handed to a loss is shifted with `pred`;
* action streams (one row per trajectory, its action tokens in order; `gather_to_streams`), where
  the algorithm's advantage math runs; `to_padded` puts its results back on the padded rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from sao_megatron.data.batch import TrainBatch, scatter_from_streams
from sao_megatron.models.forward import ModelInputs
from sao_megatron.parallel.state import ParallelState
from sao_megatron.rollout.staleness import stale_token_mask


def pred(x: torch.Tensor) -> torch.Tensor:
    """Token-position tensor [B, T] -> prediction positions [B, T-1] (entry p is token p+1)."""
    return x[:, 1:]


def shard_for_data_parallel(
    batch: TrainBatch, dp_rank: int, dp_size: int, by_group: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of the trajectories this DP rank trains on, and their trajectory indices.

    Trajectories (or, with ``by_group``, all trajectories sharing a task id) are dealt to DP ranks
    greedily by token count (largest first), so ranks get similar work and every trajectory stays
    on one rank. Returns (row indices [R] int64, trajectory indices [n] int64), sorted.
    """
    rows_of = [[] for _ in range(batch.num_trajectories)]
    for r, t in enumerate(batch.row_trajectory.tolist()):
        rows_of[t].append(r)
    tokens = batch.loss_mask.sum(1).tolist()
    units: dict[object, list[int]] = {}
    for t in range(batch.num_trajectories):
        units.setdefault(batch.task_ids[t] if by_group else t, []).append(t)
    cost = {k: sum(tokens[r] for t in ts for r in rows_of[t]) for k, ts in units.items()}
    load = [0] * dp_size
    mine: list[int] = []
    for key in sorted(units, key=lambda k: (-cost[k], str(k))):
        owner = min(range(dp_size), key=lambda i: (load[i], i))
        load[owner] += cost[key]
        if owner == dp_rank:
            mine += units[key]
    mine.sort()
    rows = sorted(r for t in mine for r in rows_of[t])
    return torch.tensor(rows, dtype=torch.long), torch.tensor(mine, dtype=torch.long)


def local_batch(batch: TrainBatch, rows: torch.Tensor, trajs: torch.Tensor) -> TrainBatch:
    """The sub-batch of `rows` / `trajs` with trajectory indices renumbered from 0."""
    remap = torch.full((batch.num_trajectories,), -1, dtype=torch.long)
    remap[trajs] = torch.arange(len(trajs))
    sub = batch.rows(rows)
    return TrainBatch(
        **{k: v for k, v in sub.items() if k != "row_trajectory"},
        row_trajectory=remap[sub["row_trajectory"]],
        node_rewards=batch.node_rewards[trajs],
        num_nodes=batch.num_nodes[trajs],
        truncated=batch.truncated[trajs],
        cut_action=None if batch.cut_action is None else batch.cut_action[trajs],
        task_ids=[batch.task_ids[i] for i in trajs.tolist()],
        group_index=batch.group_index[trajs],
        temperature=batch.temperature,
        top_p=batch.top_p,
        top_k=batch.top_k,
    )


def pad_rows(b: TrainBatch, num_rows: int) -> TrainBatch:
    """Append dummy rows (one pad token, all masks False) up to `num_rows`."""
    extra = num_rows - b.num_rows
    if extra <= 0:
        return b
    t = b.token_ids.shape[1]

    def pad(x, fill):
        return torch.cat([x, torch.full((extra, *x.shape[1:]), fill, dtype=x.dtype)])

    out = TrainBatch(**{**b.__dict__})
    out.token_ids = pad(b.token_ids, int(b.token_ids[0, 0]))
    out.position_ids = pad(b.position_ids, 0)
    out.loss_mask = pad(b.loss_mask, False)
    out.loss_mask[b.num_rows :, 0] = True  # one visible token keeps attention finite
    out.action_mask = pad(b.action_mask, False)
    out.node_index = pad(b.node_index, -1)
    out.behaviour_logprobs = pad(b.behaviour_logprobs, 0.0)
    out.policy_versions = pad(b.policy_versions, -1)
    out.row_trajectory = pad(b.row_trajectory, -1)
    if b.routed_experts is not None:
        out.routed_experts = pad(b.routed_experts, 0)
        out.routing_mask = pad(b.routing_mask, False)
    assert out.token_ids.shape == (num_rows, t)
    return out


def shard_batch(
    batch: TrainBatch, parallel: ParallelState, *, by_group: bool, micro_batch_size: int
) -> tuple[TrainBatch, int]:
    """This DP rank's trajectories, padded to a row count common to all DP ranks (a multiple of
    `micro_batch_size`), and the number of real rows before the padding.

    Raises ValueError when a DP rank would get no trajectory.
    """
    p = parallel
    rows, trajs = shard_for_data_parallel(batch, p.dp_rank, p.dp, by_group=by_group)
    counts = torch.tensor([len(rows)], dtype=torch.long)
    if p.dp > 1:
        dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=p.pg_collection.dp)
    mbs = micro_batch_size
    target = max(-(-int(counts) // mbs) * mbs, mbs)
    if len(trajs) == 0:
        raise ValueError(
            f"data-parallel rank {p.dp_rank} got no trajectory: the batch has "
            f"{batch.num_trajectories} trajectories (or groups) for {p.dp} DP ranks; "
            "raise rollout.trajectories_per_batch to at least the data-parallel size"
        )
    local = local_batch(batch, rows, trajs)
    return pad_rows(local, target), local.num_rows


def real_rows(b: TrainBatch, n: int) -> TrainBatch:
    """Drop the dummy padding rows appended by `pad_rows`: the first `n` rows of `b`."""
    sub = b.rows(slice(0, n))
    return TrainBatch(**{**b.__dict__, **sub})


def to_padded(padded: TrainBatch, real: TrainBatch, streams: torch.Tensor) -> torch.Tensor:
    """Action streams of `real` (the first rows of `padded`) -> token positions [R, T] of
    `padded`, dtype of `streams`, 0 off the action tokens and on the padding rows."""
    full = torch.zeros(padded.token_ids.shape, dtype=streams.dtype)
    full[: real.num_rows] = scatter_from_streams(real, streams)
    return full


def stale_tokens(b: TrainBatch, train_version: int, max_staleness: int | None) -> torch.Tensor:
    """[R, T-1] bool at prediction positions: action tokens sampled more than `max_staleness`
    versions before `train_version` (`stale_token_mask`); all False without a bound (None)."""
    versions = pred(b.policy_versions)
    if max_staleness is None:
        return torch.zeros(versions.shape, dtype=torch.bool)
    return stale_token_mask(versions, train_version, max_staleness)


def values_at_tokens(raw: torch.Tensor) -> torch.Tensor:
    """raw[b, t] = V(state after reading tokens 0..t) [B, T] -> V(state before token t) [B, T]:
    raw[b, t-1], column 0 = 0."""
    at_tokens = torch.zeros_like(raw)
    at_tokens[:, 1:] = raw[:, :-1]
    return at_tokens


def last_action_tokens(real: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each trajectory's last action token is (the state after it is the bootstrap state
    of a truncated trajectory): (row, position) [num_traj, 2] int64, (0, 0) for a trajectory
    without action tokens, and whether it has one [num_traj] bool."""
    out = torch.zeros(real.num_trajectories, 2, dtype=torch.long)
    found = torch.zeros(real.num_trajectories, dtype=torch.bool)
    for r in range(real.num_rows):  # rows, not tokens
        pos = torch.nonzero(real.action_mask[r]).flatten()
        if len(pos):
            t = int(real.row_trajectory[r])
            out[t] = torch.tensor([r, int(pos[-1])])
            found[t] = True
    return out, found


def last_state_values(real: TrainBatch, raw: torch.Tensor) -> torch.Tensor:
    """V of the state after each trajectory's last action token, [num_traj] float32 (0 without
    action tokens): the bootstrap value of truncated trajectories. raw: [R, T] as in
    `values_at_tokens`."""
    last, found = last_action_tokens(real)
    return torch.where(found, raw[last[:, 0], last[:, 1]].to(torch.float32), 0.0)


def model_inputs(b: TrainBatch, extras: dict[str, torch.Tensor]) -> ModelInputs:
    """`ModelInputs` of the rows of `b`, with the loss's per-token `extras` ([R, T-1] each)."""
    return ModelInputs(
        input_ids=b.token_ids,
        attention_mask=b.loss_mask,
        position_ids=b.position_ids,
        extras=extras,
    )
