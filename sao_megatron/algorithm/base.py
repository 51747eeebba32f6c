"""The algorithm interface: what the trainer asks an RL algorithm (and nothing else).

An algorithm object answers, for the trainer (`sao_megatron.trainer.rl_step.RLStep`):

* ``needs_value_model``: build and train a critic (and allow value pre-training);
* ``group_size``: trajectories the rollout samples per task (1 = single trajectory);
* ``keeps_groups_together``: data-parallel sharding keeps a task's trajectories on one rank
  (group statistics stay local);
* ``schedule``: the phases of one train step, in order (`Phase`);
* ``advantages(inputs)``: advantages (and, with a critic, value targets) at token positions;
  ``inputs.reducer`` sums over the ranks holding the rest of the batch, for batch statistics
  (whitening);
* ``value_targets(inputs)``: value targets that need no value forward (`ValueTargets`), or None;
* ``policy_loss(...)``: the scalar policy loss of one micro-batch;
* ``state_dict()`` / ``load_state_dict()``: state carried across steps (checkpointed; none by
  default).

Config validation asks the class for ``default_importance``, ``importance_weightings`` (the
behaviour-correction schemes its loss accepts), ``config_sections`` (the parts of
`AlgorithmConfig` it reads; a non-default value elsewhere is an error) and
``ppo_weightings`` (the weightings with which it reads ``algorithm.ppo``, named in that error).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from .advantages import LOCAL_BATCH, AdvantageOutput, BatchReducer, masked_whiten

if TYPE_CHECKING:
    from .config import AlgorithmConfig


class Phase(enum.Enum):
    """One piece of work of a train step; RLStep runs them in `Algorithm.schedule` order."""

    VALUE_TARGETS = "value_targets"
    """the value targets (returns) of the batch with the critic before its updates; a value
    forward without grad (V_old) only when the targets need values (`Algorithm.value_targets`
    is None) or a bootstrap value cannot be read from the first update's forward."""
    VALUE_UPDATE = "value_update"
    """one optimiser step of the value model on V_old / returns (clipped value loss); without a
    VALUE_TARGETS forward the first update's own forward gives V_old (and the bootstrap)."""
    OLD_LOGPROBS = "old_logprobs"
    """policy forward without grad: l_old, the log-probs before this update (PPO's pi_old)."""
    ADVANTAGES = "advantages"
    """the policy advantages (with the critic as it is now, if the algorithm has one)."""
    POLICY_UPDATE = "policy_update"
    """one optimiser step of the policy on `Algorithm.policy_loss`."""

    @property
    def timer(self) -> str:
        """The ``time/<timer>`` metric this phase's seconds are added to."""
        return {
            Phase.VALUE_TARGETS: "value",
            Phase.VALUE_UPDATE: "value",
            Phase.OLD_LOGPROBS: "old_logprobs",
            Phase.ADVANTAGES: "advantages",
            Phase.POLICY_UPDATE: "policy",
        }[self]


@dataclass(kw_only=True)
class AdvantageInputs:
    """What an algorithm may read to compute advantages (one trajectory per row).

    node_rewards: [B, N] float, reward after each action node (0 on padding nodes).
    node_index: [B, T] int64, action node of each token (read on action tokens).
    action_mask: [B, T] bool, tokens the policy sampled.
    values: [B, T] float V(s_t) before each token, or None (no value model / not computed).
    truncated: [B] bool, the episode hit its budget; None = none truncated.
    bootstrap_values: [B] float V of the state after the last action (for truncated rows).
    group_ids: [B] int64, rows with equal id were sampled for the same task.
    reducer: sums over every rank that holds other trajectories of the batch (`BatchReducer`;
        the trainer's data-parallel group, `LOCAL_BATCH` on one rank). A statistic over the
        batch (a mean, a std) must reduce its sums with it, so that it is the global batch's
        at any data-parallel size; per-trajectory math and group statistics (whole groups stay
        on one rank with ``keeps_groups_together``) need none.
    """

    node_rewards: torch.Tensor
    node_index: torch.Tensor
    action_mask: torch.Tensor
    values: torch.Tensor | None = None
    truncated: torch.Tensor | None = None
    bootstrap_values: torch.Tensor | None = None
    group_ids: torch.Tensor | None = None
    reducer: BatchReducer = LOCAL_BATCH


@dataclass(kw_only=True)
class ValueTargets:
    """Value targets that need no value forward: linear in the bootstrap value only,

        R[b, t] = base[b, t] + bootstrap_coef[b, t] * V_last[b]

    with V_last[b] = V(state after row b's last action), the bootstrap of a truncated row.
    base: [B, T] float64, the targets with V_last = 0 (discounted reward-to-go).
    bootstrap_coef: [B, T] float64, dR/dV_last (gamma^(steps to the end) on rows that bootstrap,
        0 on the others); all zero when no row bootstraps.
    value_mask: [B, T] bool, where the value loss is taken.
    """

    base: torch.Tensor
    bootstrap_coef: torch.Tensor
    value_mask: torch.Tensor


class Algorithm:
    """Base class of a registered RL algorithm (see the module docstring for the contract).

    Args:
        config: the validated ``algorithm`` section (its ``name`` is this class's ``name``).
    """

    name: ClassVar[str] = ""
    needs_value_model: ClassVar[bool] = False
    keeps_groups_together: ClassVar[bool] = False
    default_importance: ClassVar[str] = "none"
    importance_weightings: ClassVar[tuple[str, ...]] = ("none",)
    #: the weightings with which `config_sections` includes "ppo" (empty: it always does, or
    #: never); the config's error for a stray ``algorithm.ppo`` key names them
    ppo_weightings: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config: AlgorithmConfig) -> None:
        if config.name != self.name:
            raise ValueError(
                f"algorithm.name={config.name!r} given to {type(self).__name__} "
                f"(registered as {self.name!r}); build it with registry.build(config)"
            )
        self.config = config

    def state_dict(self) -> dict:
        """State the algorithm carries across train steps (e.g. an adaptive coefficient),
        saved with every RL checkpoint as the Stateful ``algorithm`` (rank 0's) and given back
        to `load_state_dict` on resume. The built-in algorithms carry none: {}."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` returned (called on every rank when a run resumes)."""
        if state:
            raise ValueError(
                f"algorithm {self.name!r}: the checkpoint holds algorithm state "
                f"{sorted(state)} but {type(self).__name__} defines no load_state_dict; "
                "resume with the algorithm that wrote it"
            )

    @classmethod
    def config_sections(cls, config: AlgorithmConfig) -> set[str]:
        """Parts of `config` this algorithm reads (of "sao", "grpo", "ppo", "importance")."""
        raise NotImplementedError

    @property
    def group_size(self) -> int:
        """Trajectories sampled per task (1: one trajectory per task)."""
        return 1

    @property
    def schedule(self) -> tuple[Phase, ...]:
        """The phases of one train step, in order."""
        raise NotImplementedError

    def compute_advantages(self, inputs: AdvantageInputs) -> AdvantageOutput:
        """Advantages [B, T] (0 off the action mask), before whitening."""
        raise NotImplementedError

    def advantages(self, inputs: AdvantageInputs) -> AdvantageOutput:
        """`compute_advantages`, then, with ``algorithm.whiten_advantages``, `masked_whiten`
        over the action tokens of the global batch: every rank's share under
        ``inputs.reducer`` (pass this rank's whole share, not one micro-batch)."""
        out = self.compute_advantages(inputs)
        if self.config.whiten_advantages:
            mask = inputs.action_mask.to(torch.bool)
            out.advantages = masked_whiten(out.advantages, mask, reducer=inputs.reducer)
        return out

    def value_targets(self, inputs: AdvantageInputs) -> ValueTargets | None:
        """Value targets computed without values (inputs.values is not read), or None when the
        targets depend on V (then the trainer runs a value forward and takes them from
        `advantages`). Default None; algorithms without a critic never get asked."""
        return None

    def policy_loss(
        self,
        *,
        logprobs: torch.Tensor,
        behaviour_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        action_mask: torch.Tensor,
        old_logprobs: torch.Tensor | None = None,
        num_tokens: int | torch.Tensor | None = None,
        num_sequences: int | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Scalar policy loss (no entropy term) of a micro-batch; all tensors [B, T].

        logprobs: l_theta with grad; behaviour_logprobs: l_b from the rollout engine;
        old_logprobs: l_old from the OLD_LOGPROBS phase (only if the schedule has it);
        num_tokens / num_sequences: global denominators (see losses.aggregate).
        """
        raise NotImplementedError
