"""The job config of `sao-train`: composes the component configs and checks cross-field rules.

Each component validates its own fields; this module adds only the stage configs (SFT warm-up,
value pre-training, RL) and the rules that span components. YAML files under
`examples/configs/` fill it; dotted CLI overrides change single fields.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from sao_megatron.algorithm import registry
from sao_megatron.algorithm.config import AlgorithmConfig
from sao_megatron.configs import explicit_fields
from sao_megatron.data.demonstrations import DemonstrationConfig
from sao_megatron.data.episode import EpisodeFormatConfig
from sao_megatron.data.tokenizer import TokenizerConfig
from sao_megatron.envs.base import EnvSpec
from sao_megatron.envs.options import config_from_options
from sao_megatron.models.config import MoEModelConfig
from sao_megatron.models.freeze import VALUE_DEFAULT_FREEZE_PATTERNS
from sao_megatron.models.tiny import JOB_DEFAULT_MOE_FIELDS
from sao_megatron.optim.config import OptimizerConfig, PrecisionConfig
from sao_megatron.parallel.config import ParallelConfig
from sao_megatron.rollout.config import RolloutConfig
from sao_megatron.trainer.checkpoint import CheckpointConfig
from sao_megatron.trainer.derived import RULES, DerivedSetting, derive_settings
from sao_megatron.trainer.metrics import LoggingConfig

STAGES = ("sft", "value_pretrain", "rl")

# MoEModelConfig fields a job starting from an HF model may still set itself: training-only
# settings that config.json does not describe (max_position_embeddings may only be lowered).
HF_INIT_FREE_FIELDS = ("moe_token_dispatcher_type", "router_aux_loss_coef", "initializer_range")


def _default_model() -> MoEModelConfig:
    return MoEModelConfig(**JOB_DEFAULT_MOE_FIELDS)


def model_from_hf(
    user: MoEModelConfig, hf_dir: str, explicit: set[str] | None = None
) -> MoEModelConfig:
    """The model config of a job that starts from the HF model in `hf_dir` (``init_from_hf``).

    Architecture fields come from ``hf_dir/config.json`` through the converter's
    ``model_config_from_hf`` (MoE families and dense Qwen2/Qwen3/Llama, tied embeddings
    included). A field the user set (`explicit`: the model fields the YAML file or an override
    names, whatever their value, from `sao_megatron.configs.explicit_fields`; when None, a field
    that differs from the job's default model) must equal the HF value, except the
    training-only ``HF_INIT_FREE_FIELDS`` (kept) and ``max_position_embeddings`` (kept when not
    above the HF value). Fields the user did not set take config.json's values.

    Raises:
        ValueError: no config.json, an unsupported architecture, or a user-set field that
            conflicts with config.json (names ``model.<field>``, both values and the fix).
    """
    from sao_megatron.convert.hf_io import read_hf_config
    from sao_megatron.convert.model_config import model_config_from_hf

    converted = Path(hf_dir) / "sao_convert.json"  # an `sao-convert hf-to-megatron` output
    if converted.is_file() and not (Path(hf_dir) / "config.json").is_file():
        source = json.loads(converted.read_text()).get("source", "HF_DIR")
        raise ValueError(
            f"init_from_hf={hf_dir!r} is a Megatron checkpoint made by `sao-convert "
            "hf-to-megatron`, which jobs do not load: point init_from_hf (and tokenizer.path) "
            f"at the Hugging Face folder it was converted from, {source}"
        )
    if not (Path(hf_dir) / "config.json").is_file():
        raise ValueError(
            f"init_from_hf={hf_dir!r}: no config.json there; point it at a Hugging Face model "
            "folder (for SmolLM2-135M-Instruct run `make smollm2`, which writes "
            ".cache/models/SmolLM2-135M-Instruct)"
        )
    hf = model_config_from_hf(read_hf_config(hf_dir))
    default, keep, conflicts = _default_model(), {}, []
    for f in dataclasses.fields(MoEModelConfig):
        mine, theirs = getattr(user, f.name), getattr(hf, f.name)
        unset = f.name not in explicit if explicit is not None else mine == getattr(default, f.name)
        if unset or mine == theirs:
            continue
        if f.name in HF_INIT_FREE_FIELDS or (
            f.name == "max_position_embeddings" and mine <= theirs
        ):
            keep[f.name] = mine
        else:
            conflicts.append(f"model.{f.name}={mine!r} but config.json gives {theirs!r}")
    if conflicts:
        raise ValueError(
            f"init_from_hf={hf_dir!r}: the model comes from its config.json; "
            + "; ".join(conflicts)
            + ": remove these model fields from the config (or set them to config.json's values)"
        )
    return dataclasses.replace(hf, **keep)


def _env_spec(entry: EnvSpec | dict, where: str) -> EnvSpec:
    """An EnvSpec from a task entry (or itself); errors name `where` (``tasks.train[0]``)."""
    return entry if isinstance(entry, EnvSpec) else config_from_options(EnvSpec, entry, where)


@dataclass(kw_only=True)
class TasksConfig:
    """Which tasks RL trains on and which held-out tasks it is evaluated on.

    Fields:
        train: environments RL samples tasks from (weighted by EnvSpec.weight). Each entry's
            name and options are checked when the config loads, against the environment's
            options dataclass (docs/ENVIRONMENTS.md); errors name ``tasks.train[i].options.x``.
        eval: environments of the held-out evaluation (default: the train environments),
            checked likewise.
        train_seed: base seed of the training task stream; in a job, the job's ``seed``
            unless set (`sao_megatron.trainer.derived`).
        eval_seed: base seed of the held-out tasks; eval seeds are drawn from another stream
            than train seeds (different base), so the two sets do not overlap in practice.
            Not derived from the job's ``seed``: every seed is evaluated on the same held-out
            tasks, so runs of different seeds compare.
        num_eval_tasks: held-out tasks per eval environment (0 disables evaluation).
    """

    train: list[EnvSpec] = field(default_factory=lambda: [EnvSpec(name="chain_sum")])
    eval: list[EnvSpec] = field(default_factory=list)
    train_seed: int = 0
    eval_seed: int = 1_000_003
    num_eval_tasks: int = 32

    @property
    def eval_envs(self) -> list[EnvSpec]:
        """The held-out environments (the train environments when `eval` is empty)."""
        return self.eval or self.train

    def __post_init__(self) -> None:
        # each entry's name and options are checked here (EnvSpec), errors at its path
        self.train = [_env_spec(e, f"tasks.train[{i}]") for i, e in enumerate(self.train)]
        self.eval = [_env_spec(e, f"tasks.eval[{i}]") for i, e in enumerate(self.eval)]
        if not self.train:
            raise ValueError("tasks.train is empty: list at least one environment")
        if self.train_seed == self.eval_seed:
            raise ValueError("tasks.eval_seed equals tasks.train_seed: held-out tasks must differ")
        if self.num_eval_tasks < 0:
            raise ValueError(f"tasks.num_eval_tasks={self.num_eval_tasks}: must be >= 0")


@dataclass(kw_only=True)
class SFTConfig:
    """Supervised warm-up on gold demonstrations (cross-entropy on action tokens).

    Fields:
        steps: optimiser steps (0 skips the stage).
        batch_size: sequences per step (global, across data-parallel ranks).
        micro_batch_size: sequences per forward/backward micro-batch.
        optim: optimiser of this stage (its own LR schedule).
    """

    steps: int = 200
    batch_size: int = 32
    micro_batch_size: int = 8
    optim: OptimizerConfig = field(
        default_factory=lambda: OptimizerConfig(
            lr=1e-3, warmup_steps=20, decay_style="cosine", decay_steps=200
        )
    )

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise ValueError(f"sft.steps={self.steps}: must be >= 0")
        if self.batch_size < 1 or self.micro_batch_size < 1:
            raise ValueError("sft.batch_size and sft.micro_batch_size must be >= 1")


@dataclass(kw_only=True)
class ValueModelConfig:
    """The critic: initialisation and which parameters stay frozen.

    Fields:
        freeze_patterns: regexes over parameter names (re.search) frozen in the value model;
            default: self-attention and embeddings (docs/ARCHITECTURE.md).
        head_init_std: std of the value head's normal initialisation.
        placement: where the critic trains. "colocated" (default): every rank holds the policy
            and the value model and runs the whole schedule. "separate": the first half of the
            ranks trains the policy, the second half the value model, the value work of batch
            n+1 overlapping the policy update of batch n with the same numbers (docs/TRAINING.md,
            "Critic placement"); only for algorithms with a value model, data parallelism only
            (an even world, tp = pp = ep = 1), no distributed optimiser. SFT trains on every
            rank; the critic trains on batch n+1 during the policy's update on batch n only
            when rollout.max_staleness >= 1 (synchronously the roles alternate).
    """

    freeze_patterns: list[str] = field(default_factory=lambda: list(VALUE_DEFAULT_FREEZE_PATTERNS))
    head_init_std: float = 0.02
    placement: str = "colocated"

    def __post_init__(self) -> None:
        if self.head_init_std < 0:
            raise ValueError(f"value.head_init_std={self.head_init_std}: must be >= 0")
        if self.placement not in ("colocated", "separate"):
            raise ValueError(f"value.placement={self.placement!r}: use 'colocated' or 'separate'")


@dataclass(kw_only=True)
class ValuePretrainConfig:
    """Cold-start the critic on rollouts of the frozen policy before RL
    (`sao_megatron.trainer.value_pretrain`).

    Without a target the stage runs exactly ``steps`` value-only updates. With a target it stops
    at the first held-out evaluation whose explained variance reaches it, or after ``steps``
    updates (the step cap), whichever comes first; ``summary.json`` says which
    (``value_pretrain/stop_reason``).

    Fields:
        steps: value-only updates, each on one rollout batch (0 skips the stage, with or without
            a target). With ``target_explained_variance``: the most updates (the step cap).
        target_explained_variance: stop once the critic's explained variance on the held-out
            rollouts, 1 - Var(R - V) / Var(R) over their value-masked tokens (R: the algorithm's
            value targets), is at least this; in (0, 1). 0 or null: no target (no held-out set,
            no evaluation: ``steps`` updates).
        eval_interval: with a target, evaluate on the held-out set after every this many
            updates, and after the last one.
        num_heldout_trajectories: with a target, the size of the held-out set: trajectories of
            the frozen policy drawn once, before the first update, from the same rollout as the
            training batches (whole batches; what is left of the last one is dropped), never
            trained on, kept in the RL checkpoint so a resumed run evaluates on the same set.
            A multiple of the algorithm's group size.
    """

    #: keys users may guess -> the fix (sao_megatron.configs)
    MOVED_FIELDS: ClassVar[dict[str, str]] = {
        "max_steps": "is value_pretrain.steps: the number of updates, and with "
        "value_pretrain.target_explained_variance the step cap",
    }

    steps: int = 0
    target_explained_variance: float | None = None
    eval_interval: int = 5
    num_heldout_trajectories: int = 32

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise ValueError(f"value_pretrain.steps={self.steps}: must be >= 0")
        t = self.target_explained_variance
        if t is not None and t != 0 and not 0 < t < 1:
            raise ValueError(
                f"value_pretrain.target_explained_variance={t}: use a value in (0, 1) (explained "
                "variance is at most 1, reached only by a perfect critic), or 0/null for no target"
            )
        if self.eval_interval < 1:
            raise ValueError(
                f"value_pretrain.eval_interval={self.eval_interval}: must be >= 1 (updates "
                "between held-out evaluations)"
            )
        if self.num_heldout_trajectories < 1:
            raise ValueError(
                f"value_pretrain.num_heldout_trajectories={self.num_heldout_trajectories}: must "
                "be >= 1 (set value_pretrain.target_explained_variance=0 for no held-out set)"
            )

    @property
    def has_target(self) -> bool:
        """Whether the stage stops on held-out explained variance (a target is set)."""
        return bool(self.target_explained_variance)


@dataclass(kw_only=True)
class RLConfig:
    """The RL stage (the algorithm of ``algorithm.name``: SAO, GRPO, GRPO+DIS).

    Fields:
        steps: policy updates (train steps).
        micro_batch_size: rows per forward/backward micro-batch.
        eval_interval: evaluate on the held-out tasks every this many steps (0 = only before
            and after the stage).
        eval_interval_s: also evaluate after the first step that ends at least this many seconds
            of the stage's clock (below) after the previous evaluation (0 = never): held-out
            success against wall-clock (time-to-accuracy curves); each record in
            ``rl/eval.jsonl`` carries ``time/rl_elapsed_s``.
        batch_timeout_s: give up waiting for a rollout batch after this long (an error, not a
            hang: the rollout log says why).
        time_budget_s: wall-clock budget in seconds (0 = none) counted from the end of the
            before-RL evaluation, so value pre-training counts in it: the RL stage ends after the
            first step that finishes past it (or at `steps`, whichever comes first), then saves,
            exports and evaluates as usual. Start-up and held-out evaluations (before, during
            and after the stage) are not counted: the stage's clock stops while they run.
            Compares algorithms under the same wall-clock budget (tools/bench_sao_vs_grpo.py).
        record_batches: rank 0 writes every batch the stage trains on (its trajectories with
            each token's behaviour log-prob and policy version, the trainer's policy version)
            to ``run_dir/rl/batches/step_XXXXXXXX.pt``, so the run can be replayed
            (`sao_megatron.trainer.batch_record`; a resumed run continues the numbering).
        replay_batches: a ``run_dir/rl/batches`` folder written by ``record_batches``: the
            stage trains on those batches in step order, from the step the run resumes from,
            instead of sampling (no engine is started for training; held-out evaluation still
            starts engines unless tasks.num_eval_tasks=0). A missing step file ends the stage
            there. tools/replay_batches.py replays steps K..N of a run from its step-K
            checkpoint. None: batches come from the rollout.
    """

    steps: int = 20
    micro_batch_size: int = 4
    eval_interval: int = 0
    eval_interval_s: float = 0.0
    batch_timeout_s: float = 1800.0
    time_budget_s: float = 0.0
    record_batches: bool = False
    replay_batches: str | None = None

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise ValueError(f"rl.steps={self.steps}: must be >= 0")
        if self.replay_batches is not None and not str(self.replay_batches):
            raise ValueError("rl.replay_batches is empty: give a recorded folder, or null")
        if self.micro_batch_size < 1:
            raise ValueError(f"rl.micro_batch_size={self.micro_batch_size}: must be >= 1")
        if self.eval_interval < 0:
            raise ValueError(f"rl.eval_interval={self.eval_interval}: must be >= 0")
        if not self.eval_interval_s >= 0:
            raise ValueError(
                f"rl.eval_interval_s={self.eval_interval_s}: must be >= 0 seconds (0 = never)"
            )
        if not self.time_budget_s >= 0:
            raise ValueError(f"rl.time_budget_s={self.time_budget_s}: must be >= 0 (0 = no budget)")


@dataclass(kw_only=True)
class JobConfig:
    """Everything `sao-train` runs. Sections are the components' own configs.

    Fields:
        run_dir: where metrics, checkpoints, exported weights, logs and plots go.
        stages: which stages to run, in order: any of "sft", "value_pretrain", "rl". A job
            that ends with value_pretrain saves an RL checkpoint (step 0, the pre-trained
            critic); a later ``stages: [rl]`` job with the same run_dir resumes from it, so one
            cold start can serve several RL runs (tools/bench_sao_vs_grpo.py
            ``--shared-value-pretrain``).
        seed: the job's seed, from which the others follow unless set: parallel.seed =
            1234 + seed (Megatron/torch RNG), tasks.train_seed = seed (task stream),
            rollout.seed = seed (sampling); it also orders the SFT data. tasks.eval_seed stays
            fixed (the same held-out set for every seed). A seed set explicitly is kept and,
            when it differs from the derived one, logged at start-up
            (`sao_megatron.trainer.derived`, which also derives rollout.max_model_len and
            rollout.dtype from the model and the precision).
        init_from_hf: a Hugging Face model folder (config.json + safetensors, e.g.
            ``.cache/models/SmolLM2-135M-Instruct``) the policy (and through it the critic's
            trunk) starts from, instead of a random init; None = random init. The model
            section is then read from its config.json (`model_from_hf`), the weights are loaded
            by the converter (`sao_megatron.convert.model_io.load_hf_into_model`, any TP/PP/EP
            layout it supports), and the tokenizer must be ``kind: hf`` with the same folder.
        plugins: modules imported before the config is validated, so that the algorithms and
            environments they register can be named in it: dotted module names or paths to
            .py files (e.g. ``[examples/algorithms/rebn.py]``); ``sao-train --import MODULE``
            adds to it (`sao_megatron.plugins`).
    """

    #: derived fields -> their rule, shown as their default by `sao-train --help`
    DERIVED_DEFAULTS: ClassVar[dict[str, str]] = RULES

    plugins: list[str] = field(default_factory=list)
    run_dir: str = "runs/default"
    stages: list[str] = field(default_factory=lambda: list(STAGES))
    seed: int = 0
    init_from_hf: str | None = None
    model: MoEModelConfig = field(default_factory=_default_model)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    policy_optim: OptimizerConfig = field(
        default_factory=lambda: OptimizerConfig(lr=1e-5, warmup_steps=0)
    )
    value_optim: OptimizerConfig = field(
        default_factory=lambda: OptimizerConfig(lr=5e-5, warmup_steps=10)
    )
    value: ValueModelConfig = field(default_factory=ValueModelConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    episode: EpisodeFormatConfig = field(default_factory=EpisodeFormatConfig)
    demonstrations: DemonstrationConfig = field(default_factory=DemonstrationConfig)
    tasks: TasksConfig = field(default_factory=TasksConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    value_pretrain: ValuePretrainConfig = field(default_factory=ValuePretrainConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self) -> None:
        bad = [s for s in self.stages if s not in STAGES]
        if bad or not self.stages:
            raise ValueError(f"stages={self.stages}: use a non-empty subset of {list(STAGES)}")
        order = [STAGES.index(s) for s in self.stages]
        if order != sorted(order) or len(set(order)) != len(order):
            raise ValueError(f"stages={self.stages}: list each stage once, in the order {STAGES}")
        if self.init_from_hf is not None:
            self.model = model_from_hf(self.model, self.init_from_hf, explicit_fields("model"))
            same = self.tokenizer.path and Path(self.tokenizer.path).resolve() == (
                Path(self.init_from_hf).resolve()
            )
            if self.tokenizer.kind != "hf" or not same:
                raise ValueError(
                    f"init_from_hf={self.init_from_hf!r} needs the model's own tokenizer: set "
                    f"tokenizer.kind=hf and tokenizer.path={self.init_from_hf} (got "
                    f"kind={self.tokenizer.kind!r}, path={self.tokenizer.path!r})"
                )
        self.derived_settings: list[DerivedSetting] = derive_settings(self, explicit_fields)
        """The derived fields' records when loaded (`derive_settings`); [] in Python."""
        algorithm = registry.build(self.algorithm)
        if "value_pretrain" in self.stages and not algorithm.needs_value_model:
            raise ValueError(
                f"stages contains value_pretrain but algorithm.name={algorithm.name!r} has no "
                "value model; remove it from stages"
            )
        if self.value.placement == "separate" and not algorithm.needs_value_model:
            raise ValueError(
                f"value.placement=separate but algorithm.name={algorithm.name!r} has no value "
                "model; set value.placement=colocated"
            )
        trains_tokenizer = self.tokenizer.kind == "sentencepiece" and not self.tokenizer.path
        if trains_tokenizer and self.tokenizer.vocab_size > self.model.vocab_size:
            raise ValueError(
                f"tokenizer.vocab_size={self.tokenizer.vocab_size} exceeds model.vocab_size="
                f"{self.model.vocab_size}: the embedding must hold every token id"
            )
        # The rollout samples `group_size` trajectories per task (RolloutManager(group_size=)).
        group = algorithm.group_size
        if self.rollout.trajectories_per_batch % group:
            raise ValueError(
                f"rollout.trajectories_per_batch={self.rollout.trajectories_per_batch} is not a "
                f"multiple of the group size {group} (algorithm.grpo.group_size)"
            )

    # Derived paths -----------------------------------------------------------------------
    @property
    def run_path(self) -> Path:
        return Path(self.run_dir)
