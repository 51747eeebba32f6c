"""Value pre-training: critic-only updates on rollouts of the frozen policy, until the critic is
ready (held-out explained variance at a target) or a step cap.

The stage (`ValuePretrain.run`, on every rank; docs/TRAINING.md "Value pre-training"):

1. with ``value_pretrain.target_explained_variance`` set, the held-out set, once, before the
   first update: the first ``num_heldout_trajectories`` trajectories the rollout hands out
   (whole batches pulled, what is left of the last one dropped), or more whole batches while
   their returns are all equal (up to `MAX_HELDOUT_FACTOR` times as many: explained variance
   needs returns that vary). It lives in the run state
   (`RLRunState.value_pretrain_heldout`), which every RL checkpoint saves, so a resumed run
   evaluates on the same set; a training batch never holds a held-out task (filtered by task
   id, which also covers a task drawn again after a resume);
2. per step: the next rollout batch -> the algorithm's value phases (`RLStep.value_step`), the
   policy untouched;
3. every ``eval_interval`` updates and after the last one: the held-out fit (`RLStep.value_eval`:
   EV = 1 - Var(R - V) / Var(R) over the held-out value-masked tokens of the global batch, R the
   algorithm's value targets, one no-grad value forward);
4. the stop rule (`stop_reason`): the first evaluation with EV >= the target ("target_reached"),
   else the cap ``steps`` ("step_cap"); without a target exactly ``steps`` updates
   ("fixed_steps"), no held-out set and no evaluation: the stage as it was before targets.

Metrics go to run_dir/value_pretrain/metrics.jsonl, one record per update; an evaluation adds
``value_pretrain/heldout_explained_variance`` (and ``_mse``, ``_num_tokens``) to its update's
record. `run` returns the summary entries: ``value_pretrain/stop_reason``,
``value_pretrain/steps``, ``value_pretrain/heldout_explained_variance`` (the last evaluation).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from sao_megatron.data.batch import TrainBatch
from sao_megatron.data.trajectory import Trajectory
from sao_megatron.trainer.job import ValuePretrainConfig
from sao_megatron.trainer.metrics import MetricsLogger, episode_metrics
from sao_megatron.trainer.run_state import RLRunState

log = logging.getLogger("sao_megatron.trainer")

TARGET_REACHED = "target_reached"  # an evaluation reached target_explained_variance
STEP_CAP = "step_cap"  # `steps` updates with a target, none of whose evaluations reached it
FIXED_STEPS = "fixed_steps"  # `steps` updates, no target
#: metrics.jsonl / summary key of the held-out explained variance
HELDOUT_EV = "value_pretrain/heldout_explained_variance"


class ValueStep(Protocol):
    """What the stage needs of the RL step (`RLStep`, `SeparateCriticStep`)."""

    def value_step(self, batch: TrainBatch, fit_after: bool = False) -> dict[str, float]: ...

    def value_eval(self, batch: TrainBatch) -> dict[str, float]: ...


def evaluates_at(cfg: ValuePretrainConfig, steps_done: int) -> bool:
    """Whether the held-out set is evaluated after update `steps_done` (1-based): with a
    target, every ``eval_interval`` updates and at the cap."""
    return cfg.has_target and (steps_done % cfg.eval_interval == 0 or steps_done >= cfg.steps)


#: the held-out set grows to at most this many times ``num_heldout_trajectories`` while its
#: returns are all equal (`ValuePretrain._draw_heldout`)
MAX_HELDOUT_FACTOR = 4


def returns_vary(trajectories: list[Trajectory]) -> bool:
    """Whether the reward-to-go of the trajectories' action nodes takes two values or more
    (gamma = 1: node k's is the sum of the rewards of nodes k..end), i.e. whether an explained
    variance on them is defined (up to bootstrap values of truncated trajectories)."""
    seen: set[float] = set()
    for t in trajectories:
        togo = 0.0
        for node in reversed(t.nodes):
            togo += node.reward
            seen.add(round(togo, 9))
            if len(seen) > 1:
                return True
    return False


def stop_reason(cfg: ValuePretrainConfig, steps_done: int, heldout_ev: float | None) -> str | None:
    """Why the stage ends after `steps_done` updates, or None to go on.

    `heldout_ev`: the held-out explained variance measured after this update, None when it was
    not evaluated (NaN, undefined for constant returns, never reaches the target).
    """
    target = cfg.target_explained_variance
    if cfg.has_target and heldout_ev is not None and heldout_ev >= target:
        return TARGET_REACHED
    if steps_done >= cfg.steps:
        return STEP_CAP if cfg.has_target else FIXED_STEPS
    return None


class ValuePretrain:
    """The value pre-training stage of one job, on this rank (construct on every rank).

    Args:
        cfg: the ``value_pretrain`` section (a default one when the stage is not listed).
        step_fn: the RL step (its value phases run, the policy's do not).
        run: the RL run state: its step counter, stop reason and held-out set are updated.
        next_trajectories: version -> the next rollout batch's trajectories on every rank
            (rank 0 pulls, the world receives; a collective).
        pack: trajectories -> the packed `TrainBatch` the step trains on.
        gather_metrics: metrics of this rank -> the last pipeline stage's (they live there).
        logger: (total steps, initial step) -> the stage's `MetricsLogger`.
        group_size: trajectories per task of the algorithm (held-out groups stay whole).
    The logger's rank (rank 0) writes the log lines.
    """

    def __init__(
        self,
        cfg: ValuePretrainConfig,
        step_fn: ValueStep,
        run: RLRunState,
        *,
        next_trajectories: Callable[[int], list[Trajectory]],
        pack: Callable[[list[Trajectory]], TrainBatch],
        gather_metrics: Callable[[dict[str, float]], dict[str, float]],
        logger: Callable[[int, int], MetricsLogger],
        group_size: int = 1,
    ) -> None:
        self.cfg, self.step_fn, self.run_state = cfg, step_fn, run
        self._next, self._pack, self._gather = next_trajectories, pack, gather_metrics
        self._logger, self.group_size = logger, group_size
        self.rank0 = False  # the logger's rank writes the log lines (set by `run`)

    def steps_left(self) -> int:
        """Updates still to run: ``steps`` minus those done; with a target none once an
        evaluation reached it or RL has started (a raised cap continues a "step_cap" stage)."""
        cfg, run = self.cfg, self.run_state
        if cfg.has_target and (run.step > 0 or run.value_pretrain_stop_reason == TARGET_REACHED):
            return 0
        return cfg.steps - run.value_pretrain_steps

    def run(self) -> dict[str, float | str]:
        """Run the stage to its stop; returns the summary entries ({} when nothing ran)."""
        cfg, run = self.cfg, self.run_state
        with self._logger(cfg.steps, run.value_pretrain_steps) as logger:
            self.rank0 = logger.enabled
            if self.steps_left() <= 0:
                if cfg.steps and run.value_pretrain_stop_reason and self.rank0:
                    log.info(
                        "value pre-training ended earlier (%s after %d steps): not run again",
                        run.value_pretrain_stop_reason,
                        run.value_pretrain_steps,
                    )
                return {}
            self._warn_ignored()
            heldout = self._heldout() if cfg.has_target else None
            held_ids = {t.task_id for t in run.value_pretrain_heldout or ()}
            reason, ev = None, None
            while reason is None:
                batch = self._pack(self._training_trajectories(held_ids))
                run.value_pretrain_steps += 1  # separate: the critic trains, the policy ranks
                m = self._gather(self.step_fn.value_step(batch))  # receive its metrics
                m = m | episode_metrics(batch)
                evaluated = evaluates_at(cfg, run.value_pretrain_steps)
                if evaluated:
                    fit = self._gather(self.step_fn.value_eval(heldout))
                    m |= {f"value_pretrain/heldout_{k.split('/', 1)[1]}": v for k, v in fit.items()}
                    ev = fit["value/explained_variance"]
                    self._log_eval(ev)
                reason = stop_reason(cfg, run.value_pretrain_steps, ev if evaluated else None)
                logger.log(run.value_pretrain_steps, m, force=evaluated)
        run.value_pretrain_stop_reason = reason
        self._log_stop(reason, ev)
        out: dict[str, float | str] = {
            "value_pretrain/stop_reason": reason,
            "value_pretrain/steps": float(run.value_pretrain_steps),
        }
        if cfg.has_target:
            out[HELDOUT_EV] = ev
        return out

    # ------------------------------------------------------------------ held-out set
    def _heldout(self) -> TrainBatch:
        """The packed held-out set: the run state's (a resumed run), else drawn now."""
        run, cfg = self.run_state, self.cfg
        if run.value_pretrain_heldout is None:
            run.value_pretrain_heldout = self._draw_heldout()
        elif self.rank0:
            log.info(
                "value pre-training: evaluating on the checkpoint's held-out set (%d trajectories)",
                len(run.value_pretrain_heldout),
            )
        if self.rank0:
            log.info(
                "value pre-training: until held-out explained variance >= %g (evaluated every "
                "%d updates) or %d updates",
                cfg.target_explained_variance,
                cfg.eval_interval,
                cfg.steps,
            )
        return self._pack(run.value_pretrain_heldout)

    def _draw_heldout(self) -> list[Trajectory]:
        """The held-out set: the first ``num_heldout_trajectories`` trajectories of the rollout
        (whole batches pulled; the rest of the last batch is dropped: neither trained on nor held
        out) when their returns vary; otherwise more whole batches, all kept, until they vary or
        `MAX_HELDOUT_FACTOR` times as many were drawn. Explained variance is undefined on
        returns that are all equal (a sparse 0/1 reward whose first draws all failed: the
        quickstart's 16 held-out trajectories from a 12.5% policy did), and a stage that can
        never evaluate its target runs to its cap; that case is logged as a warning."""
        n = self.cfg.num_heldout_trajectories
        if n % self.group_size:
            raise ValueError(
                f"value_pretrain.num_heldout_trajectories={n} is not a multiple of the "
                f"algorithm's group size {self.group_size}: held-out groups stay whole; use a "
                "multiple of it"
            )
        drawn: list[Trajectory] = []
        batches = 0
        while len(drawn) < n:
            drawn += self._next(self.run_state.policy_version)
            batches += 1
        kept = drawn[:n]
        if not returns_vary(kept):
            kept = drawn
            while not returns_vary(kept) and len(kept) < MAX_HELDOUT_FACTOR * n:
                kept += self._next(self.run_state.policy_version)
                batches += 1
        if self.rank0:
            log.info(
                "value pre-training: held out %d trajectories of the frozen policy (%d rollout "
                "batches, %d trajectories dropped; mean return %.4g), never trained on",
                len(kept),
                batches,
                max(len(drawn) - n, 0) if kept is not drawn else 0,
                sum(t.total_reward for t in kept) / len(kept),
            )
            if not returns_vary(kept):
                log.warning(
                    "value pre-training: the %d held-out trajectories all have return %.4g: "
                    "explained variance is undefined on them, so the target %g cannot be "
                    "reached and the stage runs to its cap value_pretrain.steps=%d; raise "
                    "value_pretrain.num_heldout_trajectories (the policy rarely succeeds) or "
                    "give the task a denser reward",
                    len(kept),
                    kept[0].total_reward,
                    self.cfg.target_explained_variance,
                    self.cfg.steps,
                )
        return kept

    def _training_trajectories(self, held_ids: set[str]) -> list[Trajectory]:
        """The next batch's trajectories without held-out tasks (only a task drawn again after
        a resume can be one)."""
        trajs = self._next(self.run_state.policy_version)
        kept = [t for t in trajs if t.task_id not in held_ids]
        if len(kept) < len(trajs) and self.rank0:
            log.warning(
                "value pre-training: %d trajectories of held-out tasks left out of a training "
                "batch (tasks drawn again after a resume)",
                len(trajs) - len(kept),
            )
        return kept

    # ------------------------------------------------------------------ log lines
    def _warn_ignored(self) -> None:
        cfg, default = self.cfg, ValuePretrainConfig()
        ignored = [
            f"value_pretrain.{name}={getattr(cfg, name)}"
            for name in ("eval_interval", "num_heldout_trajectories")
            if getattr(cfg, name) != getattr(default, name)
        ]
        if ignored and not cfg.has_target and self.rank0:
            log.warning(
                "%s ignored: no value_pretrain.target_explained_variance, so no held-out set "
                "and no evaluation (set a target to use them)",
                ", ".join(ignored),
            )

    def _log_eval(self, ev: float) -> None:
        if self.rank0:
            log.info(
                "value pre-training step %d/%d: held-out explained variance %.4f (target %g)",
                self.run_state.value_pretrain_steps,
                self.cfg.steps,
                ev,
                self.cfg.target_explained_variance,
            )

    def _log_stop(self, reason: str, ev: float | None) -> None:
        if not self.rank0:
            return
        steps, target = self.run_state.value_pretrain_steps, self.cfg.target_explained_variance
        if reason == TARGET_REACHED:
            why = f"held-out explained variance {ev:.4f} >= target {target:g}"
        elif reason == STEP_CAP:
            why = f"the cap value_pretrain.steps; held-out explained variance {ev:.4f} < {target:g}"
        else:
            why = "value_pretrain.steps, no target"
        log.info("value pre-training ended (%s) after %d steps: %s", reason, steps, why)
