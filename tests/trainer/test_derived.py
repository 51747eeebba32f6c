"""Derived job fields (`sao_megatron.trainer.derived`): the seeds from ``seed``, the engine's
context length and dtype from the model and the precision; a field the config sets wins (even
when equal to the default or to the derived value), a different one is logged once, and an
engine context longer than the model's is refused."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from sao_megatron.configs import describe, load_config
from sao_megatron.trainer.derived import (
    PARALLEL_SEED_BASE,
    engine_anchor_warning,
    engine_dtype,
    log_overrides,
)
from sao_megatron.trainer.job import JobConfig

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "configs"
SEEDS = ("parallel.seed", "tasks.train_seed", "rollout.seed")


def _job(*overrides: str, path: Path | None = None) -> JobConfig:
    return load_config(JobConfig, path, list(overrides))


def _seeds(job: JobConfig) -> tuple:
    return job.parallel.seed, job.tasks.train_seed, job.rollout.seed, job.tasks.eval_seed


def _llama_folder(folder: Path, **sizes) -> Path:
    """A Hugging Face folder holding only a Llama config.json of the given sizes."""
    folder.mkdir(exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "rms_norm_eps": 1e-5}
    config |= {"tie_word_embeddings": True, "hidden_act": "silu", **sizes}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _logged(job: JobConfig, caplog) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="sao_megatron.trainer"):
        log_overrides(job.derived_settings)
    return [r.getMessage() for r in caplog.records if r.name == "sao_megatron.trainer"]


def test_seed_0_derives_todays_defaults_and_seed_5_shifts_them(caplog):
    job = _job()
    assert _seeds(job) == (1234, 0, 0, 1_000_003)
    assert PARALLEL_SEED_BASE == 1234
    assert not any(r.explicit for r in job.derived_settings)
    assert _logged(job, caplog) == []
    job5 = _job("seed=5")
    assert _seeds(job5) == (1239, 5, 5, 1_000_003)  # the held-out seed does not move
    rec = {r.key: r for r in job5.derived_settings}
    assert (rec["parallel.seed"].source, rec["parallel.seed"].derived) == ("seed=5", 1239)
    assert _logged(job5, caplog) == []


def test_an_explicit_seed_wins_and_is_logged_once(caplog):
    job = _job("seed=5", "parallel.seed=7")
    assert _seeds(job) == (7, 5, 5, 1_000_003)  # the others still follow seed
    assert _logged(job, caplog) == ["parallel.seed=7 set explicitly (derived from seed=5: 1239)"]
    nulled = _job("rollout.seed=null")
    assert nulled.rollout.seed is None  # engine randomness, on purpose
    assert _logged(nulled, caplog) == ["rollout.seed=null set explicitly (derived from seed=0: 0)"]


def test_an_explicit_value_counts_as_set_whatever_it_equals(caplog):
    # equal to the class default (1234), not to the derived 1239: kept, and logged
    job = _job("seed=5", "parallel.seed=1234", "tasks.train_seed=0")
    assert _seeds(job)[:2] == (1234, 0)
    assert _logged(job, caplog) == [
        "parallel.seed=1234 set explicitly (derived from seed=5: 1239)",
        "tasks.train_seed=0 set explicitly (derived from seed=5: 5)",
    ]
    # equal to the derived value: recorded as set, nothing to log
    same = _job("seed=5", "tasks.train_seed=5")
    rec = {r.key: r for r in same.derived_settings}
    assert rec["tasks.train_seed"].explicit and not rec["tasks.train_seed"].overridden
    assert not rec["rollout.seed"].explicit
    assert _logged(same, caplog) == []


def test_a_seed_the_config_file_sets_wins_over_the_derived_one(tmp_path, caplog):
    """A config file that writes `rollout.seed: 0`: with seed=3 it stays 0 (and says so); the
    seeds it leaves out follow seed. The shipped quickstart writes none: all follow seed."""
    text = (
        (EXAMPLES / "quickstart.yaml")
        .read_text()
        .replace("\nrollout:\n", "\nrollout:\n  seed: 0\n")
    )
    (config := tmp_path / "pinned.yaml").write_text(text)
    job = _job("seed=3", path=config)
    assert _seeds(job) == (1237, 3, 0, 1_000_003)
    assert "rollout.seed=0 set explicitly (derived from seed=3: 3)" in _logged(job, caplog)
    # precision pinned: "auto" is bf16 on a CPU with AVX512-BF16/AMX, and there the shipped
    # rollout.dtype=float32 is a deliberate override (logged); the seeds must log nothing
    shipped = _job("seed=3", "precision.params_dtype=fp32", path=EXAMPLES / "quickstart.yaml")
    assert _seeds(shipped) == (1237, 3, 3, 1_000_003)
    assert _logged(shipped, caplog) == []
    on_bf16 = _job("seed=3", "precision.params_dtype=bf16", path=EXAMPLES / "quickstart.yaml")
    assert _logged(on_bf16, caplog) == [
        "rollout.dtype=float32 set explicitly (derived from precision.params_dtype=bf16: bfloat16)"
    ]


def test_a_seed_whose_train_seed_is_the_heldout_seed_is_refused():
    with pytest.raises(ValueError, match=r"seed=1000003 gives tasks.train_seed=1000003, which "
                       r"equals tasks.eval_seed=1000003.*use another seed"):  # fmt: skip
        _job("seed=1000003")
    assert _job("seed=1000003", "tasks.train_seed=1").tasks.train_seed == 1


def test_max_model_len_follows_the_model_and_is_cross_checked(caplog):
    job = _job("model.max_position_embeddings=512")
    assert job.rollout.max_model_len == 512
    assert _job().rollout.max_model_len == _job().model.max_position_embeddings == 2048
    shorter = _job("model.max_position_embeddings=512", "rollout.max_model_len=300")
    assert shorter.rollout.max_model_len == 300
    assert _logged(shorter, caplog) == [
        "rollout.max_model_len=300 set explicitly (derived from "
        "model.max_position_embeddings=512: 512)"
    ]
    with pytest.raises(ValueError) as e:
        _job("model.max_position_embeddings=512", "rollout.max_model_len=1024")
    assert str(e.value) == (
        "rollout.max_model_len=1024 exceeds model.max_position_embeddings=512: the engine would "
        "sample episodes longer than the trainer's sequences; lower rollout.max_model_len to "
        "<= 512, or leave it out (it follows model.max_position_embeddings)"
    )
    # an equal value is fine; a derived length the action budget does not fit in says so
    assert _job("model.max_position_embeddings=512", "rollout.max_model_len=512")
    expected = (
        r"rollout.max_tokens_per_action=256: must be < rollout.max_model_len=64 "
        r"\(derived: rollout.max_model_len=64; set"
    )
    with pytest.raises(ValueError, match=expected):
        _job("model.max_position_embeddings=64")


def test_max_model_len_follows_an_hf_models_config(tmp_path):
    """With init_from_hf the model (so the engine length) comes from config.json."""
    hf = _llama_folder(
        tmp_path / "hf", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
        max_position_embeddings=3000, rope_theta=10000.0,
    )  # fmt: skip
    hf_job = (f"init_from_hf={hf}", "tokenizer.kind=hf", f"tokenizer.path={hf}")
    assert _job(*hf_job).rollout.max_model_len == 3000
    lowered = _job(*hf_job, "model.max_position_embeddings=1000")
    assert (lowered.model.max_position_embeddings, lowered.rollout.max_model_len) == (1000, 1000)
    with pytest.raises(ValueError, match="rollout.max_model_len=4096 exceeds model.max_position"):
        _job(*hf_job, "rollout.max_model_len=4096")


@pytest.mark.parametrize(
    ("precision", "dtype"),
    [
        (["precision.params_dtype=fp32"], "float32"),
        (["precision.params_dtype=bf16"], "bfloat16"),
        (["precision.params_dtype=fp16"], "float16"),
        (["precision.params_dtype=bf16", "precision.fp8=true"], "bfloat16"),
        (["precision.params_dtype=fp32", "precision.fp8=true"], "bfloat16"),
    ],
)
def test_engine_dtype_follows_the_precision(precision, dtype):
    job = _job(*precision)
    assert job.rollout.dtype == dtype
    p = job.precision
    assert engine_dtype(p.params_dtype, p.fp8) == dtype


def test_auto_precision_gives_the_engine_the_resolved_dtype():
    job = _job("precision.params_dtype=auto")
    assert job.precision.params_dtype in ("bf16", "fp32")
    assert job.rollout.dtype == {"bf16": "bfloat16", "fp32": "float32"}[job.precision.params_dtype]


def test_another_engine_dtype_is_allowed_and_logged(caplog):
    """bf16 rollouts of an fp32 trainer (docs/BENCHMARKS.md) stay possible."""
    job = _job("precision.params_dtype=fp32", "rollout.dtype=bfloat16")
    assert (job.precision.params_dtype, job.rollout.dtype) == ("fp32", "bfloat16")
    assert _logged(job, caplog) == [
        "rollout.dtype=bfloat16 set explicitly (derived from precision.params_dtype=fp32: float32)"
    ]
    fp8 = _job("precision.params_dtype=bf16", "precision.fp8=true", "rollout.dtype=float32")
    assert _logged(fp8, caplog) == [
        "rollout.dtype=float32 set explicitly (derived from precision.params_dtype=bf16, "
        "precision.fp8=true: bfloat16)"
    ]


def test_python_built_and_replaced_jobs_keep_their_values():
    """Only `load_config` knows which keys were written: a JobConfig built in Python keeps the
    values it is given, and dataclasses.replace keeps what the load resolved (an explicit
    bf16 engine of an fp32 trainer is not re-derived to float32)."""
    built = JobConfig(seed=5)
    assert _seeds(built)[:2] == (1234, 0) and built.derived_settings == []
    job = _job("seed=5", "rollout.dtype=bfloat16", "parallel.seed=1234")
    again = dataclasses.replace(job, model=dataclasses.replace(job.model, vocab_size=4096))
    assert (again.rollout.dtype, _seeds(again)) == ("bfloat16", (1234, 5, 5, 1_000_003))
    assert again.rollout.max_model_len == job.rollout.max_model_len


def _shipped_overrides(path: Path, tmp_path: Path) -> list[str]:
    """A stand-in SmolLM2-135M config.json for the configs that start from it (not downloaded
    here): the shipped files lower max_position_embeddings below its 8192."""
    if "SmolLM2" not in str(OmegaConf.load(path).get("init_from_hf")):
        return []
    hf = _llama_folder(  # SmolLM2-135M-Instruct's shape
        tmp_path / "smollm2", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
        max_position_embeddings=8192, rope_theta=100000.0,
    )  # fmt: skip
    return [f"init_from_hf={hf}", f"tokenizer.path={hf}"]


@pytest.mark.parametrize(
    "path", sorted([*EXAMPLES.glob("*.yaml"), *EXAMPLES.glob("cluster/*.yaml")]), ids=str
)
def test_shipped_configs_resolve_as_they_did(path, tmp_path):
    """Every shipped config sets seed 0 and rollout.dtype and leaves the other derived fields
    out: the seeds are today's (1234, 0, 0), the engine's context is the model's, its dtype the
    file's; only the dtype may differ from its derived value (an fp32 engine of a bf16 "auto"
    trainer)."""
    raw = OmegaConf.load(path)
    assert "seed" not in raw.rollout and "max_model_len" not in raw.rollout
    job = _job(*_shipped_overrides(path, tmp_path), path=path)
    assert _seeds(job) == (1234, 0, 0, 1_000_003)
    assert job.rollout.max_model_len == job.model.max_position_embeddings
    assert job.rollout.dtype == raw.rollout.dtype
    overridden = {r.key for r in job.derived_settings if r.overridden}
    assert overridden <= {"rollout.dtype"}


def test_help_shows_the_rule_of_a_derived_field():
    rows = dict(describe(JobConfig))
    assert rows["parallel.seed"] == "1234 + seed (derived unless set)"
    assert rows["tasks.train_seed"] == rows["rollout.seed"] == "seed (derived unless set)"
    assert rows["rollout.max_model_len"] == "model.max_position_embeddings (derived unless set)"
    assert rows["rollout.dtype"].startswith("precision's (fp32 -> float32")
    assert rows["tasks.eval_seed"] == "1000003" and rows["seed"] == "0"


@pytest.mark.parametrize(
    "algorithm,fix",
    [
        (["algorithm.name=sao"], "algorithm.importance.weighting=decoupled_ppo"),
        (["algorithm.name=sao", "algorithm.importance.weighting=dis_band"], "decoupled_ppo"),
        (["algorithm.name=grpo_dis", "stages=[sft,rl]"], "algorithm.name=grpo"),
    ],
)
def test_an_engine_dtype_under_a_ratio_anchored_at_the_engine_warns(algorithm, fix):
    """rollout.dtype set apart from the trainer's under a policy ratio on the engine's log-probs
    (SAO as shipped, GRPO+DIS): a warning that names the dtypes, the algorithm and both fixes."""
    job = _job("precision.params_dtype=fp32", "rollout.dtype=bfloat16", *algorithm)
    msg = engine_anchor_warning(job)
    assert msg is not None and msg.startswith(
        "rollout.dtype=bfloat16 differs from the trainer's float32 (precision.params_dtype=fp32)"
    ), msg
    assert f"algorithm.name={job.algorithm.name!r}" in msg
    assert "Leave rollout.dtype out" in msg and fix in msg


@pytest.mark.parametrize(
    "overrides",
    [
        ["algorithm.name=grpo", "stages=[sft,rl]"],  # its clip is on the recomputed l_old
        ["algorithm.name=sao", "algorithm.importance.weighting=decoupled_ppo"],
        ["algorithm.name=sao", "algorithm.importance.weighting=none"],  # no ratio
        ["algorithm.name=sao", "rollout.dtype=float32"],  # the trainer's own dtype
        ["algorithm.name=sao", "precision.params_dtype=bf16", "rollout.dtype=bfloat16"],
        ["algorithm.name=sao", "stages=[sft]"],  # no RL stage, no ratio (a study's shared SFT)
        ["algorithm.name=sao", "stages=[sft,value_pretrain]"],
    ],
)
def test_no_engine_anchor_warning_without_both_causes(overrides):
    job = _job("precision.params_dtype=fp32", "rollout.dtype=bfloat16", *overrides)
    assert engine_anchor_warning(job) is None
    assert engine_anchor_warning(_job("algorithm.name=sao")) is None  # dtype derived
