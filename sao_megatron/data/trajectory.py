"""The trajectory contract between the rollout engine, the buffer and the trainer.

A `Trajectory` is one episode of an agent against an environment: an ordered list of
`ActionNode`s (agent turns). Each node records the tokens the policy generated (the action),
the behaviour policy's log-probability and weight version for every one of those tokens, and the
reward the environment returned after the action.

Token layout (see docs/ARCHITECTURE.md, "Trajectory contract"):

* ``observation_token_ids`` of node n are the tokens appended to the context *before* action n
  and *after* action n-1: the prompt for node 0, the environment's observation text for later
  nodes. They are never trained on (action mask 0).
* ``action_token_ids`` are exactly the tokens the engine sampled, stop token(s) included. They are
  not re-tokenised from text (token-in, token-out), so behaviour log-probs line up one to one.
* With ``context_mode == "full_history"`` the whole trajectory is one token sequence
  ``obs_0 act_0 obs_1 act_1 ...`` and node n was sampled with everything before ``act_n`` as its
  prompt. With ``context_mode == "window"`` node n was sampled with ``context_token_ids`` (a window
  the environment/formatter chose) as its whole prompt; each node is then its own sequence, and the
  order of action tokens across nodes still defines the trajectory for GAE.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch

ContextMode = Literal["full_history", "window"]


@dataclass(kw_only=True)
class ActionNode:
    """One agent turn: new context tokens, the sampled action tokens and the reward after it.

    Fields:
        observation_token_ids: tokens appended to the context just before this action (the prompt
            for node 0, the environment observation for later nodes). Length >= 0.
        action_token_ids: the sampled tokens, stop token included. Length >= 1.
        behaviour_logprobs: log pi_behaviour(a_t | s_t) in nats for each action token, under the
            sampling temperature recorded on the trajectory. Same length as action_token_ids.
        policy_versions: weight version of the engine that sampled each action token (an engine
            may be updated mid-action). Same length as action_token_ids.
        reward: scalar reward returned by the environment after this action.
        context_token_ids: the full prompt the engine saw, only in "window" context mode (None in
            "full_history" mode, where the prompt is the trajectory prefix).
        action_text: decoded action, kept for logs and debugging.
        truncated: the engine cut this action at its token budget (vLLM ``finish_reason ==
            "length"``) before a stop token. Any node may be cut. The text runner ends the
            episode there: the cut action is the last node, never passed to the environment
            (reward 0), and the trajectory is `Trajectory.truncated`. An agent behind the
            gateway sees ``finish_reason: "length"`` and may go on: a cut node in the middle
            of an episode is then an ordinary step (the episode continued from the state its
            tokens made, so GAE runs through it as through any node). Either way a trajectory
            whose last node is cut is not bootstrapped (`TrainBatch.truncated` False,
            `TrainBatch.cut_action` True): bootstrapping there would pay the policy V(s) for
            running out of tokens.
        routed_experts: [m, num_layers, top_k] uint8/int16 expert indices the engine routed
            each token of this node's sequence segment to (full history: observation then
            action tokens; window: context then action tokens), for the first m tokens of the
            segment: m is the segment length, or one less where the segment ends a sequence
            the engine never forwarded to its end (the last sampled token). None when the
            rollout recorded no routing (`rollout.record_routing`; sao_megatron.rollout.routing).
    """

    observation_token_ids: list[int]
    action_token_ids: list[int]
    behaviour_logprobs: list[float]
    policy_versions: list[int]
    reward: float = 0.0
    context_token_ids: list[int] | None = None
    action_text: str = ""
    truncated: bool = False
    routed_experts: torch.Tensor | None = None

    def segment_length(self) -> int:
        """Tokens of this node's sequence segment (see ``routed_experts``)."""
        ctx = (
            self.observation_token_ids if self.context_token_ids is None else self.context_token_ids
        )
        return len(ctx) + len(self.action_token_ids)

    def validate(self, where: str = "ActionNode") -> None:
        """Raise ValueError naming the field if the node is inconsistent or holds NaN/inf."""
        n = len(self.action_token_ids)
        if n == 0:
            raise ValueError(f"{where}.action_token_ids is empty: an action has at least one token")
        if len(self.behaviour_logprobs) != n:
            raise ValueError(
                f"{where}.behaviour_logprobs has {len(self.behaviour_logprobs)} entries for {n} "
                "action tokens: the engine must return one log-prob per sampled token"
            )
        if len(self.policy_versions) != n:
            raise ValueError(
                f"{where}.policy_versions has {len(self.policy_versions)} entries for {n} "
                "action tokens: record the engine's weight version for every sampled token"
            )
        for lp in self.behaviour_logprobs:
            if not (math.isfinite(lp) and lp <= 1e-6):
                raise ValueError(
                    f"{where}.behaviour_logprobs holds {lp!r}: log-probs must be finite and <= 0"
                )
        if not math.isfinite(self.reward):
            raise ValueError(f"{where}.reward is {self.reward!r}: rewards must be finite numbers")
        re = self.routed_experts
        if re is not None:
            seg = self.segment_length()
            if re.dim() != 3 or re.dtype not in (torch.uint8, torch.int16) or re.shape[0] > seg:
                raise ValueError(
                    f"{where}.routed_experts is {re.dtype} {tuple(re.shape)}: expected uint8/int16 "
                    f"[m <= {seg}, num_layers, top_k] (one row per token of the node's segment)"
                )


@dataclass(kw_only=True)
class Trajectory:
    """One episode: ordered action nodes plus how it ended and how it was sampled.

    Fields:
        task_id: identifies the task (`sao_megatron.envs.base.task_id`: environment name +
            seed); GRPO groups by it.
        nodes: the agent turns in order.
        terminated: the environment ended the episode (success, failure, illegal move).
        truncated: the episode hit its step/token budget; GAE then bootstraps from V(last state),
            unless its last node is a cut action (`ActionNode.truncated`).
        temperature, top_p, top_k: sampling settings (top_p 1.0 and top_k 0: off), so the
            trainer scores under the same distribution.
        context_mode: "full_history" or "window" (see module docstring).
        group_index: sample index within a GRPO group (0 for SAO's single trajectory).
        info: free-form episode facts for metrics (success flag, env name, ...).
        status: how the episode ended (`sao_megatron.rollout.status.EpisodeStatus` value); only
            "completed" and "truncated" trajectories are trained (validate() refuses others).
    """

    task_id: str
    nodes: list[ActionNode] = field(default_factory=list)
    terminated: bool = False
    truncated: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    context_mode: ContextMode = "full_history"
    group_index: int = 0
    info: dict = field(default_factory=dict)
    status: str = "completed"

    # ----------------------------------------------------------------------------------------
    @property
    def num_action_tokens(self) -> int:
        return sum(len(n.action_token_ids) for n in self.nodes)

    @property
    def total_reward(self) -> float:
        return float(sum(n.reward for n in self.nodes))

    @property
    def min_policy_version(self) -> int:
        return min(v for n in self.nodes for v in n.policy_versions)

    @property
    def max_policy_version(self) -> int:
        return max(v for n in self.nodes for v in n.policy_versions)

    def validate(self) -> None:
        """Raise ValueError naming the bad field; called by the buffer before admitting it."""
        if not self.nodes:
            raise ValueError(f"Trajectory {self.task_id!r} has no action nodes")
        if self.status not in ("completed", "truncated"):
            raise ValueError(
                f"Trajectory[{self.task_id!r}].status={self.status!r}: only completed or truncated "
                "episodes are trained (failures are requeued or dropped, never reward 0)"
            )
        if self.context_mode not in ("full_history", "window"):
            raise ValueError(
                f"Trajectory.context_mode={self.context_mode!r}: use 'full_history' or 'window'"
            )
        if not (self.temperature > 0):
            raise ValueError(f"Trajectory.temperature={self.temperature}: must be > 0")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"Trajectory.top_p={self.top_p}: must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"Trajectory.top_k={self.top_k}: must be >= 0 (0 = off)")
        for i, node in enumerate(self.nodes):
            node.validate(where=f"Trajectory[{self.task_id!r}].nodes[{i}]")
            if self.context_mode == "window" and node.context_token_ids is None:
                raise ValueError(
                    f"Trajectory[{self.task_id!r}].nodes[{i}].context_token_ids is None in "
                    "'window' context mode: record the prompt the engine was given"
                )
        shapes = {
            None
            if n.routed_experts is None
            else (tuple(n.routed_experts.shape[1:]), n.routed_experts.dtype)
            for n in self.nodes
        }
        if len(shapes) > 1:
            raise ValueError(
                f"Trajectory[{self.task_id!r}]: nodes disagree on routed_experts ({shapes}): "
                "record routing for every node with the same [num_layers, top_k] and dtype, or none"
            )

    @property
    def has_routing(self) -> bool:
        """True when every node carries its routed experts (`ActionNode.routed_experts`)."""
        return bool(self.nodes) and all(n.routed_experts is not None for n in self.nodes)

    def to_token_sequence(self) -> TokenSequence:
        """Flatten a full-history trajectory into one sequence with per-token annotations.

        Returns a `TokenSequence` of length T = sum(len(obs_n) + len(act_n)).
        Raises ValueError for window-mode trajectories (use `to_node_sequences`).
        """
        if self.context_mode != "full_history":
            raise ValueError(
                "to_token_sequence() needs context_mode='full_history'; windowed trajectories "
                "are one sequence per node: use to_node_sequences()"
            )
        ids: list[int] = []
        mask: list[int] = []
        node_index: list[int] = []
        blp: list[float] = []
        ver: list[int] = []
        routing = _RoutingRows(self.nodes)
        for i, node in enumerate(self.nodes):
            routing.add(node, len(ids))
            k = len(node.observation_token_ids)
            ids += node.observation_token_ids
            mask += [0] * k
            node_index += [i] * k
            blp += [0.0] * k
            ver += [-1] * k
            m = len(node.action_token_ids)
            ids += node.action_token_ids
            mask += [1] * m
            node_index += [i] * m
            blp += node.behaviour_logprobs
            ver += node.policy_versions
        return TokenSequence(
            token_ids=torch.tensor(ids, dtype=torch.long),
            action_mask=torch.tensor(mask, dtype=torch.bool),
            node_index=torch.tensor(node_index, dtype=torch.long),
            behaviour_logprobs=torch.tensor(blp, dtype=torch.float32),
            policy_versions=torch.tensor(ver, dtype=torch.long),
            **routing.finish(len(ids)),
        )

    def to_node_sequences(self) -> list[TokenSequence]:
        """One sequence per node (window mode): context_token_ids + action tokens."""
        out = []
        for i, node in enumerate(self.nodes):
            ctx = node.context_token_ids
            if ctx is None:
                raise ValueError(f"nodes[{i}].context_token_ids is None: not a windowed trajectory")
            k, m = len(ctx), len(node.action_token_ids)
            routing = _RoutingRows([node])
            routing.add(node, 0)
            out.append(
                TokenSequence(
                    token_ids=torch.tensor(ctx + node.action_token_ids, dtype=torch.long),
                    action_mask=torch.tensor([0] * k + [1] * m, dtype=torch.bool),
                    node_index=torch.full((k + m,), i, dtype=torch.long),
                    behaviour_logprobs=torch.tensor(
                        [0.0] * k + node.behaviour_logprobs, dtype=torch.float32
                    ),
                    policy_versions=torch.tensor([-1] * k + node.policy_versions, dtype=torch.long),
                    **routing.finish(k + m),
                )
            )
        return out


class _RoutingRows:
    """Lays the nodes' routed experts out along a sequence (rows + validity mask)."""

    def __init__(self, nodes: list[ActionNode]) -> None:
        self.parts = [] if all(n.routed_experts is not None for n in nodes) and nodes else None

    def add(self, node: ActionNode, offset: int) -> None:
        if self.parts is not None:
            self.parts.append((offset, node.routed_experts))

    def finish(self, length: int) -> dict[str, torch.Tensor]:
        if self.parts is None:
            return {}
        first = self.parts[0][1]
        rows = torch.zeros((length, *first.shape[1:]), dtype=first.dtype)
        valid = torch.zeros(length, dtype=torch.bool)
        for offset, r in self.parts:
            rows[offset : offset + r.shape[0]] = r
            valid[offset : offset + r.shape[0]] = True
        return {"routed_experts": rows, "routing_mask": valid}


@dataclass(kw_only=True)
class TokenSequence:
    """A flat token sequence with per-token training annotations (all tensors length T).

    token_ids: [T] int64; action_mask: [T] bool (True on sampled tokens);
    node_index: [T] int64 (action node of each token); behaviour_logprobs: [T] float32
    (0 off-action); policy_versions: [T] int64 (-1 off-action).
    routed_experts: [T, num_layers, top_k] uint8/int16, the experts the engine routed token t
    to (0 where not recorded); routing_mask: [T] bool, True where recorded. Both None when the
    trajectory carries no routing.
    """

    token_ids: torch.Tensor
    action_mask: torch.Tensor
    node_index: torch.Tensor
    behaviour_logprobs: torch.Tensor
    policy_versions: torch.Tensor
    routed_experts: torch.Tensor | None = None
    routing_mask: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.token_ids.numel())
