"""AlgorithmConfig: the YAML ``algorithm:`` section, one small dataclass per part of the math.

    algorithm:
      name: sao                 # a registered algorithm: sao, grpo, grpo_dis (registry.py)
      loss_aggregation: token_mean
      entropy_coef: 0.0
      whiten_advantages: false
      skip_zero_advantage_updates: true
      sao: {...}                # SAOConfig: GAE and the critic (sao)
      grpo: {...}               # GRPOConfig: group size and group statistics (grpo, grpo_dis)
      ppo: {...}                # PPOClipConfig: PPO's clipped surrogate (grpo; ppo_clip weighting)
      importance: {...}         # ImportanceConfig: behaviour-policy correction (all)
      options: {...}            # a plug-in algorithm's own options (its `options_class`)

Each part checks its own ranges in ``__post_init__`` (a ValueError naming the dotted field);
`AlgorithmConfig.__post_init__` then asks the registered algorithm which parts it reads and
rejects a non-default value in a part it ignores (a key that would be ignored is an error).
An algorithm registered from outside the package carries its own settings in ``options``: its
class names a ``@dataclass(kw_only=True)`` as ``options_class``, which validates them (unknown
keys and bad values are errors naming ``algorithm.options.<key>``); the built-ins have none, so
``options`` must stay empty for them (examples/algorithms/rebn.py shows a plug-in).
Keys of the former flat layout (``algorithm.eps_low``, ...) are listed in `MOVED_FIELDS` with the
key that replaced them (load_config turns them into a migration error). docs/ALGORITHM.md maps
each field to the formula it selects.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

from . import registry

ADVANTAGE_GRANULARITIES = ("action_token", "node_last_token", "node_mean")
IMPORTANCE_WEIGHTINGS = (
    "dis_band",
    "ppo_clip",
    "tis",
    "masked_is",
    "seq_geo_mask",
    "decoupled_ppo",
    "none",
)
#: the parameters each importance weighting reads (eps_low/eps_high: always, for the
#: ``deviation/dropped_fraction`` metric)
IMPORTANCE_PARAMETERS = {
    "tis": ("tis_cap",),
    "masked_is": ("mis_beta",),
    "seq_geo_mask": ("seq_geo_low", "seq_geo_high"),
    "decoupled_ppo": ("decoupled_weight_cap",),
}
LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")


def _choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{key}={value!r}: must be one of {', '.join(choices)}")


def _interval(key: str, value: float, lo: float, hi: float, *, lo_open: bool, hi_open: bool):
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > lo if lo_open else value >= lo)
    ok = ok and (value < hi if hi_open else value <= hi)
    if not ok:
        lb, rb = ("(" if lo_open else "["), (")" if hi_open else "]")
        raise ValueError(f"{key}={value!r}: must be in {lb}{lo}, {hi}{rb}")


def _positive(key: str, value: float | None) -> None:
    if value is not None:
        _interval(key, value, 0.0, math.inf, lo_open=True, hi_open=True)


def _integer(key: str, value: int, lo: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"{key}={value!r}: must be an integer >= {lo}")


def _boolean(key: str, value: bool) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{key}={value!r}: must be true or false")


@dataclass(kw_only=True)
class SAOConfig:
    """``algorithm.sao``: SAO's advantages (GAE over action tokens or nodes) and its critic."""

    advantage_granularity: str = "action_token"
    """"action_token": GAE over action tokens; "node_last_token": GAE over action nodes with the
    value at each node's last action token; "node_mean": node value = mean over its tokens."""
    gamma: float = 1.0
    """Discount per GAE step (per action token or per node), in [0, 1]."""
    lam_policy: float | None = None
    """GAE lambda of the policy advantages, in [0, 1], fixed for every trajectory. None (the
    default): the length-adaptive lambda of `length_adaptive_alpha`."""
    lam_value: float = 1.0
    """GAE lambda of the value targets (returns = A(lam_value) + V), in [0, 1]. VAPO uses 1."""
    length_adaptive_alpha: float | None = 1.5
    """Used when `lam_policy` is None. VAPO's length-adaptive lambda (arXiv 2504.05118, sec. 3.2):
    lam_policy = clamp(1 - 1/(alpha * l), 0, 1) per trajectory, l its number of GAE steps
    (action tokens, or nodes for the node granularities). Default 1.5, SAO's setting
    (1 - 1/(1.5 l)); VAPO uses 0.05 with l = response length. > 0."""

    @property
    def policy_lambda_alpha(self) -> float | None:
        """The alpha the advantages use: `length_adaptive_alpha`, or None when `lam_policy` is
        fixed."""
        return self.length_adaptive_alpha if self.lam_policy is None else None

    bootstrap_truncated: bool = True
    """Truncated trajectories bootstrap with V(last state) instead of 0."""
    value_clip: float | None = 0.2
    """Clip V - V_old to [-value_clip, value_clip] in the pessimistic value loss; None = off."""
    value_updates_per_policy_update: int = 2
    """K: value-model updates on the same trajectories before each policy update (>= 0)."""

    def __post_init__(self) -> None:
        p = "algorithm.sao."
        _choice(p + "advantage_granularity", self.advantage_granularity, ADVANTAGE_GRANULARITIES)
        for f in ("gamma", "lam_policy", "lam_value"):
            if getattr(self, f) is not None or f != "lam_policy":
                _interval(p + f, getattr(self, f), 0.0, 1.0, lo_open=False, hi_open=False)
        _positive(p + "length_adaptive_alpha", self.length_adaptive_alpha)
        if self.lam_policy is None and self.length_adaptive_alpha is None:
            raise ValueError(
                f"{p}lam_policy and {p}length_adaptive_alpha are both null: set lam_policy "
                "(a fixed lambda, e.g. 0.95) or length_adaptive_alpha (e.g. 1.5)"
            )
        _boolean(p + "bootstrap_truncated", self.bootstrap_truncated)
        _positive(p + "value_clip", self.value_clip)
        _integer(p + "value_updates_per_policy_update", self.value_updates_per_policy_update, 0)


@dataclass(kw_only=True)
class GRPOConfig:
    """``algorithm.grpo``: groups of samples per task and their reward statistics."""

    group_size: int = 8
    """G: trajectories sampled per task (>= 1); the rollout runs each task G times."""
    std_normalize: bool = True
    """Divide group-centred rewards by the group std (GRPO); False gives Dr.GRPO."""
    eps: float = 1e-6
    """Added to the group std in GRPO's denominator (> 0)."""

    def __post_init__(self) -> None:
        _integer("algorithm.grpo.group_size", self.group_size, 1)
        _boolean("algorithm.grpo.std_normalize", self.std_normalize)
        _positive("algorithm.grpo.eps", self.eps)


@dataclass(kw_only=True)
class PPOClipConfig:
    """``algorithm.ppo``: PPO's clipped surrogate (GRPO's loss; SAO's default weighting,
    ppo_clip)."""

    clip_low: float = 0.2
    """Ratio clip below: clip(r, 1 - clip_low, ...), in (0, 1)."""
    clip_high: float = 0.2
    """Ratio clip above: clip(r, ..., 1 + clip_high), > 0 (DAPO clip-higher uses 0.28)."""
    dual_clip: float | None = 3.0
    """Dual-clip constant c > 1: for A < 0 the per-token loss is capped at -c * A. None = off."""

    def __post_init__(self) -> None:
        _interval("algorithm.ppo.clip_low", self.clip_low, 0.0, 1.0, lo_open=True, hi_open=True)
        _positive("algorithm.ppo.clip_high", self.clip_high)
        if self.dual_clip is not None:
            _interval(
                "algorithm.ppo.dual_clip", self.dual_clip, 1.0, math.inf, lo_open=True, hi_open=True
            )


@dataclass(kw_only=True)
class ImportanceConfig:
    """``algorithm.importance``: how the policy loss corrects for the behaviour policy."""

    #: fields __post_init__ of AlgorithmConfig fills when left None (see sao_megatron.configs)
    DERIVED_FIELDS: ClassVar[tuple[str, ...]] = ("weighting",)

    weighting: str | None = None
    """dis_band, ppo_clip, tis, masked_is, seq_geo_mask, decoupled_ppo or none; None picks the
    algorithm's default (sao: ppo_clip; grpo_dis: dis_band; grpo: none). Which ones an
    algorithm accepts: docs/ALGORITHM.md."""
    eps_low: float = 0.3
    """DIS band: tokens with r <= 1 - eps_low are dropped. In (0, 1); 0.3 reasoning, 0.8 coding.
    Also the band of the deviation/dropped_fraction metric for every weighting."""
    eps_high: float = 5.0
    """DIS band: tokens with r >= 1 + eps_high are dropped. > 0; 5.0 reasoning, 3.0 coding."""
    tis_cap: float = 2.0
    """tis: weight = min(r, tis_cap); > 0."""
    mis_beta: float = 2.0
    """masked_is: keep r in [1/mis_beta, mis_beta], weight 0 outside; > 1."""
    seq_geo_low: float = 0.99
    """seq_geo_mask: drop a sequence if exp(mean log r) < seq_geo_low, in (0, 1]."""
    seq_geo_high: float = 1.01
    """seq_geo_mask: drop a sequence if exp(mean log r) > seq_geo_high, >= 1."""
    decoupled_weight_cap: float | None = None
    """decoupled_ppo: cap on the behaviour weight pi_prox / pi_behaviour (None = uncapped)."""

    def __post_init__(self) -> None:
        p = "algorithm.importance."
        if self.weighting is not None:
            _choice(p + "weighting", self.weighting, IMPORTANCE_WEIGHTINGS)
        _interval(p + "eps_low", self.eps_low, 0.0, 1.0, lo_open=True, hi_open=True)
        _positive(p + "eps_high", self.eps_high)
        _positive(p + "tis_cap", self.tis_cap)
        _interval(p + "mis_beta", self.mis_beta, 1.0, math.inf, lo_open=True, hi_open=True)
        _interval(p + "seq_geo_low", self.seq_geo_low, 0.0, 1.0, lo_open=True, hi_open=False)
        _interval(p + "seq_geo_high", self.seq_geo_high, 1.0, math.inf, lo_open=False, hi_open=True)
        _positive(p + "decoupled_weight_cap", self.decoupled_weight_cap)


_NO_REFERENCE = "was removed: the trainer builds no reference model, so there is no KL penalty"


def _moved(section: str, names: tuple[str, ...], prefix: str = "") -> dict[str, str]:
    return {n: f"moved to algorithm.{section}.{n.removeprefix(prefix)}" for n in names}


@dataclass(kw_only=True)
class AlgorithmConfig:
    """The RL algorithm and the switches of its math. Defaults are SAO's (DESIGN section 3).

    Raises ValueError (naming the dotted field and the fix) on any invalid setting, on an
    unregistered name, and on a non-default value in a part the algorithm does not read.
    """

    #: former flat keys -> the fix (the key that replaced them), for migration errors
    MOVED_FIELDS: ClassVar[dict[str, str]] = {
        **_moved(
            "sao",
            tuple(f.name for f in dataclasses.fields(SAOConfig)),
        ),
        **_moved("grpo", ("grpo_group_size", "grpo_std_normalize", "grpo_eps"), prefix="grpo_"),
        **_moved("ppo", ("clip_low", "clip_high", "dual_clip")),
        **_moved("importance", tuple(f.name for f in dataclasses.fields(ImportanceConfig))[1:]),
        "importance_weighting": "moved to algorithm.importance.weighting",
        "max_staleness": "moved to rollout.max_staleness (the rollout enforces staleness)",
        "kl_coef": _NO_REFERENCE,
        "kl_estimator": _NO_REFERENCE,
    }

    name: str = "sao"
    """A registered algorithm (sao, grpo, grpo_dis; `sao_megatron.algorithm.registry`)."""
    loss_aggregation: str = "token_mean"
    """token_mean (divide by the global action-token count), seq_mean_token_mean,
    seq_mean_token_sum."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (loss -= entropy_coef * H); >= 0."""
    whiten_advantages: bool = False
    """Normalise policy advantages to zero mean / unit std over the batch's action tokens."""
    skip_zero_advantage_updates: bool = True
    """Skip the policy optimiser step when no fresh action token of the batch (over all ranks)
    has a non-zero advantage and the entropy bonus is off. The loss gradient is then exactly 0,
    but Adam would still move every weight by its first moment (~lr per step, decaying by
    beta1): GRPO's update when every group's rewards are equal. The skip is logged as
    ``policy/skipped_zero_advantage`` = 1 (``policy/update_ok`` 0); the LR schedule does not
    advance. False: step anyway (what TRL/verl GRPO do)."""
    sao: SAOConfig = field(default_factory=SAOConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    ppo: PPOClipConfig = field(default_factory=PPOClipConfig)
    importance: ImportanceConfig = field(default_factory=ImportanceConfig)
    options: dict[str, Any] = field(default_factory=dict)
    """The options of an algorithm that declares an ``options_class`` (a plug-in, e.g.
    examples/algorithms/rebn.py), validated by that dataclass and completed with its defaults;
    read them with `typed_options`. Must stay empty for an algorithm without one (the
    built-ins)."""

    def typed_options(self) -> Any:
        """``algorithm.options`` as the algorithm's ``options_class`` instance, or None when the
        algorithm declares none."""
        cls = getattr(registry.get(self.name), "options_class", None)
        return None if cls is None else cls(**self.options)

    def __post_init__(self) -> None:
        algo = registry.get(self.name)  # ValueError listing the registered names
        self.options = _checked_options(
            self.name, getattr(algo, "options_class", None), self.options
        )
        _choice("algorithm.loss_aggregation", self.loss_aggregation, LOSS_AGGREGATIONS)
        _interval(
            "algorithm.entropy_coef", self.entropy_coef, 0.0, math.inf, lo_open=False, hi_open=True
        )
        _boolean("algorithm.whiten_advantages", self.whiten_advantages)
        _boolean("algorithm.skip_zero_advantage_updates", self.skip_zero_advantage_updates)
        imp = self.importance
        if imp.weighting is None:
            imp.weighting = algo.default_importance
        if imp.weighting not in algo.importance_weightings:
            raise ValueError(
                f"algorithm.importance.weighting={imp.weighting!r} does not apply to "
                f"algorithm.name={self.name!r}: use one of {', '.join(algo.importance_weightings)}"
            )
        reads = algo.config_sections(self)
        reading = algo.ppo_weightings
        for section in ("sao", "grpo", "ppo"):
            if section not in reads:
                key = f"algorithm.{section}"
                if section == "ppo" and reading:
                    why = (
                        f"algorithm.name={self.name!r} with algorithm.importance.weighting="
                        f"{imp.weighting!r} (it reads {key} only with {' or '.join(reading)}): "
                        f"remove the key or set algorithm.importance.weighting={reading[0]}"
                    )
                else:
                    why = (
                        f"algorithm.name={self.name!r} (it does not read {key}): remove the key "
                        "or pick an algorithm that uses it"
                    )
                _reject_non_default(key, getattr(self, section), why)
        params = {p for ps in IMPORTANCE_PARAMETERS.values() for p in ps}
        for p in sorted(params - set(IMPORTANCE_PARAMETERS.get(imp.weighting, ()))):
            default = next(f.default for f in dataclasses.fields(imp) if f.name == p)
            if getattr(imp, p) != default:
                raise ValueError(
                    f"algorithm.importance.{p}={getattr(imp, p)!r} is ignored with "
                    f"algorithm.importance.weighting={imp.weighting!r}: remove it"
                )


def _checked_options(name: str, cls: type | None, options: dict[str, Any]) -> dict[str, Any]:
    """``algorithm.options`` validated by the algorithm's options dataclass `cls` (its
    ``__post_init__`` checks the values), with every field filled in; {} without a `cls`.

    Raises ValueError naming ``algorithm.options.<key>`` for a key `cls` does not have, and for
    any option when the algorithm declares no `cls`."""
    options = dict(options or {})
    if cls is None:
        if options:
            raise ValueError(
                f"algorithm.options.{next(iter(options))} is ignored by algorithm.name={name!r} "
                "(it declares no options_class): remove algorithm.options"
            )
        return {}
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"{name!r}: options_class must be a dataclass, got {cls!r}")
    fields = [f.name for f in dataclasses.fields(cls) if f.init]
    for key in options:
        if key not in fields:
            raise ValueError(
                f"algorithm.options.{key}: not an option of algorithm.name={name!r}; its options "
                f"are {', '.join(fields) or '(none)'}"
            )
    for f in dataclasses.fields(cls):
        no_default = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if f.init and no_default and f.name not in options:
            raise ValueError(f"algorithm.options.{f.name} is required by algorithm.name={name!r}")
    checked = cls(**options)  # its __post_init__ checks the values
    return {f: getattr(checked, f) for f in fields}


def _reject_non_default(key: str, part: object, ignored_by: str) -> None:
    """ValueError "<key>.<field>=<value> is ignored by <ignored_by>" if `part` (a config
    dataclass) differs from its defaults: it would be ignored."""
    default = type(part)()
    for f in dataclasses.fields(part):
        if getattr(part, f.name) != getattr(default, f.name):
            raise ValueError(f"{key}.{f.name}={getattr(part, f.name)!r} is ignored by {ignored_by}")
