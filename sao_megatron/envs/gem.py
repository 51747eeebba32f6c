"""GEM environments (gem-llm: GuessTheNumber, Mastermind, Sudoku, Minesweeper, reasoning-gym ...)
behind our `Environment` protocol, unmodified: ``{name: gem, options: {env_id: "game:..."}}``.

GEM (https://github.com/axon-rl/gem, Apache-2.0) is a gym for multi-turn LLM agents. Its API is
gymnasium's: ``reset(seed) -> (observation, info)``, ``step(action) -> (observation, reward,
terminated, truncated, info)``. What maps to what:

* ``reset(seed)`` -> the first user turn: GEM's observation as its observation wrappers show the
  latest one, ``info["prefix"] + observation (+ "\\n") + info["suffix"]`` (the suffix is the
  game's prompt, e.g. "Enter your next guess."; `include_suffix`). Later observations likewise,
  one per turn. The history is the episode itself: our episode formatter appends every turn
  through the chat template or the marker template (token-in/token-out), where GEM's
  ``concat_chat`` wrapper would re-render the whole conversation each turn. Nothing here is
  specific to a tokenizer or template.
* ``terminated`` (win, loss, a malformed action, and GEM's own max_turns, where GEM also sets
  ``truncated``) -> ``done``: the game is over, its last reward is final, GAE does not bootstrap.
  ``truncated`` without ``terminated`` -> ``truncated`` (bootstrapped from V). Our step cap
  (`max_turns`, and ``rollout.max_turns``) ends a game still running as truncated.
* reward -> reward, unchanged (GEM's games: 1 on a win, dense progress in Mastermind, -0.1 for
  an action that does not parse). A reward that is not a finite number, an observation that is
  not text, or an exception in GEM's ``step``/``reset`` is an environment error: the rollout
  ends that episode with status ``env_error`` and never trains it.
* info -> each step's info (so the trajectory's): GEM's scalar entries as ``gem/<key>``, and
  ``success``, ``gem_return`` (sum of GEM rewards so far), ``gem_terminated``,
  ``gem_truncated``, ``error: "malformed"`` for an action GEM could not parse (its
  ``format_error_reward`` on a terminating step). Held-out evaluation counts ``success``.
* success: the game terminated by itself, not at GEM's turn limit (``truncated`` False), with
  an episode return >= `success_threshold` (1.0: a won GuessTheNumber, a cracked Mastermind
  code, a solved Tower of Hanoi; GEM reports no success flag of its own).

Determinism and isolation. GEM's games draw from the *global* ``random`` and ``numpy.random``
(``reset(seed)`` calls ``random.seed(seed)`` and ``np.random.seed(seed)``; 2048 and Minesweeper
also draw in ``step``; constructors reseed from OS entropy). Every call into GEM therefore runs
under one process-wide lock with the global states swapped for this environment's own: an
episode is reproducible from its seed even with many episodes in worker threads, and the
trainer's global RNG states are left as they were. (Another thread that draws from the global
RNG without this lock during a GEM call sees the game's state; our code seeds its own
generators.) ``import gem`` configures the root logger (``logging.basicConfig``); it is undone.

Options are checked when the job config loads: the id must be registered in GEM (a close match
is suggested), its class must import, ids that download data at run time (Wordle, Hangman and
WordSearch fetch the nltk ``words`` corpus; ``math:``/``code:``/``qa:``/``eval:`` ids load
Hugging Face datasets) are refused unless `allow_downloads`, `kwargs` must be parameters of the
game's class, and the game is built and reset once (so a GEM id that cannot be built, e.g.
``game:FifteenPuzzle-v0-random`` in gem-llm 0.1.0, fails at load, not in the rollout).

Gold actions: GuessTheNumber (bisection), Mastermind (a consistent guess) and Tower of Hanoi
(the optimal move) have solvers (`sao_megatron.envs.gem_solvers`); for those ids the
environment has ``gold_action()`` and so gives demonstrations (``demonstrations.envs``).

Install: ``pip install --no-deps gem-llm==0.1.0`` (the Makefile does). ``--no-deps``: gem-llm
pins reasoning-gym==0.1.23 (we pin 0.1.25), nltk and msgspec; the games above import only
numpy and reasoning-gym.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import json
import logging
import math
import random
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from sao_megatron.envs.base import (
    StepResult,
    options_config,
    register_env,
    register_episode_metrics,
)
from sao_megatron.envs.gem_solvers import REASONED_SOLVERS, SOLVERS
from sao_megatron.envs.options import did_you_mean

GEM_PIN = "gem-llm==0.1.0"
#: step cap of a game with no turn limit of its own (and no `max_turns` option)
DEFAULT_MAX_TURNS = 100
#: GEM's reward for an action it cannot parse (gem.utils.constants.LanguageGameReward)
FORMAT_ERROR_REWARD = -0.1
#: game modules that download the nltk 'words' corpus when built
_NLTK_CORPUS_GAMES = ("hangman", "wordle", "word_search")
#: GEM info keys that are rendering hints (folded into the observation), not facts
_RENDER_KEYS = ("prefix", "suffix")

_IMPORT_LOCK = threading.Lock()
_RNG_LOCK = threading.RLock()


def gem_registry() -> dict[str, Any]:
    """GEM's environment registry (``gem.envs.registration.ENV_REGISTRY``: id -> EnvSpec),
    importing gem once with the root logger left as it was. Raises ValueError when gem-llm is
    not installed."""
    with _IMPORT_LOCK:
        root = logging.getLogger()
        handlers, level = list(root.handlers), root.level
        try:
            from gem.envs.registration import ENV_REGISTRY
        except ModuleNotFoundError as e:
            if e.name is None or e.name.split(".")[0] != "gem":
                raise
            raise ValueError(
                f"gem: the GEM environments need the package gem-llm: pip install --no-deps "
                f"{GEM_PIN} (or make install)"
            ) from None
        finally:
            root.handlers[:] = handlers
            root.setLevel(level)
    return ENV_REGISTRY


class PrivateRng:
    """The global ``random`` / ``numpy.random`` states one GEM game sees (see the module
    docstring); starts from fixed states, so even construction is deterministic."""

    def __init__(self) -> None:
        self._py = random.Random(0).getstate()
        self._np = np.random.RandomState(0).get_state()

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Run the body with this game's states installed globally, under the process lock."""
        with _RNG_LOCK:
            saved_py, saved_np = random.getstate(), np.random.get_state()
            random.setstate(self._py)
            np.random.set_state(self._np)
            try:
                yield
            finally:
                self._py, self._np = random.getstate(), np.random.get_state()
                random.setstate(saved_py)
                np.random.set_state(saved_np)


def entry_point(env_id: str) -> str:
    """GEM's ``module:Class`` of `env_id` (the registry's entry point)."""
    ep = gem_registry()[env_id].entry_point
    return ep if isinstance(ep, str) else f"{ep.__module__}:{ep.__qualname__}"


def _game_class(env_id: str) -> type:
    ep = gem_registry()[env_id].entry_point
    if not isinstance(ep, str):
        return ep
    module, name = ep.split(":")
    with _IMPORT_LOCK:
        root = logging.getLogger()
        handlers, level = list(root.handlers), root.level
        try:
            return getattr(importlib.import_module(module), name)
        finally:
            root.handlers[:] = handlers
            root.setLevel(level)


def _make(env_id: str, kwargs: dict[str, Any]) -> Any:
    """``gem.make(env_id, **kwargs)`` (call it with a `PrivateRng` active)."""
    from gem.envs.registration import make

    return make(env_id, **kwargs)


@functools.lru_cache(maxsize=256)
def _probe(env_id: str, kwargs_json: str) -> str | None:
    """Build and reset the game once; the error text, or None when it works."""
    try:
        with PrivateRng().active():
            game = _make(env_id, json.loads(kwargs_json))
            game.reset(seed=0)
    except Exception as e:  # noqa: BLE001 - any failure of GEM's code is reported
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    return None


@dataclass(kw_only=True)
class GemConfig:
    """Options of a GEM environment.

    Fields:
        env_id: a GEM environment id, e.g. "game:GuessTheNumber-v0-easy",
            "game:Mastermind-v0-easy", "game:Sudoku-v0-easy", "rg:chain_sum" (`python -c
            "import gem; gem.print_envs()"` lists them).
        kwargs: keyword arguments of gem.make, overriding the id's registered ones, e.g.
            {"max_number": 100}; each must be a parameter of the game's class.
        max_turns: our step cap per episode (>= 1): a game still running after it is
            truncated (bootstrapped); null: the game's own max_turns (it ends the game itself),
            or 100 for a game without one. rollout.max_turns caps it too.
        include_suffix: append GEM's info["suffix"] (the game's prompt, e.g. "Enter your next
            guess.", and for some games the board) to every observation, as GEM's observation
            wrappers do; false: GEM's observation text alone.
        success_threshold: an episode is a success when the game terminated by itself (not at
            GEM's turn limit) with a return >= this.
        allow_downloads: accept ids that download data at run time (nltk corpora, Hugging Face
            datasets; needs network and their packages, e.g. nltk, datasets).
        solver_reasoning: the gold solver (demonstrations) writes its reasoning before its
            answer: Mastermind lists the codes still consistent with the pegs ("Left: 23 25 26.
            \\boxed{2 3}"; their count when more than 12); GuessTheNumber's solver states its
            interval either way. Games whose solver has no reasoning (Tower of Hanoi) refuse it.
    """

    CONFIG_SECTION: ClassVar[str] = "gem"  # messages say gem.<field>

    env_id: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    max_turns: int | None = None
    include_suffix: bool = True
    success_threshold: float = 1.0
    allow_downloads: bool = False
    solver_reasoning: bool = False

    def __post_init__(self) -> None:
        if self.max_turns is not None and self.max_turns < 1:
            raise ValueError(f"gem.max_turns={self.max_turns}: must be >= 1 (or null)")
        if not math.isfinite(self.success_threshold):
            raise ValueError(f"gem.success_threshold={self.success_threshold}: must be finite")
        self.kwargs = dict(self.kwargs)
        registry = gem_registry()
        if self.env_id not in registry:
            raise ValueError(
                f"gem.env_id={self.env_id!r}: not a GEM environment id; "
                f"{did_you_mean(self.env_id, registry)}GEM has {len(registry)} ids, e.g. "
                f"{sorted(k for k in registry if k.startswith('game:'))[:6]} (list them: "
                "python -c 'import gem; gem.print_envs()')"
            )
        self._check_downloads(registry[self.env_id])
        try:
            cls = _game_class(self.env_id)
        except Exception as e:  # noqa: BLE001 - a missing optional package of GEM's
            raise ValueError(
                f"gem.env_id={self.env_id!r}: GEM's class {entry_point(self.env_id)} cannot be "
                f"imported ({type(e).__name__}: {e}); install what it needs or pick another id"
            ) from None
        self._check_kwargs(cls)
        if self.solver_reasoning and entry_point(self.env_id) not in REASONED_SOLVERS:
            raise ValueError(
                f"gem.solver_reasoning=true: {self.env_id!r} has no solver that writes its "
                f"reasoning (games with one: {sorted(REASONED_SOLVERS)}); set it false"
            )
        error = _probe(self.env_id, json.dumps(self.kwargs, sort_keys=True, default=str))
        if error is not None:
            raise ValueError(
                f"gem.env_id={self.env_id!r}: GEM cannot build and reset this environment "
                f"(kwargs {self.kwargs}): {error}"
            )

    def _check_downloads(self, spec: Any) -> None:
        if self.allow_downloads:
            return
        module = entry_point(self.env_id).split(":")[0].rsplit(".", 1)[-1]
        needs = None
        if module in _NLTK_CORPUS_GAMES:
            needs = "downloads the nltk 'words' corpus (nltk.download) when built"
        elif "dataset_name" in spec.kwargs:
            needs = f"loads the Hugging Face dataset {spec.kwargs['dataset_name']!r} at run time"
        if needs:
            raise ValueError(
                f"gem.env_id={self.env_id!r}: this GEM environment {needs}, which an offline "
                "job cannot; pick a game that needs no data (e.g. "
                "'game:GuessTheNumber-v0-easy', 'game:Mastermind-v0-easy') or set "
                "gem.allow_downloads=true"
            )

    def _check_kwargs(self, cls: type) -> None:
        params = inspect.signature(cls.__init__).parameters.values()
        names = [
            p.name
            for p in params
            if p.name != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        ]
        for key in self.kwargs:
            if key not in names:
                raise ValueError(
                    f"gem.kwargs.{key}: not a parameter of GEM's {cls.__name__} (GEM would "
                    f"ignore it silently); {did_you_mean(key, names)}parameters: {sorted(names)}"
                )


class GemEnv:
    """One GEM environment (any id) as our Environment; see the module docstring.

    Build with ``make_env("gem", env_id="game:GuessTheNumber-v0-easy")``. ``name`` is the GEM id
    (recorded in each trajectory's ``info["env"]``); ``game`` the unwrapped GEM object.
    """

    def __init__(self, config: GemConfig | None = None, **options: Any) -> None:
        if config is not None and options:
            raise TypeError("GemEnv: pass either a GemConfig or keyword options, not both")
        self.config = config or options_config("gem", options)
        self.name = self.config.env_id
        self._rng = PrivateRng()
        with self._rng.active():
            self.game = _make(self.config.env_id, self.config.kwargs)
        self.max_steps = self.config.max_turns or DEFAULT_MAX_TURNS
        self.done = True

    def _render(self, observation: Any, info: dict[str, Any]) -> str:
        """GEM's observation as its wrappers show the latest one: prefix + text + suffix."""
        if not isinstance(observation, str):
            raise TypeError(
                f"{self.name}: GEM returned a {type(observation).__name__} observation; this "
                "adapter takes text-only environments"
            )
        if not self.config.include_suffix:
            return observation
        text = observation
        if info.get("suffix"):
            text = (text if not text or text.endswith("\n") else text + "\n") + str(info["suffix"])
        if info.get("prefix"):
            text = str(info["prefix"]) + text
        return text

    def reset(self, seed: int) -> str:
        """Start GEM's episode for `seed` (same seed, same game); returns the first user turn."""
        with self._rng.active():
            observation, info = self.game.reset(seed=int(seed))
        self.seed = seed
        own = getattr(self.game, "max_turns", None)
        if self.config.max_turns is not None:
            self.max_steps = self.config.max_turns
        else:
            self.max_steps = own if isinstance(own, int) and own >= 1 else DEFAULT_MAX_TURNS
        self.num_turns = 0
        self.invalid_turns = 0
        self.episode_return = 0.0
        self.done = False
        return self._render(observation, info or {})

    def step(self, action: str) -> StepResult:
        """One GEM step. Bad action text is GEM's to judge (its format-error reward); GEM raising,
        a non-finite reward or a non-text observation raise (the rollout's env_error)."""
        if self.done:
            raise RuntimeError(f"{self.name}.step() on a finished episode: call reset() first")
        text = action if isinstance(action, str) else ""
        guesses = getattr(self.game, "previous_guesses", None)
        before = len(guesses) if isinstance(guesses, set | list | dict) else None
        with self._rng.active():
            observation, reward, terminated, truncated, info = self.game.step(text)
        reward = float(reward)
        if not math.isfinite(reward):
            raise ValueError(f"{self.name}: GEM returned the reward {reward!r}")
        info = dict(info or {})
        self.num_turns += 1
        self.episode_return += reward
        done, cut = bool(terminated), bool(truncated) and not terminated
        malformed = done and reward == FORMAT_ERROR_REWARD
        if before is not None and not malformed and len(self.game.previous_guesses) == before:
            # parsed, but no guess recorded: out of range, repeated or of the wrong length (GEM
            # pays invalid_action_reward, 0 like a valid step's, so the reward cannot tell)
            self.invalid_turns += 1
        out: dict[str, Any] = {
            f"gem/{k}": v
            for k, v in info.items()
            if k not in _RENDER_KEYS and isinstance(v, int | float | str | bool)
        }
        out |= {
            "success": done
            and not truncated
            and self.episode_return >= self.config.success_threshold - 1e-9,
            "gem_return": self.episode_return,
            "gem_terminated": bool(terminated),
            "gem_truncated": bool(truncated),
            "num_turns": self.num_turns,
        }
        if before is not None:
            out["gem_invalid_turns"] = self.invalid_turns
        if malformed:
            out["error"] = "malformed"
        if done or cut:
            self.done = True
            final = observation if isinstance(observation, str) else ""
            out["gem/final_observation"] = final[:200]
            return StepResult(observation="", reward=reward, done=done, truncated=cut, info=out)
        return StepResult(
            observation=self._render(observation, info), reward=reward, done=False, info=out
        )


class SolvedGemEnv(GemEnv):
    """A GEM game with a gold solver (`gem_solvers.SOLVERS`): also ``gold_action()``."""

    def gold_action(self) -> str:
        """The solver's next action from the current state (RuntimeError between episodes)."""
        if self.done:
            raise RuntimeError(f"{self.name}.gold_action(): no episode in progress")
        solvers = REASONED_SOLVERS if self.config.solver_reasoning else SOLVERS
        return solvers[entry_point(self.name)](self.game)


@register_env("gem", options=GemConfig)
def make_gem(**options: Any) -> GemEnv:
    """Any GEM environment id (options: GemConfig); with gold_action() where a solver exists."""
    config = options_config("gem", options)
    cls = SolvedGemEnv if entry_point(config.env_id) in SOLVERS else GemEnv
    return cls(config)


def gem_episode_metrics(infos: Sequence[Mapping[str, Any]], options: Any) -> dict[str, float]:
    """Evaluation metrics of finished GEM episodes (`sao_megatron.envs.base.episode_metrics`),
    from each episode's final step info; reported as ``eval/<label>/<metric>``:

    * ``mean_return``: GEM's rewards summed over the episode (success pays 1; Mastermind pays
      each new black peg / code length; a format error -0.1), mean over episodes.
    * ``malformed_end_rate``: share of episodes ended by an action GEM could not parse.
    * ``invalid_action_rate``: turns whose guess GEM parsed but refused (out of range,
      repeated, wrong length) over all turns, pooled over episodes; only for games that keep
      ``previous_guesses`` (GuessTheNumber, Mastermind), else absent.
    `options` change nothing here.
    """
    if not infos:
        return {}
    out = {
        "mean_return": sum(float(i.get("gem_return", 0.0)) for i in infos) / len(infos),
        "malformed_end_rate": sum(i.get("error") == "malformed" for i in infos) / len(infos),
    }
    tracked = [i for i in infos if "gem_invalid_turns" in i]
    turns = sum(int(i.get("num_turns", 0)) for i in tracked)
    if tracked and turns:
        out["invalid_action_rate"] = sum(int(i["gem_invalid_turns"]) for i in tracked) / turns
    return out


register_episode_metrics("gem", gem_episode_metrics)
