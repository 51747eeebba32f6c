"""A DP rank's share of a packed batch, laid out once for the train step: `layout_micro_batches`.

Every rank holds the same global `TrainBatch` (`pack_trajectories`); `layout_micro_batches`
turns it into this data-parallel rank's rows, padded and shifted, in micro-batches:

* **sharding**: whole trajectories (whole GRPO groups with ``by_group``) are dealt to DP ranks
  greedily by token count, largest first, so GAE and group statistics stay on one rank;
* **padding**: every rank gets the same number of rows, a multiple of the micro-batch size
  (expert-parallel all-to-alls need equal micro-batch counts on the DP ranks): dummy rows with
  one visible token and nothing to train on come after the real rows. Every rank computes every
  rank's share from the same batch, so the common row count needs no collective;
* **shift**: a model's outputs at position p score the *next* token p+1 (log pi(x_{p+1} | x_<=p);
  the value head's V at p is V(state before token p+1)). Everything a loss reads is therefore
  laid out at *prediction positions* p = 0..T-2, entry p describing token p+1; the model inputs
  stay at token positions t = 0..T-1. `at_predictions` is the one shift, `values_at_predictions`
  the value head's.

The step's own per-token results (advantages, returns, value targets, old log-probs) live at the
same prediction positions over the rank's R padded rows ([R, T-1]); a micro-batch takes its rows
of them in `MicroBatch.model_inputs`, and `RankBatch.to_streams` / `RankBatch.from_streams` move
them between those positions and the algorithm's action streams (one row per trajectory, its
action tokens in order: `sao_megatron.data.batch.action_stream_index`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sao_megatron.data.batch import TrainBatch, action_stream_index
from sao_megatron.models.forward import ModelInputs


def at_predictions(x: torch.Tensor) -> torch.Tensor:
    """Token-position tensor [B, T, ...] -> prediction positions [B, T-1, ...]: entry p is
    token p+1's (a view)."""
    return x[:, 1:]


def values_at_predictions(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The value head's outputs raw [B, T] (raw[b, t] = V(state after reading tokens 0..t)) at
    prediction positions: (before [B, T-1], after [B, T-1]), views of `raw`.

    before[b, p] = raw[b, p] = V(state before token p+1): V_old of the value loss and V(s_t) of
    GAE. after[b, p] = raw[b, p+1] = V(state after token p+1): the bootstrap value V_last of a
    truncated trajectory, read at its last action token.
    """
    return raw[:, :-1], raw[:, 1:]


@dataclass(kw_only=True)
class MicroBatch:
    """Rows of a DP rank's padded batch, ready for one forward/backward (`RankBatch`).

    Model inputs, token positions t = 0..T-1:
        token_ids: [b, T] int64 (right padding: the pad id; a padding row: any id).
        position_ids: [b, T] int64, 0..len-1, then 0 on padding.
        attention_mask: [b, T] bool, True on real tokens; a padding row keeps its first token
            visible, so attention stays finite there.
        routed_experts: [b, T, num_layers, top_k] uint8/int16, the experts the engine routed
            each token to; routing_mask: [b, T] bool, where recorded. Both None when the batch
            carries no routing.
    Loss inputs, prediction positions p = 0..T-2 (entry p is token p+1, scored by the model's
    output at p):
        action_mask: [b, T-1] bool, token p+1 was sampled by the policy.
        behaviour_logprobs: [b, T-1] float32, log pi_behaviour(x_{p+1} | x_<=p), 0 off-action.
        policy_versions: [b, T-1] int64, engine weight version of token p+1, -1 off-action.
    Bookkeeping:
        rows: slice, these rows among the rank's R padded rows.
        row_trajectory: [b] int64, the rank-local trajectory of each row, -1 on padding rows.
    """

    token_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    action_mask: torch.Tensor
    behaviour_logprobs: torch.Tensor
    policy_versions: torch.Tensor
    rows: slice
    row_trajectory: torch.Tensor
    routed_experts: torch.Tensor | None = None
    routing_mask: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        return int(self.token_ids.shape[0])

    def model_inputs(self, extras: dict[str, torch.Tensor] | None = None) -> ModelInputs:
        """The `ModelInputs` of a forward over these rows. Its extras (what the loss function
        reads) are the loss inputs above (action_mask, behaviour_logprobs, policy_versions)
        plus these rows of `extras`: per-row tensors of the whole rank ([R, ...], e.g.
        advantages [R, T-1])."""
        own = {
            "action_mask": self.action_mask,
            "behaviour_logprobs": self.behaviour_logprobs,
            "policy_versions": self.policy_versions,
        }
        return ModelInputs(
            input_ids=self.token_ids,
            attention_mask=self.attention_mask,
            position_ids=self.position_ids,
            extras=own | {k: v[self.rows] for k, v in (extras or {}).items()},
        )


@dataclass(kw_only=True)
class RankBatch:
    """This DP rank's share of a packed batch, laid out for a train step (`layout_micro_batches`).

    trajectories: `TrainBatch` of this rank's trajectories (real rows only, token positions,
        trajectory indices renumbered from 0): the per-trajectory data of the advantage math.
    rows: `MicroBatch` of all R padded rows (the real rows first), for rank-wide sums.
    micro_batches: R / micro_batch_size `MicroBatch`es, consecutive row slices of `rows`.
    stream_position: [R, T-1] int64, where each action prediction sits in its trajectory's
        action stream (-1 off-action and on padding rows); stream_length: [num_traj] int64.
    """

    trajectories: TrainBatch
    rows: MicroBatch
    micro_batches: list[MicroBatch]
    stream_position: torch.Tensor
    stream_length: torch.Tensor

    @property
    def num_rows(self) -> int:
        """R, the rows after padding (the same on every DP rank)."""
        return self.rows.num_rows

    @property
    def num_real_rows(self) -> int:
        return self.trajectories.num_rows

    @property
    def micro_batch_size(self) -> int:
        return self.micro_batches[0].num_rows

    @property
    def token_shape(self) -> tuple[int, int]:
        """(R, T): the model inputs' shape."""
        return tuple(self.rows.token_ids.shape)

    @property
    def prediction_shape(self) -> tuple[int, int]:
        """(R, T-1): the shape of every per-token loss input and step result."""
        return tuple(self.rows.action_mask.shape)

    def model_inputs(self, extras: dict[str, torch.Tensor] | None = None) -> list[ModelInputs]:
        """One `ModelInputs` per micro-batch (`MicroBatch.model_inputs`)."""
        return [mb.model_inputs(extras) for mb in self.micro_batches]

    def to_streams(self, x: torch.Tensor, fill: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        """[R, T-1] values at prediction positions -> ([num_traj, A_max] action streams of the
        dtype of `x`, `fill` past each stream's end; [num_traj, A_max] bool, valid entries),
        A_max = max(longest stream, 1)."""
        n = self.trajectories.num_trajectories
        a_max = max(int(self.stream_length.max()), 1)
        out = torch.full((n, a_max), fill, dtype=x.dtype)
        valid = torch.zeros((n, a_max), dtype=torch.bool)
        traj, pos, m = self._stream_index()
        out[traj[m], pos[m]] = x[m]
        valid[traj[m], pos[m]] = True
        return out, valid

    def from_streams(self, streams: torch.Tensor) -> torch.Tensor:
        """[num_traj, A_max] action streams -> [R, T-1] at prediction positions, dtype of
        `streams`, 0 off-action and on the padding rows."""
        out = torch.zeros(self.prediction_shape, dtype=streams.dtype)
        traj, pos, m = self._stream_index()
        out[m] = streams[traj[m], pos[m]]
        return out

    def last_actions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Where each trajectory's last action token is (the state after it is the bootstrap
        state of a truncated trajectory): (row, prediction position) [num_traj, 2] int64, (0, 0)
        for a trajectory without action tokens, and whether it has one [num_traj] bool."""
        n = self.trajectories.num_trajectories
        out = torch.zeros(n, 2, dtype=torch.long)
        found = torch.zeros(n, dtype=torch.bool)
        action, row_traj = self.rows.action_mask, self.rows.row_trajectory
        for r in range(self.num_real_rows):  # rows, not tokens
            pos = torch.nonzero(action[r]).flatten()
            if len(pos):
                t = int(row_traj[r])
                out[t] = torch.tensor([r, int(pos[-1])])
                found[t] = True
        return out, found

    def _stream_index(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        pos = self.stream_position
        traj = self.rows.row_trajectory[:, None].expand_as(pos)
        return traj, pos, pos >= 0


def deal_trajectories(batch: TrainBatch, dp_size: int, by_group: bool) -> list[list[int]]:
    """The trajectory indices of each DP rank, sorted: trajectories (or, with ``by_group``, all
    trajectories sharing a task id) dealt greedily by token count, largest first, each to the
    least-loaded rank (lowest rank on ties), so ranks get similar work."""
    tokens_of = torch.zeros(batch.num_trajectories, dtype=torch.long)
    tokens_of.index_add_(0, batch.row_trajectory, batch.loss_mask.sum(1))
    tokens = tokens_of.tolist()
    units: dict[object, list[int]] = {}
    for t in range(batch.num_trajectories):
        units.setdefault(batch.task_ids[t] if by_group else t, []).append(t)
    cost = {k: sum(tokens[t] for t in ts) for k, ts in units.items()}
    load = [0] * dp_size
    dealt: list[list[int]] = [[] for _ in range(dp_size)]
    for key in sorted(units, key=lambda k: (-cost[k], str(k))):
        owner = min(range(dp_size), key=lambda i: (load[i], i))
        load[owner] += cost[key]
        dealt[owner] += units[key]
    return [sorted(ts) for ts in dealt]


def shard_for_data_parallel(
    batch: TrainBatch, dp_rank: int, dp_size: int, by_group: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of the trajectories DP rank `dp_rank` trains on, and their trajectory indices
    (`deal_trajectories`): (row indices [r] int64, trajectory indices [n] int64), sorted."""
    mine = deal_trajectories(batch, dp_size, by_group)[dp_rank]
    return _rows_of(batch, mine), torch.tensor(mine, dtype=torch.long)


def _rows_of(batch: TrainBatch, trajs: list[int]) -> torch.Tensor:
    keep = torch.zeros(batch.num_trajectories, dtype=torch.bool)
    keep[trajs] = True
    return torch.nonzero(keep[batch.row_trajectory]).flatten()


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
    """Append dummy rows (one pad token, all masks False, trajectory -1) up to `num_rows`."""
    extra = num_rows - b.num_rows
    if extra <= 0:
        return b

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
    return out


def _micro_batch(b: TrainBatch, rows: slice) -> MicroBatch:
    """`MicroBatch` of `rows` of the padded local batch `b` (views)."""
    routed = b.routed_experts is not None
    return MicroBatch(
        token_ids=b.token_ids[rows],
        position_ids=b.position_ids[rows],
        attention_mask=b.loss_mask[rows],
        action_mask=at_predictions(b.action_mask[rows]),
        behaviour_logprobs=at_predictions(b.behaviour_logprobs[rows]),
        policy_versions=at_predictions(b.policy_versions[rows]),
        rows=rows,
        row_trajectory=b.row_trajectory[rows],
        routed_experts=b.routed_experts[rows] if routed else None,
        routing_mask=b.routing_mask[rows] if routed else None,
    )


def layout_micro_batches(
    batch: TrainBatch,
    *,
    dp_rank: int,
    dp_size: int,
    micro_batch_size: int,
    by_group: bool,
) -> RankBatch:
    """This DP rank's trajectories of the global `batch`, padded and shifted, in micro-batches.

    Args:
        batch: the packed global batch (`pack_trajectories`), the same on every rank.
        dp_rank, dp_size: this rank's data-parallel rank and the data-parallel size.
        micro_batch_size: rows per micro-batch.
        by_group: keep all trajectories of a task id (a GRPO group) on one rank.
    Returns: a `RankBatch` of R rows, R the largest share over the DP ranks rounded up to a
        multiple of `micro_batch_size` (the same R on every rank), real rows first.
    Raises ValueError when micro_batch_size < 1 or some DP rank would get no trajectory.
    """
    if micro_batch_size < 1:
        raise ValueError(f"rl.micro_batch_size={micro_batch_size}: must be >= 1")
    dealt = deal_trajectories(batch, dp_size, by_group)
    empty = [r for r, ts in enumerate(dealt) if not ts]
    if empty:
        raise ValueError(
            f"data-parallel rank {empty[0]} got no trajectory: the batch has "
            f"{batch.num_trajectories} trajectories (or groups) for {dp_size} DP ranks; "
            "raise rollout.trajectories_per_batch to at least the data-parallel size"
        )
    most = max(len(_rows_of(batch, ts)) for ts in dealt)
    num_rows = -(-most // micro_batch_size) * micro_batch_size
    mine = dealt[dp_rank]
    real = local_batch(batch, _rows_of(batch, mine), torch.tensor(mine, dtype=torch.long))
    padded = pad_rows(real, num_rows)
    stream_pos, stream_len = action_stream_index(real)
    position = torch.full((num_rows, padded.token_ids.shape[1] - 1), -1, dtype=torch.long)
    position[: real.num_rows] = at_predictions(stream_pos)
    return RankBatch(
        trajectories=real,
        rows=_micro_batch(padded, slice(0, num_rows)),
        micro_batches=[
            _micro_batch(padded, slice(i, i + micro_batch_size))
            for i in range(0, num_rows, micro_batch_size)
        ],
        stream_position=position,
        stream_length=stream_len,
    )


__all__ = [
    "MicroBatch",
    "RankBatch",
    "at_predictions",
    "deal_trajectories",
    "layout_micro_batches",
    "local_batch",
    "pad_rows",
    "shard_for_data_parallel",
    "values_at_predictions",
]
