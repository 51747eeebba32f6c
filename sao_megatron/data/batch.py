"""Pack trajectories into one padded training batch (`TrainBatch`), the same on every rank.

A train step turns it into its DP rank's padded micro-batches, shifted to prediction positions,
in one function: `sao_megatron.data.micro_batches.layout_micro_batches`.

Alignment convention (used by the trainer, the algorithm code and the tests):
every per-token tensor is aligned to the *token position* t of the packed sequence.
``action_mask[b, t]`` is True when token t was sampled by the policy, and the policy's log-prob
of that token, log pi(x_t | x_<t), comes from the logits at position t-1. Position 0 is therefore
never an action token (every sequence starts with at least one prompt token).

Rows: a full-history trajectory is one row; a windowed trajectory contributes one row per action
node. ``row_trajectory[b]`` maps rows back to trajectories, so per-trajectory quantities (GAE over
the ordered action tokens) are computed on the compact *action stream* of each trajectory
(`action_stream_index`) regardless of the row layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sao_megatron.data.trajectory import TokenSequence, Trajectory


@dataclass(kw_only=True)
class TrainBatch:
    """A padded batch of B rows and T positions (right padding).

    token_ids: [B, T] int64, padded with pad_token_id.
    position_ids: [B, T] int64, 0..len-1 then 0 on padding.
    loss_mask: [B, T] bool, True on real (non-pad) tokens (for SFT on full sequences).
    action_mask: [B, T] bool, True on tokens sampled by the policy (never at t = 0).
    node_index: [B, T] int64, action node of each token (-1 on padding).
    behaviour_logprobs: [B, T] float32, log pi_behaviour(x_t | x_<t) in nats, 0 off-action.
    policy_versions: [B, T] int64, engine weight version per action token, -1 elsewhere.
    row_trajectory: [B] int64, index of the trajectory each row belongs to.
    node_rewards: [num_traj, N_max] float32, reward after each action node (0 past the end).
    num_nodes: [num_traj] int64, number of action nodes per trajectory.
    truncated: [num_traj] bool, the trajectory hit a step/turn/context budget mid-task: GAE
        bootstraps from V of its last state. False for a trajectory whose last action was cut
        at its token budget (see cut_action): that episode is over (the environment never saw
        the action, reward 0), so its return is the rewards it got and nothing is bootstrapped;
        bootstrapping there would pay the policy V(s) for running out of tokens.
    cut_action: [num_traj] bool, the last action was cut at its token budget
        (`ActionNode.truncated`, vLLM ``finish_reason == "length"``); None when not recorded
        (a batch built by hand).
    task_ids: list[str] of length num_traj; group_index: [num_traj] int64 (GRPO sample index).
    temperature: float, the sampling temperature shared by every trajectory in the batch.
    top_p, top_k: the engine's nucleus mass and top-k (1.0 / 0: off), shared likewise; the
        trainer scores log-probs under the same truncated distribution
        (`sao_megatron.models.logprobs.token_logprobs_and_entropy`).
    routed_experts: [B, T, num_layers, top_k] uint8/int16 or None, the experts the engine
        routed token t to in each layer (0 where not recorded); routing_mask: [B, T] bool,
        True where recorded (False on padding, on each sequence's last token, and on rows of
        trajectories without routing). Both None when no trajectory of the batch has routing
        (sao_megatron.rollout.routing; replayed by sao_megatron.models.routing_replay).
    """

    token_ids: torch.Tensor
    position_ids: torch.Tensor
    loss_mask: torch.Tensor
    action_mask: torch.Tensor
    node_index: torch.Tensor
    behaviour_logprobs: torch.Tensor
    policy_versions: torch.Tensor
    row_trajectory: torch.Tensor
    node_rewards: torch.Tensor
    num_nodes: torch.Tensor
    truncated: torch.Tensor
    task_ids: list[str]
    group_index: torch.Tensor
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    routed_experts: torch.Tensor | None = None
    routing_mask: torch.Tensor | None = None
    cut_action: torch.Tensor | None = None

    @property
    def has_routing(self) -> bool:
        return self.routed_experts is not None

    @property
    def num_rows(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def num_trajectories(self) -> int:
        return int(self.node_rewards.shape[0])

    @property
    def num_action_tokens(self) -> int:
        return int(self.action_mask.sum())

    def rows(self, index: torch.Tensor | slice) -> dict[str, torch.Tensor]:
        """The per-row tensors ([B, T] and [B]) restricted to `index` (a row selection)."""
        names = (
            "token_ids",
            "position_ids",
            "loss_mask",
            "action_mask",
            "node_index",
            "behaviour_logprobs",
            "policy_versions",
            "row_trajectory",
        )
        if self.routed_experts is not None:
            names += ("routed_experts", "routing_mask")
        return {n: getattr(self, n)[index] for n in names}


def _sequences(traj: Trajectory) -> list[TokenSequence]:
    if traj.context_mode == "full_history":
        return [traj.to_token_sequence()]
    return traj.to_node_sequences()


def pack_trajectories(
    trajectories: list[Trajectory],
    *,
    pad_token_id: int,
    max_seq_len: int,
    pad_to_multiple_of: int = 1,
) -> TrainBatch:
    """Pack trajectories into one right-padded `TrainBatch`.

    Args:
        trajectories: validated trajectories, all sampled with the same temperature, top_p and
            top_k.
        pad_token_id: token used for padding (never trained: masks are False there).
        max_seq_len: longest allowed row; a longer row raises ValueError (configure a context
            window or a larger model.max_position_embeddings).
        pad_to_multiple_of: pad T up to a multiple (TP with sequence parallel needs T % tp == 0).

    Raises:
        ValueError: empty input, mixed temperatures/top_p/top_k, a row longer than max_seq_len,
            or an action token at position 0 (a sequence must start with a prompt token).
    """
    if not trajectories:
        raise ValueError("pack_trajectories() got no trajectories")
    for name in ("temperature", "top_p", "top_k"):
        values = {getattr(t, name) for t in trajectories}
        if len(values) != 1:
            raise ValueError(
                f"trajectories in one batch were sampled at {name} {sorted(values)}; the "
                f"trainer scores all rows at one {name}: keep rollout.{name} fixed within a run"
            )
    rows: list[tuple[int, TokenSequence]] = []
    for ti, traj in enumerate(trajectories):
        for seq in _sequences(traj):
            if len(seq) > max_seq_len:
                raise ValueError(
                    f"trajectory {traj.task_id!r} has a row of {len(seq)} tokens > max_seq_len="
                    f"{max_seq_len}: use rollout.context_mode=window or a longer model context"
                )
            if bool(seq.action_mask[0]):
                raise ValueError(
                    f"trajectory {traj.task_id!r} starts with an action token: the first node "
                    "needs at least one prompt token"
                )
            rows.append((ti, seq))
    padded = pad_token_sequences(
        [seq for _, seq in rows], pad_token_id=pad_token_id, pad_to_multiple_of=pad_to_multiple_of
    )
    row_trajectory = torch.tensor([ti for ti, _ in rows], dtype=torch.long)
    num_traj = len(trajectories)
    max_nodes = max(len(t.nodes) for t in trajectories)
    node_rewards = torch.zeros((num_traj, max_nodes), dtype=torch.float32)
    for ti, traj in enumerate(trajectories):
        node_rewards[ti, : len(traj.nodes)] = torch.tensor([n.reward for n in traj.nodes])
    cuts = [bool(t.nodes[-1].truncated) for t in trajectories]
    return TrainBatch(
        **padded,
        row_trajectory=row_trajectory,
        node_rewards=node_rewards,
        num_nodes=torch.tensor([len(t.nodes) for t in trajectories], dtype=torch.long),
        truncated=torch.tensor(
            [t.truncated and not cut for t, cut in zip(trajectories, cuts, strict=True)],
            dtype=torch.bool,
        ),
        cut_action=torch.tensor(cuts, dtype=torch.bool),
        task_ids=[t.task_id for t in trajectories],
        group_index=torch.tensor([t.group_index for t in trajectories], dtype=torch.long),
        temperature=trajectories[0].temperature,
        top_p=trajectories[0].top_p,
        top_k=trajectories[0].top_k,
    )


def pad_token_sequences(
    seqs: list[TokenSequence], *, pad_token_id: int, pad_to_multiple_of: int = 1
) -> dict[str, torch.Tensor]:
    """Right-pad token sequences into [B, T] tensors (T = longest, rounded up to a multiple).

    Returns a dict with the per-row fields of `TrainBatch`: token_ids, position_ids, loss_mask,
    action_mask, node_index (-1 on padding), behaviour_logprobs, policy_versions (-1 on padding),
    and routed_experts / routing_mask when any sequence carries routing (sequences without it
    get routing_mask False). Also used for supervised (SFT) sequences, whose action mask marks
    the trained tokens.
    Raises ValueError when sequences carry routing of different [num_layers, top_k] or dtype.
    """
    if not seqs:
        raise ValueError("pad_token_sequences() got no sequences")
    seq_len = max(len(s) for s in seqs)
    seq_len = -(-seq_len // pad_to_multiple_of) * pad_to_multiple_of
    shape = (len(seqs), seq_len)
    out = {
        "token_ids": torch.full(shape, pad_token_id, dtype=torch.long),
        "position_ids": torch.zeros(shape, dtype=torch.long),
        "loss_mask": torch.zeros(shape, dtype=torch.bool),
        "action_mask": torch.zeros(shape, dtype=torch.bool),
        "node_index": torch.full(shape, -1, dtype=torch.long),
        "behaviour_logprobs": torch.zeros(shape, dtype=torch.float32),
        "policy_versions": torch.full(shape, -1, dtype=torch.long),
    }
    for r, seq in enumerate(seqs):
        n = len(seq)
        out["token_ids"][r, :n] = seq.token_ids
        out["position_ids"][r, :n] = torch.arange(n)
        out["loss_mask"][r, :n] = True
        out["action_mask"][r, :n] = seq.action_mask
        out["node_index"][r, :n] = seq.node_index
        out["behaviour_logprobs"][r, :n] = seq.behaviour_logprobs
        out["policy_versions"][r, :n] = seq.policy_versions
    routed = [s.routed_experts for s in seqs if s.routed_experts is not None]
    if routed:
        kinds = {(tuple(x.shape[1:]), x.dtype) for x in routed}
        if len(kinds) > 1:
            raise ValueError(
                f"sequences carry routed experts of different [num_layers, top_k]/dtype {kinds}: "
                "one batch must come from one model"
            )
        out["routed_experts"] = torch.zeros((*shape, *routed[0].shape[1:]), dtype=routed[0].dtype)
        out["routing_mask"] = torch.zeros(shape, dtype=torch.bool)
        for r, seq in enumerate(seqs):
            if seq.routed_experts is not None:
                n = len(seq)
                out["routed_experts"][r, :n] = seq.routed_experts
                out["routing_mask"][r, :n] = seq.routing_mask
    return out


def action_stream_index(batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each action token of the batch sits in its trajectory's compact action stream.

    Returns:
        stream_pos: [B, T] int64, position of the token in its trajectory's ordered action-token
            stream (-1 on non-action tokens). Rows of one trajectory follow each other in order.
        stream_len: [num_traj] int64, number of action tokens per trajectory.

    Use it to gather per-token values into [num_traj, A_max] streams for GAE and scatter the
    advantages back (see `gather_to_streams` / `scatter_from_streams`).
    """
    am = batch.action_mask.long()
    within_row = torch.cumsum(am, dim=1) - 1  # [B, T]
    row_counts = am.sum(dim=1)  # [B]
    num_traj = batch.num_trajectories
    # offset of each row inside its trajectory's stream = counts of earlier rows of same traj
    offsets = torch.zeros_like(row_counts)
    stream_len = torch.zeros(num_traj, dtype=torch.long)
    for r in range(batch.num_rows):  # rows, not tokens: cheap
        ti = int(batch.row_trajectory[r])
        offsets[r] = stream_len[ti]
        stream_len[ti] += row_counts[r]
    stream_pos = torch.where(batch.action_mask, within_row + offsets[:, None], -1)
    return stream_pos, stream_len


def gather_to_streams(batch: TrainBatch, per_token: torch.Tensor, fill: float = 0.0):
    """[B, T] per-token values -> ([num_traj, A_max] action streams, [num_traj, A_max] valid)."""
    stream_pos, stream_len = action_stream_index(batch)
    a_max = max(int(stream_len.max()), 1)
    out = torch.full((batch.num_trajectories, a_max), fill, dtype=per_token.dtype)
    valid = torch.zeros((batch.num_trajectories, a_max), dtype=torch.bool)
    traj = batch.row_trajectory[:, None].expand_as(stream_pos)
    m = batch.action_mask
    out[traj[m], stream_pos[m]] = per_token[m]
    valid[traj[m], stream_pos[m]] = True
    return out, valid


def scatter_from_streams(batch: TrainBatch, streams: torch.Tensor) -> torch.Tensor:
    """[num_traj, A_max] stream values -> [B, T] per-token tensor (0 off-action)."""
    stream_pos, _ = action_stream_index(batch)
    out = torch.zeros(batch.token_ids.shape, dtype=streams.dtype)
    traj = batch.row_trajectory[:, None].expand_as(stream_pos)
    m = batch.action_mask
    out[m] = streams[traj[m], stream_pos[m]]
    return out


__all__ = [
    "TrainBatch",
    "pack_trajectories",
    "pad_token_sequences",
    "action_stream_index",
    "gather_to_streams",
    "scatter_from_streams",
]
