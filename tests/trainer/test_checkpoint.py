"""CheckpointManager: round trip, resharded load on 2 gloo ranks, atomicity, keep_last_k,
corruption and incompatibility detected before any tensor changes, RNG restore.

The model is a real Megatron ColumnParallelLinear -> RowParallelLinear pair whose full weights
come from a seeded generator, so every rank knows the exact expected values of its shard under
any TP size.
"""

from __future__ import annotations

import json
import logging
import os
import random
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from sao_megatron.trainer import checkpoint as ckpt
from sao_megatron.trainer.checkpoint import (
    CheckpointConfig,
    CheckpointError,
    CheckpointManager,
    CommonState,
    clear_optimizer_state,
)
from sao_megatron.trainer.checkpoint import io as ckpt_io
from tests.conftest import launch

HIDDEN, FFN = 8, 12


# ---------------------------------------------------------------- Megatron test model -------------
def _full_weights(seed: int, ffn: int = FFN) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "fc1.weight": torch.randn(ffn, HIDDEN, generator=g),
        "fc1.bias": torch.randn(ffn, generator=g),
        "fc2.weight": torch.randn(HIDDEN, ffn, generator=g),
        "fc2.bias": torch.randn(HIDDEN, generator=g),
    }


def _shard(full: dict[str, torch.Tensor], tp_rank: int, tp: int) -> dict[str, torch.Tensor]:
    """Megatron's TP split: column-parallel fc1 by rows, row-parallel fc2 by columns."""
    return {
        "fc1.weight": full["fc1.weight"].chunk(tp, 0)[tp_rank],
        "fc1.bias": full["fc1.bias"].chunk(tp, 0)[tp_rank],
        "fc2.weight": full["fc2.weight"].chunk(tp, 1)[tp_rank],
        "fc2.bias": full["fc2.bias"],
    }


def _build_model(tp: int, seed: int | None, ffn: int = FFN):
    """A MegatronModule with fc1 (ColumnParallelLinear) and fc2 (RowParallelLinear); weights are
    the seed's full weights sharded for this TP rank, or NaN when seed is None."""
    from megatron.core import parallel_state as ps
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.module import MegatronModule

    cfg = ModelParallelConfig(
        tensor_model_parallel_size=tp, use_cpu_initialization=True, perform_initialization=False
    )

    class TinyTP(MegatronModule):
        def __init__(self) -> None:
            super().__init__(config=cfg)
            init = torch.nn.init.zeros_
            self.fc1 = ColumnParallelLinear(
                HIDDEN, ffn, config=cfg, init_method=init, bias=True, gather_output=False
            )
            self.fc2 = RowParallelLinear(
                ffn,
                HIDDEN,
                config=cfg,
                init_method=init,
                bias=True,
                input_is_parallel=True,
                skip_bias_add=False,
            )

    model = TinyTP()
    if seed is None:
        values = {
            k: torch.full_like(v, float("nan"))
            for k, v in model.state_dict().items()
            if not k.endswith("_extra_state")
        }
    else:
        values = _shard(_full_weights(seed, ffn), ps.get_tensor_model_parallel_rank(), tp)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(values[name])
    return model


def _init_world(world: int, tp: int) -> None:
    """Megatron's model-parallel state at ``tp`` on the torch.distributed world (made here when
    absent: 1 rank on an in-memory store; `launch` made the 2-rank one from its env vars)."""
    from megatron.core import parallel_state as ps

    from sao_megatron.platform import enable_cpu_compat

    if not dist.is_initialized():
        if world == 1:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        else:
            dist.init_process_group("gloo")  # env:// from `launch`
    enable_cpu_compat()
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)


@pytest.fixture(scope="module")
def one_rank():
    """A 1-rank gloo world with Megatron model-parallel state (TP=1) for this module's tests."""
    from megatron.core import parallel_state as ps

    from sao_megatron.platform import disable_cpu_compat

    owned = not dist.is_initialized()
    _init_world(1, tp=1)
    yield
    ps.destroy_model_parallel()
    disable_cpu_compat()
    if owned:
        dist.destroy_process_group()


def _params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _assert_all_nan(model) -> None:
    for name, p in model.named_parameters():
        assert torch.isnan(p).all(), f"{name} was modified"


@dataclass(kw_only=True)
class _RunCfg:
    lr: float = 1e-3
    name: str = "tiny"


def _save(mgr: CheckpointManager, step: int, seed: int = 0, **kw) -> Path:
    model = _build_model(1, seed)
    common = CommonState(train_step=step, policy_version=step + 1, data_cursor={"index": step})
    return mgr.save({"policy": model.sharded_state_dict()}, common, layout={"tp": 1}, **kw)


# ---------------------------------------------------------------- config --------------------------
@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"save_interval": -1}, "checkpoint.save_interval=-1"),
        ({"keep_last_k": -2}, "checkpoint.keep_last_k=-2"),
        ({"resume": ""}, "checkpoint.resume=''"),
        ({"save_dir": ""}, "checkpoint.save_dir=''"),
    ],
)
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field.replace("(", r"\(")):
        CheckpointConfig(**kwargs)


def test_removed_async_save_key_is_a_clear_error():
    from sao_megatron.configs import load_config
    from sao_megatron.trainer.job import JobConfig

    with pytest.raises(
        ValueError, match=r"'checkpoint.async_save' was removed: saving is synchronous"
    ):
        load_config(JobConfig, None, ["checkpoint.async_save=false"])
    with pytest.raises(TypeError, match="async_save"):
        CheckpointConfig(async_save=False)


def test_should_save_interval():
    mgr = CheckpointManager(CheckpointConfig(save_interval=3))
    assert [s for s in range(10) if mgr.should_save(s)] == [3, 6, 9]
    assert not any(CheckpointManager(CheckpointConfig()).should_save(s) for s in range(10))


# ---------------------------------------------------------------- single rank ---------------------
def test_round_trip_all_parts(one_rank, tmp_path):
    tok = tmp_path / "tok.model"
    tok.write_bytes(bytes(range(256)))
    mgr = CheckpointManager(CheckpointConfig(save_dir=str(tmp_path / "ck"), resume="auto"))
    policy, value = _build_model(1, seed=1), _build_model(1, seed=2)
    expected_policy, expected_value = _params(policy), _params(value)
    common = CommonState(
        train_step=12,
        policy_version=13,
        data_cursor={"epoch": 1, "index": 40},
        extra={"stage": "rl"},
    )
    path = mgr.save(
        {"policy": policy.sharded_state_dict(), "value": value.sharded_state_dict()},
        common,
        layout={"tp": 1, "pp": 1, "ep": 1, "dp": 1},
        run_config=_RunCfg(lr=0.5),
        tokenizer_files=[tok],
    )
    assert path == tmp_path / "ck" / "step_00000012"
    assert (tmp_path / "ck" / "latest").read_text().strip() == "step_00000012"

    policy2, value2 = _build_model(1, seed=None), _build_model(1, seed=None)
    resume = mgr.resolve_resume()
    assert resume == path
    result = mgr.load(
        resume, {"policy": policy2.sharded_state_dict(), "value": value2.sharded_state_dict()}
    )
    for name, ref in expected_policy.items():
        torch.testing.assert_close(dict(policy2.named_parameters())[name], ref, rtol=0, atol=0)
    for name, ref in expected_value.items():
        torch.testing.assert_close(dict(value2.named_parameters())[name], ref, rtol=0, atol=0)
    assert result.common.train_step == 12 and result.common.policy_version == 13
    assert result.common.data_cursor == {"epoch": 1, "index": 40}
    assert result.common.extra == {"stage": "rl"}
    assert result.skipped_parts == {}
    man = result.manifest
    assert man["world_size"] == 1 and man["layout"]["tp"] == 1
    assert man["parts"] == ["policy", "value"]
    import megatron.core

    assert man["megatron_core_version"] == megatron.core.__version__
    assert "lr: 0.5" in (path / "config.yaml").read_text()
    assert (path / "tokenizer" / "tok.model").read_bytes() == bytes(range(256))
    sizes = {rel: info["size"] for rel, info in man["files"].items()}
    assert sizes["tokenizer/tok.model"] == 256
    assert any(rel.startswith("policy/") and rel.endswith(".distcp") for rel in sizes)


def test_rng_restore_reproduces_draws(one_rank, tmp_path):
    from megatron.core import tensor_parallel

    mgr = CheckpointManager(CheckpointConfig(save_dir=str(tmp_path)))
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    tensor_parallel.model_parallel_cuda_manual_seed(5)  # Megatron's model-parallel tracker
    path = _save(mgr, step=1)

    def draws():
        with tensor_parallel.get_cuda_rng_tracker().fork():
            tracked = torch.rand(2).tolist()
        return random.random(), np.random.rand(3).tolist(), torch.rand(4).tolist(), tracked

    expected = draws()
    random.seed(99), np.random.seed(99), torch.manual_seed(99)
    tensor_parallel.model_parallel_cuda_manual_seed(99)
    changed = draws()
    assert all(a != b for a, b in zip(changed, expected, strict=True))
    result = mgr.load(path, {"policy": _build_model(1, None).sharded_state_dict()})
    assert result.rng_restored
    assert draws() == expected


def test_keep_last_k_prunes_after_completion(one_rank, tmp_path):
    mgr = CheckpointManager(CheckpointConfig(save_dir=str(tmp_path), keep_last_k=2))
    for step in range(1, 5):
        _save(mgr, step)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [3, 4]
    assert ckpt.find_latest(tmp_path) == tmp_path / "step_00000004"
    keep_all = CheckpointManager(CheckpointConfig(save_dir=str(tmp_path / "all"), keep_last_k=0))
    for step in range(1, 4):
        _save(keep_all, step)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path / "all")] == [1, 2, 3]


def test_crash_before_manifest_keeps_previous_latest(one_rank, tmp_path, monkeypatch, caplog):
    mgr = CheckpointManager(CheckpointConfig(save_dir=str(tmp_path), keep_last_k=1))
    _save(mgr, step=1, seed=1)

    def crash(*_args, **_kw):
        raise OSError("disk full (simulated)")

    with monkeypatch.context() as m:  # dies while hashing files, before manifest.json exists
        m.setattr(ckpt_io, "sha256", crash)
        with pytest.raises(CheckpointError, match="disk full"):
            _save(mgr, step=2, seed=2)
    stale = ckpt.stale_tmp_dirs(tmp_path)
    assert len(stale) == 1 and not (stale[0] / "manifest.json").exists()
    assert ckpt.find_latest(tmp_path) == tmp_path / "step_00000001"
    resume = mgr.resolve_resume()
    assert any("interrupted save" in m for _, m in _job_log(caplog))
    model = _build_model(1, None)
    assert mgr.load(resume, {"policy": model.sharded_state_dict()}).common.train_step == 1
    for name, ref in _params(_build_model(1, seed=1)).items():
        assert torch.equal(dict(model.named_parameters())[name], ref)
    with pytest.raises(CheckpointError, match="partial"):
        ckpt.validate_checkpoint(stale[0])
    _save(mgr, step=2, seed=2)  # the next complete save removes the leftover and prunes step 1
    assert ckpt.stale_tmp_dirs(tmp_path) == []
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [2]


def test_crash_before_latest_update_then_resave(one_rank, tmp_path, monkeypatch):
    mgr = CheckpointManager(CheckpointConfig(save_dir=str(tmp_path), keep_last_k=3))
    _save(mgr, step=1, seed=1)
    real = ckpt_io.atomic_write_text

    def crash_on_latest(path, text):
        if path.name == "latest":
            raise OSError("killed (simulated)")
        real(path, text)

    with monkeypatch.context() as m:
        m.setattr(ckpt_io, "atomic_write_text", crash_on_latest)
        with pytest.raises(CheckpointError, match="killed"):
            _save(mgr, step=2, seed=2)
    assert ckpt.find_latest(tmp_path) == tmp_path / "step_00000001"
    _save(mgr, step=2, seed=3)  # a resumed run re-saves step 2: the old folder is replaced
    model = _build_model(1, None)
    mgr.load(tmp_path / "step_00000002", {"policy": model.sharded_state_dict()})
    for name, ref in _params(_build_model(1, seed=3)).items():
        assert torch.equal(dict(model.named_parameters())[name], ref)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latest",
        "step_00000001",
        "step_00000002",
    ]


def _first_distcp(path: Path) -> Path:
    return sorted((path / "policy").glob("*.distcp"))[0]


@pytest.mark.parametrize(
    "damage", ["truncate", "flip_byte", "delete", "edit_manifest", "no_manifest"]
)
def test_corrupted_checkpoint_detected_before_loading(one_rank, tmp_path, damage):
    mgr = CheckpointManager(CheckpointConfig(save_dir=str(tmp_path)))
    path = _save(mgr, step=3)
    shard = _first_distcp(path)
    manifest = path / "manifest.json"
    if damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:-10])
        expected = f"corrupted: policy/{shard.name}: size"
    elif damage == "flip_byte":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
        expected = f"corrupted: policy/{shard.name}: sha256"
    elif damage == "delete":
        shard.unlink()
        expected = f"corrupted: policy/{shard.name}: missing"
    elif damage == "edit_manifest":
        man = json.loads(manifest.read_text())
        man["files"]["common/state.pt"]["size"] += 1
        manifest.write_text(json.dumps(man))
        expected = "corrupted: common/state.pt: size"
    else:
        manifest.unlink()
        expected = "partial: manifest.json is missing"
    model = _build_model(1, None)
    with pytest.raises(CheckpointError, match=expected) as info:
        mgr.load(path, {"policy": model.sharded_state_dict()})
    assert str(path) in str(info.value) and "resume" in str(info.value)  # path and the fix
    _assert_all_nan(model)


def test_bad_pointers_and_paths(one_rank, tmp_path):
    (tmp_path / "latest").write_text("step_00000007\n")
    mgr = CheckpointManager(CheckpointConfig(save_dir=str(tmp_path)))
    with pytest.raises(CheckpointError, match="names 'step_00000007'"):
        mgr.resolve_resume()
    missing = CheckpointManager(CheckpointConfig(resume=str(tmp_path / "nope")))
    with pytest.raises(CheckpointError, match="checkpoint.resume=.*nope"):
        missing.resolve_resume()
    assert (
        CheckpointManager(CheckpointConfig(save_dir=str(tmp_path / "empty"))).resolve_resume()
        is None
    )
    assert CheckpointManager(CheckpointConfig(resume="none")).resolve_resume() is None
    with pytest.raises(CheckpointError, match="does not exist"):
        mgr.load(tmp_path / "step_00000009", {})


def test_incompatible_part_never_half_loads(one_rank, tmp_path, caplog):
    mgr = CheckpointManager(CheckpointConfig(save_dir=str(tmp_path)))
    policy, value = _build_model(1, seed=1), _build_model(1, seed=2)
    path = mgr.save(
        {"policy": policy.sharded_state_dict(), "value": value.sharded_state_dict()},
        CommonState(train_step=1),
    )
    policy2, wide_value = _build_model(1, None), _build_model(1, None, ffn=16)
    parts = {"policy": policy2.sharded_state_dict(), "value": wide_value.sharded_state_dict()}
    with pytest.raises(
        CheckpointError,
        match=r"part 'value'.*fc1.weight' global shape \[12, 8\] "
        r"!= requested \[16, 8\].*Nothing was loaded",
    ):
        mgr.load(path, parts)
    _assert_all_nan(policy2)
    with pytest.raises(CheckpointError, match=r"no part\(s\) \['optimizer'\]"):
        mgr.load(path, {"policy": policy2.sharded_state_dict(), "optimizer": {}})
    _assert_all_nan(policy2)
    parts = {"policy": policy2.sharded_state_dict(), "value": wide_value.sharded_state_dict()}
    result = mgr.load(path, parts, optional_parts=["value"])
    assert list(result.skipped_parts) == ["value"]
    assert any("not loading part 'value'" in m for _, m in _job_log(caplog))
    for name, ref in _params(policy).items():
        assert torch.equal(dict(policy2.named_parameters())[name], ref)
    _assert_all_nan(wide_value)


class _Counter:
    """A Stateful test object (as the run state or the task stream would be)."""

    def __init__(self, value: int = 0) -> None:
        self.value = value
        self.loaded: list[dict] = []

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state_dict: dict) -> None:
        self.loaded.append(dict(state_dict))
        self.value = state_dict["value"]


def test_stateful_objects_round_trip_by_name(one_rank, tmp_path, caplog):
    mgr = CheckpointManager(CheckpointConfig(save_dir=str(tmp_path)))
    run, tasks = _Counter(7), _Counter(64)
    assert isinstance(run, ckpt.Stateful)
    path = mgr.save(
        {"policy": _build_model(1, seed=1).sharded_state_dict()},
        train_step=5,
        states={"run": run, "tasks": tasks},
    )
    assert path.name == "step_00000005"
    run2, tasks2, model = _Counter(), _Counter(), _build_model(1, None)
    result = mgr.load(path, {"policy": model.sharded_state_dict()}, states={"run": run2})
    assert run2.loaded == [{"value": 7}] and run2.value == 7
    assert result.states == {"run": {"value": 7}, "tasks": {"value": 64}}
    assert result.common.train_step == 5 and result.common.policy_version == 0
    # a name the checkpoint lacks: an error before any tensor or object changes...
    fresh, nan_model = _Counter(3), _build_model(1, None)
    with pytest.raises(CheckpointError, match=r"Stateful 'sched' not in checkpoint.*Nothing was"):
        mgr.load(
            path, {"policy": nan_model.sharded_state_dict()}, states={"run": fresh, "sched": tasks2}
        )
    _assert_all_nan(nan_model)
    assert fresh.loaded == [] and tasks2.loaded == []
    # ... unless it is optional: skipped, reported, the others load
    result = mgr.load(
        path,
        {"policy": nan_model.sharded_state_dict()},
        states={"run": fresh, "sched": tasks2},
        optional_parts=["sched"],
    )
    assert ("WARNING", f"not loading part 'sched' of {path}: {result.skipped_parts['sched']}") in (
        _job_log(caplog)
    )
    assert list(result.skipped_parts) == ["sched"] and fresh.value == 7 and tasks2.loaded == []
    with pytest.raises(ValueError, match="train_step=4 != common.train_step=5"):
        mgr.save({}, CommonState(train_step=5), train_step=4)


# ---------------------------------------------------------------- two ranks -----------------------
def _two_rank_worker(rank: int, world: int, root: str) -> None:
    from megatron.core import parallel_state as ps

    mgr = CheckpointManager(CheckpointConfig(save_dir=root))
    _init_world(world, tp=2)  # save with TP=2
    model = _build_model(2, seed=7)
    torch.manual_seed(100 + rank)
    mgr.save(
        {"policy": model.sharded_state_dict()},
        CommonState(train_step=5),
        layout={"tp": 2, "dp": 1},
    )
    after_save = torch.rand(3)
    _init_world(world, tp=1)  # load with TP=1, DP=2: every rank holds full weights
    full = _build_model(1, None)
    torch.manual_seed(0)
    result = mgr.load(mgr.resolve_resume(), {"policy": full.sharded_state_dict()})
    for name, ref in _full_weights(7).items():
        torch.testing.assert_close(dict(full.named_parameters())[name], ref, rtol=0, atol=0)
    assert result.rng_restored and torch.equal(torch.rand(3), after_save)  # per-rank RNG
    assert result.manifest["layout"] == {"tp": 2, "dp": 1}
    mgr.save({"policy": full.sharded_state_dict()}, CommonState(train_step=6))
    _init_world(world, tp=2)  # and back: TP=1 (DP=2) checkpoint -> TP=2 shards
    shard = _build_model(2, None)
    mgr.load(mgr.resolve_resume(), {"policy": shard.sharded_state_dict()})
    for name, ref in _shard(_full_weights(7), ps.get_tensor_model_parallel_rank(), 2).items():
        torch.testing.assert_close(dict(shard.named_parameters())[name], ref, rtol=0, atol=0)
    ps.destroy_model_parallel()


@pytest.mark.distributed
def test_two_ranks_resharded_load(tmp_path):
    launch(_two_rank_worker, 2, str(tmp_path))  # a rank's failure fails the test
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_00000005", "step_00000006"]


# ---------------------------------------------------------------- real policy + optimiser --------
def _build_policy_and_optimizer(model_cfg, optim):
    """(policy chunk, its Megatron optimiser bundle) at 1 rank, parallel seed 3."""
    from sao_megatron.models import build_policy
    from sao_megatron.optim import PrecisionConfig, build_optimizer
    from sao_megatron.parallel import ParallelConfig, initialize_parallel

    parallel = initialize_parallel(ParallelConfig(seed=3))
    chunks = build_policy(model_cfg, parallel, PrecisionConfig())
    return chunks[0], build_optimizer(chunks, parallel, optim, PrecisionConfig())


def _random_step(train, seed: int) -> float:
    """One optimiser update on N(0, 0.1) gradients drawn from `seed`; returns the LR it used."""
    lr = train.optimizer.param_groups[0]["lr"]
    g = torch.Generator().manual_seed(seed)
    for p in train.model[0].parameters():
        p.main_grad.copy_(torch.randn(p.shape, generator=g) * 0.1)
    assert train.step()[0]
    return lr


def _assert_same_params(model, expected: dict[str, torch.Tensor]) -> None:
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, expected[name], rtol=0, atol=0, msg=name)


def _policy_parts(model, train, loading: bool) -> dict:
    """The policy and policy_optimizer sharded state dicts, as the trainer saves them."""
    return {
        "policy": model.sharded_state_dict(),
        "policy_optimizer": train.optimizer.sharded_state_dict(
            model.sharded_state_dict(), is_loading=loading
        ),
    }


def test_policy_and_optimizer_resume_continues_exactly(one_rank, tmp_path):
    """MoE policy + Megatron Adam: the resumed run's next step equals the uninterrupted one."""
    from megatron.core import parallel_state as ps

    from sao_megatron.optim import OptimizerConfig
    from sao_megatron.parallel import destroy_parallel

    model_cfg = _small_moe(num_hidden_layers=2, num_experts=4)

    def build():
        return _build_policy_and_optimizer(model_cfg, OptimizerConfig(lr=1e-2))

    step, parts = _random_step, _policy_parts

    ps.destroy_model_parallel()
    try:
        mgr = CheckpointManager(CheckpointConfig(save_dir=str(tmp_path)))
        model, train = build()
        step(train, 1)
        mgr.save(parts(model, train, False), CommonState(train_step=1))
        step(train, 2)  # the uninterrupted run's step 2
        expected = {k: v.detach().clone() for k, v in model.named_parameters()}
        destroy_parallel()

        model, train = build()  # as a fresh process: initial weights, empty Adam state
        result = mgr.load(mgr.resolve_resume(), parts(model, train, True))
        train.optimizer.load_state_dict(result.state_dicts["policy_optimizer"])
        step(train, 2)
        _assert_same_params(model, expected)
        destroy_parallel()
    finally:
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(tensor_model_parallel_size=1)


def test_optimizer_saved_before_its_first_step_restarts_quietly(one_rank, tmp_path, caplog):
    """A run saved right after value pre-training (policy step 0) holds an Adam with no
    moments: resuming it is no layout change, so no warning, and its next step equals the
    uninterrupted run's."""
    from megatron.core import parallel_state as ps

    from sao_megatron.optim import OptimizerConfig
    from sao_megatron.parallel import destroy_parallel

    model_cfg = _small_moe(num_hidden_layers=1, num_experts=2)

    def build():
        return _build_policy_and_optimizer(model_cfg, OptimizerConfig(lr=1e-2))

    def step(train):
        _random_step(train, 5)

    parts = _policy_parts

    ps.destroy_model_parallel()
    try:
        mgr = CheckpointManager(CheckpointConfig(save_dir=str(tmp_path)))
        model, train = build()
        path = mgr.save(parts(model, train, False), CommonState(train_step=0))
        step(train)
        expected = {k: v.detach().clone() for k, v in model.named_parameters()}
        destroy_parallel()

        model, train = build()
        caplog.clear()
        caplog.set_level(logging.INFO, logger="sao_megatron.trainer")
        result = mgr.load(path, parts(model, train, True))  # not optional: still no error
        reason = result.skipped_parts["policy_optimizer"]
        assert reason.startswith("saved before the optimiser's first step")
        assert ("INFO", f"not loading part 'policy_optimizer' of {path}: {reason}") in (
            _job_log(caplog)
        )
        assert not [m for lvl, m in _job_log(caplog) if lvl == "WARNING"]
        clear_optimizer_state(train.optimizer)  # as the trainer does for a part not loaded
        step(train)
        _assert_same_params(model, expected)
        destroy_parallel()
    finally:
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(tensor_model_parallel_size=1)


@pytest.mark.parametrize("api", ["stateful", "extra"])
def test_lr_schedule_resumed_inside_warmup_matches_uninterrupted(one_rank, tmp_path, api):
    """Issue 19.3: saved at step 3 of a 10-step warm-up, the resumed run's LR at every later
    update equals the uninterrupted run's (update k uses lr * k / warmup). The scheduler is
    checkpointed as a Stateful ("stateful") or as a dict in CommonState.extra ("extra")."""
    from megatron.core import parallel_state as ps

    from sao_megatron.optim import OptimizerConfig
    from sao_megatron.parallel import destroy_parallel

    model_cfg = _small_moe(num_hidden_layers=1, num_experts=2)
    optim = OptimizerConfig(lr=1e-3, warmup_steps=10, decay_style="linear", decay_steps=10)

    def build():
        return _build_policy_and_optimizer(model_cfg, optim)

    step, parts = _random_step, _policy_parts

    ps.destroy_model_parallel()
    try:
        mgr = CheckpointManager(CheckpointConfig(save_dir=str(tmp_path)))
        model, train = build()
        uninterrupted = [step(train, s) for s in range(1, 4)]
        if api == "stateful":
            mgr.save(parts(model, train, False), train_step=3, states={"sched": train.scheduler})
        else:
            common = CommonState(train_step=3, extra={"sched": train.scheduler.state_dict()})
            mgr.save(parts(model, train, False), common)
        uninterrupted += [step(train, s) for s in range(4, 25)]
        destroy_parallel()

        model, train = build()  # a fresh process resumes from step 3
        states = {"sched": train.scheduler} if api == "stateful" else {}
        result = mgr.load(mgr.resolve_resume(), parts(model, train, True), states=states)
        train.optimizer.load_state_dict(result.state_dicts["policy_optimizer"])
        if api == "extra":
            train.scheduler.load_state_dict(result.common.extra["sched"])
        assert result.common.train_step == 3
        resumed = [step(train, s) for s in range(4, 25)]
        destroy_parallel()
    finally:
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(tensor_model_parallel_size=1)
    # float64 reference: warm-up lr * k / 10 for k = 1..10, then linear decay to 0 over 10
    ref = [1e-3 * k / 10 for k in range(1, 11)] + [1e-3 * (1 - j / 10) for j in range(1, 11)]
    assert uninterrupted[:20] == pytest.approx(ref, rel=1e-12, abs=1e-15)
    assert uninterrupted[3] == pytest.approx(4.0e-4, rel=1e-12)
    assert resumed == uninterrupted[3:]  # exactly, at every update after the resume


# ---------------------------------------------------------------- missing `latest`, pruning -------
@pytest.mark.parametrize("pointer", [None, "garbage\n", "step_00000009\n", ""])
def test_missing_or_garbled_latest_resumes_newest_complete(one_rank, tmp_path, pointer, caplog):
    """Issue 19.4: complete step folders without a usable ``latest`` resume from the newest
    complete one (with a warning) instead of starting fresh."""
    mgr = CheckpointManager(CheckpointConfig(save_dir=str(tmp_path), keep_last_k=0))
    for step in (1, 2, 3):
        _save(mgr, step, seed=step)
    (tmp_path / "latest").unlink()
    if pointer is not None:
        (tmp_path / "latest").write_text(pointer)
    resume = mgr.resolve_resume()
    assert resume == tmp_path / "step_00000003"
    assert any(
        level == "WARNING" and "resuming from the newest complete step folder" in m
        for level, m in _job_log(caplog)
    )
    model = _build_model(1, None)
    assert mgr.load(resume, {"policy": model.sharded_state_dict()}).common.train_step == 3
    for name, ref in _params(_build_model(1, seed=3)).items():
        assert torch.equal(dict(model.named_parameters())[name], ref)


def _job_log(caplog) -> list[tuple[str, str]]:
    """(level, message) of the records logged under the job's logger, sao_megatron.trainer."""
    return [
        (r.levelname, r.getMessage())
        for r in caplog.records
        if r.name == "sao_megatron.trainer" or r.name.startswith("sao_megatron.trainer.")
    ]


def test_resume_messages_reach_the_job_log_with_warnings_ignored(one_rank, tmp_path, caplog):
    """Issue 31.5: what resolving the resume point decides is logged through the job's logger
    (sao_megatron.trainer), so it is in the job log even under PYTHONWARNINGS=ignore: a missing
    ``latest`` (resuming from the newest complete step), a leftover of an interrupted save, and
    a resume=auto that finds nothing (a fresh start)."""
    mgr = CheckpointManager(CheckpointConfig(save_dir=str(tmp_path), keep_last_k=0))
    _save(mgr, 1)
    _save(mgr, 2)
    (tmp_path / "latest").unlink()
    (tmp_path / "step_00000003.tmp-0123abcd").mkdir()
    empty = CheckpointManager(CheckpointConfig(save_dir=str(tmp_path / "none_yet")))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # what PYTHONWARNINGS=ignore does
        with caplog.at_level(logging.INFO, logger="sao_megatron.trainer"):
            assert mgr.resolve_resume() == tmp_path / "step_00000002"
            assert empty.resolve_resume() is None
    stale, latest = tmp_path / "step_00000003.tmp-0123abcd", tmp_path / "latest"
    assert _job_log(caplog) == [
        ("WARNING", f"checkpoint.resume=auto: ignoring {stale}: left by an interrupted save"),
        (
            "WARNING",
            f"checkpoint.resume=auto: {latest} is missing; resuming from the newest complete "
            f"step folder {tmp_path / 'step_00000002'} (set checkpoint.resume=<path> to choose "
            "another, or checkpoint.resume=none)",
        ),
        ("INFO", f"checkpoint.resume=auto: no checkpoint in {tmp_path / 'none_yet'}; start fresh"),
    ]


def test_missing_latest_with_incomplete_newest_folder_is_an_error(one_rank, tmp_path):
    """Newest step folder without a manifest and no ``latest``: which one to resume from is
    ambiguous, so the run stops and says how to choose."""
    mgr = CheckpointManager(CheckpointConfig(save_dir=str(tmp_path), keep_last_k=0))
    _save(mgr, 1)
    _save(mgr, 2)
    (tmp_path / "latest").unlink()
    (tmp_path / "step_00000002" / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=r"step_00000002.*checkpoint\.resume="):
        mgr.resolve_resume()


def test_pruning_never_deletes_newer_checkpoints(one_rank, tmp_path):
    """A run that starts fresh (resume=none) in a folder with newer checkpoints of an earlier
    run prunes only steps older than the one it just wrote."""
    earlier = CheckpointManager(CheckpointConfig(save_dir=str(tmp_path), keep_last_k=0))
    for step in (5, 6):
        _save(earlier, step)
    fresh = CheckpointManager(
        CheckpointConfig(save_dir=str(tmp_path), keep_last_k=1, resume="none")
    )
    assert fresh.resolve_resume() is None
    for step in (1, 2, 3):
        _save(fresh, step)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [3, 5, 6]
    keep2 = CheckpointManager(CheckpointConfig(save_dir=str(tmp_path), keep_last_k=2))
    _save(keep2, 7)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [6, 7]


def _small_moe(**kw):
    """A 32-wide MoE (2 heads, 1 KV head, top-2) for the resume tests; `kw` sets the rest."""
    from sao_megatron.models import MoEModelConfig

    base = dict(vocab_size=64, hidden_size=32, num_attention_heads=2, num_key_value_heads=1)
    base |= dict(head_dim=16, num_experts_per_tok=2, moe_intermediate_size=32)
    return MoEModelConfig(**base, **kw)
