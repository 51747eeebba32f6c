"""Job fields derived from others unless the config sets them: the seeds from ``seed``, the
rollout engine's context length and dtype from the model and the precision.

One meaning, one key. A job has one seed, ``seed``; when the YAML file and the overrides leave
them out, the others follow from it:

====================== ========================================= ==============================
field                  derived value                             seed=0 (the shipped configs)
====================== ========================================= ==============================
parallel.seed          1234 + seed (Megatron/torch RNG: init)    1234
tasks.train_seed       seed (the training task stream)           0
rollout.seed           seed (per-request sampling seeds)         0
rollout.max_model_len  model.max_position_embeddings             (the model's)
rollout.dtype          the precision's: fp32 -> float32, bf16 -> (the precision's)
                       bfloat16, fp16 -> float16; precision.fp8
                       -> bfloat16 (vLLM serves the exported
                       weights, not TE's FP8 GEMMs)
====================== ========================================= ==============================

``tasks.eval_seed`` is not derived: the held-out set is the same for every seed, so runs of
different seeds are evaluated on the same tasks and compare.

A field the config sets (the YAML file or an override names it, whatever its value:
`sao_megatron.configs.explicit_fields`) is kept; one that differs from its derived value is
listed in the job's `DerivedSetting` records and logged once at start-up
(``parallel.seed=7 set explicitly (derived from seed=0: 1234)``). Allowed on purpose: another
RNG seed, ``rollout.seed: null`` (engine randomness), a shorter engine context, an engine dtype
other than the trainer's (bf16 rollouts of an fp32 trainer, docs/BENCHMARKS.md). Refused: a
``rollout.max_model_len`` above ``model.max_position_embeddings`` (the engine would sample
episodes longer than the trainer can train on), and a seed whose derived train seed is the
held-out seed.

Derivation runs when the config is loaded (`sao_megatron.configs.load_config`), the only place
that knows which keys were written. A `JobConfig` built in Python, or rebuilt by
``dataclasses.replace``, keeps the values it is given (a replaced job keeps the values its load
resolved).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sao_megatron.trainer.job import JobConfig

#: parallel.seed = PARALLEL_SEED_BASE + seed (the former fixed default, so seed=0 changes nothing)
PARALLEL_SEED_BASE = 1234

#: precision.params_dtype -> rollout.dtype (vLLM's names)
ENGINE_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}

#: dotted field -> how it is derived, for `sao-train --help` (`sao_megatron.configs.describe`)
RULES = {
    "parallel.seed": f"{PARALLEL_SEED_BASE} + seed",
    "tasks.train_seed": "seed",
    "rollout.seed": "seed",
    "rollout.max_model_len": "model.max_position_embeddings",
    "rollout.dtype": "precision's (fp32 -> float32, bf16/fp8 -> bfloat16, fp16 -> float16)",
}


@dataclass(frozen=True)
class DerivedSetting:
    """One derived field of a loaded job.

    Fields:
        key: the dotted field, e.g. ``"parallel.seed"``.
        source: what it is derived from, as the config spells it (``"seed=0"``).
        derived: the value the rule gives.
        value: the value the job has (``derived`` unless `explicit`).
        explicit: the config sets the field (kept, even when equal to the derived value).
    """

    key: str
    source: str
    derived: Any
    value: Any
    explicit: bool

    @property
    def overridden(self) -> bool:
        """Set explicitly to something else than the derived value (logged at start-up)."""
        return self.explicit and self.value != self.derived

    def message(self) -> str:
        """``"parallel.seed=7 set explicitly (derived from seed=0: 1234)"``."""
        return (
            f"{self.key}={_yaml(self.value)} set explicitly (derived from {self.source}: "
            f"{_yaml(self.derived)})"
        )


def _yaml(value: Any) -> str:
    return "null" if value is None else str(value)


def engine_dtype(params_dtype: str, fp8: bool) -> str:
    """The rollout engine dtype for a trainer precision (``precision.params_dtype``, already
    resolved from "auto"; ``precision.fp8``): "float32", "bfloat16" or "float16"."""
    return "bfloat16" if fp8 else ENGINE_DTYPES[params_dtype]


def derive_settings(
    job: JobConfig, explicit: Callable[[str], set[str] | None]
) -> list[DerivedSetting]:
    """Fill the derived fields of `job` that the config leaves out (replacing its ``parallel``,
    ``tasks`` and ``rollout`` sections, so their own checks run on the final values) and
    return one record per derived field (see the module docstring for the rules).

    Args:
        job: the job, its model already final (``init_from_hf`` applied).
        explicit: section -> the fields the config sets
            (`sao_megatron.configs.explicit_fields`); None outside `load_config`: then
            nothing is derived or checked and ``[]`` is returned.

    Raises:
        ValueError: ``rollout.max_model_len`` set above ``model.max_position_embeddings``, or a
            ``seed`` whose derived ``tasks.train_seed`` equals ``tasks.eval_seed``; the message
            names the fields and the fix.
    """
    sections = {s: explicit(s) for s in ("parallel", "tasks", "rollout")}
    if any(v is None for v in sections.values()):
        return []
    precision = job.precision
    dtype_source = f"precision.params_dtype={precision.params_dtype}" + (
        ", precision.fp8=true" if precision.fp8 else ""
    )
    rules = [
        ("parallel", "seed", PARALLEL_SEED_BASE + job.seed, f"seed={job.seed}"),
        ("tasks", "train_seed", job.seed, f"seed={job.seed}"),
        ("rollout", "seed", job.seed, f"seed={job.seed}"),
        (
            "rollout",
            "max_model_len",
            job.model.max_position_embeddings,
            f"model.max_position_embeddings={job.model.max_position_embeddings}",
        ),
        (
            "rollout",
            "dtype",
            engine_dtype(precision.params_dtype, precision.fp8),
            dtype_source,
        ),
    ]
    records, changes = [], {s: {} for s in sections}
    for section, name, derived, source in rules:
        is_set = name in sections[section]
        value = getattr(getattr(job, section), name) if is_set else derived
        if not is_set:
            changes[section][name] = derived
        records.append(DerivedSetting(f"{section}.{name}", source, derived, value, is_set))
    _check(job, records)
    for section, fields in changes.items():
        if not fields:
            continue
        try:  # the section's own checks, on the derived values
            setattr(job, section, dataclasses.replace(getattr(job, section), **fields))
        except ValueError as e:
            named = [k for k in fields if f"{section}.{k}" in str(e)] or list(fields)
            derived = ", ".join(f"{section}.{k}={_yaml(fields[k])}" for k in named)
            raise ValueError(f"{e} (derived: {derived}; set the field to override)") from None
    return records


def _check(job: JobConfig, records: list[DerivedSetting]) -> None:
    by_key = {r.key: r for r in records}
    length = by_key["rollout.max_model_len"]
    limit = job.model.max_position_embeddings
    if length.explicit and length.value > limit:
        raise ValueError(
            f"rollout.max_model_len={length.value} exceeds model.max_position_embeddings={limit}:"
            " the engine would sample episodes longer than the trainer's sequences; lower "
            f"rollout.max_model_len to <= {limit}, or leave it out (it follows "
            "model.max_position_embeddings)"
        )
    train = by_key["tasks.train_seed"]
    if not train.explicit and train.value == job.tasks.eval_seed:
        raise ValueError(
            f"seed={job.seed} gives tasks.train_seed={train.value}, which equals "
            f"tasks.eval_seed={job.tasks.eval_seed}: the training tasks would be the held-out "
            "ones; use another seed, or set tasks.train_seed"
        )


def engine_anchor_warning(job: JobConfig) -> str | None:
    """A warning when ``rollout.dtype`` is set to another dtype than the trainer's derived one
    and the algorithm's policy ratio is anchored at the engine's log-probs l_b (no OLD_LOGPROBS
    phase and an importance weighting other than "none": SAO as shipped, GRPO+DIS); else None.

    Such an engine differs from the trainer even at lag 0 (a bf16 engine beside an fp32 trainer:
    mean |1 - r| ~ 0.09 on SmolLM2), and SAO with its clip on that ratio drifted instead of
    learning GEM's GuessTheNumber (docs/ALGORITHM.md, "An engine whose log-probs differ from
    the trainer's"). The message names both fixes. A job without the "rl" stage (an SFT or
    value pre-training alone: no policy ratio) gives None, and so does one without
    `derived_settings` (`job` must come from `load_config`).
    """
    from sao_megatron.algorithm import registry
    from sao_megatron.algorithm.base import Phase

    record = next((r for r in job.derived_settings if r.key == "rollout.dtype"), None)
    if record is None or not record.overridden or "rl" not in job.stages:
        return None
    algo, weighting = job.algorithm, job.algorithm.importance.weighting
    if weighting == "none" or Phase.OLD_LOGPROBS in registry.build(algo).schedule:
        return None
    fix = (
        "algorithm.importance.weighting=decoupled_ppo"
        if "decoupled_ppo" in registry.get(algo.name).importance_weightings
        else "algorithm.name=grpo"
    )
    return (
        f"rollout.dtype={record.value} differs from the trainer's {record.derived} ("
        f"{record.source}) and algorithm.name={algo.name!r} with algorithm.importance.weighting="
        f"{weighting!r} anchors its policy ratio at the engine's log-probs, which then differ "
        "from the trainer's even at lag 0; SAO that way drifted instead of learning "
        '(docs/ALGORITHM.md, "An engine whose log-probs differ from the trainer\'s"). Leave '
        f"rollout.dtype out (it follows the precision) or set {fix} (the clip on the trainer's "
        "recomputed log-probs)"
    )


def log_overrides(records: Sequence[DerivedSetting], log: logging.Logger | None = None) -> None:
    """Log at INFO, once each, the derived fields set explicitly to another value than the
    derived one (`DerivedSetting.message`); `sao-train` calls it on rank 0 at start-up."""
    log = log or logging.getLogger("sao_megatron.trainer")
    for r in records:
        if r.overridden:
            log.info("%s", r.message())
