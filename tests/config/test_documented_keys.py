"""Every dotted config key the documentation, examples, launch scripts and error messages show
resolves against the `JobConfig` schema, and every `sao-train` override line in the docs loads.

What is extracted (a "candidate" is a chain of two or more lowercase identifiers joined by '.',
``[a-z_][a-z0-9_]*(\\.[a-z_][a-z0-9_]*)+``, not inside a longer name or a path):
- README.md, docs/*.md: candidates in inline code spans (`` `...` ``) and in fenced code blocks
  that are not Python (```` ```python ```` blocks hold Python attribute chains, not keys);
- examples/configs/*.yaml: the nested keys of each file, flattened to dotted paths (list items
  add no part: ``tasks.train.options.horizon``);
- launch_scripts/*: candidates anywhere (comments and command lines);
- sao_megatron/**.py: candidates in the string literals (f-string parts included) of ``raise``
  statements and of ``warn``/``warning``/``error`` calls, i.e. error and warning messages.

A candidate is taken as a config key when its first part names a section: a field of
`JobConfig`, the generic section of a reused component (``optimizer.`` of `OptimizerConfig`,
its ``CONFIG_SECTION``), or a section name users guess but that does not exist (`GUESSED`,
e.g. ``trainer.``). Everything else (``e.g``, Megatron/HF parameter names such as
``decoder.layers``, ``hanoi.horizon`` environment options, Python attributes) is not a key.
Excluded by rule as well: a candidate followed by ``(`` (a call), whose last part is a file
extension (``config.yaml``, ``manifest.json``), or whose first part is a Python module
(``sao_megatron.``, ``torch.``); the few section-looking candidates that are not keys are
listed in `NOT_KEYS` with the reason.

A key must then resolve field by field through the dataclasses of `JobConfig` (lists of
dataclasses are entered, dict fields accept any sub-key; ``optimizer.<field>`` resolves
against `OptimizerConfig`; keys under a dict field, such as an environment's ``options``,
resolve whatever they are). Wrong keys not fixed yet are listed with their fix in `KNOWN_WRONG`
(to be emptied when those files are fixed): the test fails both when a new wrong key appears and
when a known-wrong key is fixed or removed.
"""

from __future__ import annotations

import ast
import dataclasses
import re
import shlex
import types
import typing
from pathlib import Path

import pytest
import yaml

from sao_megatron.configs import load_config
from sao_megatron.optim.config import OptimizerConfig
from sao_megatron.trainer.job import JobConfig

ROOT = Path(__file__).resolve().parents[2]
CANDIDATE = re.compile(r"(?<![\w./$-])([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)+)(?![\w/-])(\(?)")
FILE_EXTENSIONS = {
    "py", "md", "yaml", "yml", "json", "jsonl", "sh", "sbatch", "pt", "txt", "toml",
    "safetensors", "distcp", "png", "log", "csv", "gguf", "bin",
}  # fmt: skip
MODULES = {
    "sao_megatron", "megatron", "torch", "vllm", "transformers", "numpy", "np", "os", "sys",
    "omegaconf", "sentencepiece", "spm", "reasoning_gym", "math_verify", "safetensors",
    "minigrid", "textarena", "apex", "transformer_engine", "dist", "mp", "random", "pathlib",
}  # fmt: skip

SECTIONS = {f.name for f in dataclasses.fields(JobConfig)}
GENERIC = {"optimizer": OptimizerConfig}  # CONFIG_SECTION -> class (see sao_megatron.configs)
GUESSED = {"trainer", "training", "train", "optim", "optimiser", "parallelism", "ckpt"}

# Section-looking candidates that are not config keys (file:key -> why). Keep it small.
NOT_KEYS = {
    "docs/CONVERSION.md:model.embed_tokens.weight": "a Hugging Face parameter name",
    "docs/CONVERSION.md:model.layers": "a Hugging Face parameter name prefix",
    "docs/CONVERSION.md:model.norm.weight": "a Hugging Face parameter name",
    "docs/ROLLOUT.md:config.rollout": "a Python attribute (the job config's rollout section)",
    "docs/ROLLOUT.md:env.max_steps": "an environment attribute",
    "docs/ENVIRONMENTS.md:env.step": "an environment method",
    "docs/ENVIRONMENTS.md:tokenizer.model": "the sentencepiece model file",
    "docs/CHECKPOINTS.md:job.checkpoint": "a Python attribute (the job's checkpoint section)",
    "docs/ALGORITHM.md:algorithm.schedule": "the algorithm object's update schedule",
    "docs/ARCHITECTURE.md:algorithm.schedule": "the algorithm object's update schedule",
    "docs/TRAINING.md:algorithm.schedule": "the algorithm object's update schedule",
    "docs/REAL_MODEL.md:tokenizer.ggml": "GGUF metadata fields",
    "docs/REAL_MODEL.md:tokenizer.model": "a tokenizer file",
    "sao_megatron/convert/pretrained.py:tokenizer.ggml.model": "a GGUF metadata field",
    "sao_megatron/convert/pretrained.py:tokenizer.ggml.pre": "a GGUF metadata field",
}

# Wrong keys in files owned elsewhere: "file:key" -> the right key. The lead empties this set
# when the files are fixed; the test fails if one of them is fixed or a new wrong key appears.
KNOWN_WRONG = {
    # pack_trajectories' row-too-long error: the context mode lives in the episode section
    "sao_megatron/data/batch.py:rollout.context_mode": "episode.context_mode",
    # check_freeze_patterns' error: the value model's patterns are value.freeze_patterns
    "sao_megatron/models/freeze.py:model.value.freeze_patterns": "value.freeze_patterns",
    # RLStep: the batch size is rollout.trajectories_per_batch; StepConfig.micro_batch_size is
    # filled from rl.micro_batch_size
}


def _md_sources() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _candidates(text: str) -> list[str]:
    return [m.group(1) for m in CANDIDATE.finditer(text) if not m.group(2)]


def _markdown_candidates(text: str) -> list[str]:
    out, fence = [], None
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("```"):
            fence = None if fence is not None else stripped[3:].strip().lower()
            continue
        if fence is not None:
            if fence not in ("python", "py"):
                out += _candidates(line)
        else:
            for span in re.findall(r"`([^`]+)`", line):
                out += _candidates(span)
    return out


def _yaml_keys(node, prefix: str = "") -> list[str]:
    out = []
    if isinstance(node, dict):
        for k, v in node.items():
            key = f"{prefix}.{k}" if prefix else str(k)
            out.append(key)
            out += _yaml_keys(v, key)
    elif isinstance(node, list):
        for v in node:
            out += _yaml_keys(v, prefix)
    return out


def _message_strings(tree: ast.AST) -> list[str]:
    """String literals of raise statements and warn/warning/error calls."""
    roots = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and node.exc is not None:
            roots.append(node.exc)
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("warn", "warning", "error"):
                roots.append(node)
    out = []
    for root in roots:
        for sub in ast.walk(root):
            if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                out.append(sub.value)
    return out


def _is_excluded(key: str) -> bool:
    parts = key.split(".")
    if parts[-1] in FILE_EXTENSIONS or parts[0] in MODULES:
        return True
    return parts[0] not in SECTIONS | set(GENERIC) | GUESSED


def documented_keys() -> dict[str, set[str]]:
    """file (relative) -> candidate keys found in it, after the exclusion rules."""
    found: dict[str, set[str]] = {}

    def add(path: Path, keys) -> None:
        rel = path.relative_to(ROOT).as_posix()
        keep = {k for k in keys if not _is_excluded(k) and f"{rel}:{k}" not in NOT_KEYS}
        if keep:
            found.setdefault(rel, set()).update(keep)

    for path in _md_sources():
        add(path, _markdown_candidates(path.read_text()))
    for path in sorted((ROOT / "examples" / "configs").glob("*.yaml")):
        add(path, [k for k in _yaml_keys(yaml.safe_load(path.read_text())) if "." in k])
    for path in sorted((ROOT / "launch_scripts").glob("*")):
        add(path, _candidates(path.read_text()))
    for path in sorted((ROOT / "sao_megatron").rglob("*.py")):
        strings = _message_strings(ast.parse(path.read_text()))
        add(path, [k for s in strings for k in _candidates(s)])
    return found


def resolves(key: str, schema: type = JobConfig, migrated_ok: bool = False) -> bool:
    """True when every part of ``key`` is a field of the dataclass reached so far; with
    ``migrated_ok`` also when the last part is a former field listed in its class's
    ``MOVED_FIELDS`` (loading it fails with a message naming the new key)."""
    head, _, rest = key.partition(".")
    if head in GENERIC and rest:
        return resolves(rest, GENERIC[head], migrated_ok)
    tp: typing.Any = schema
    for part in key.split("."):
        while typing.get_origin(tp) in (list, typing.Union, types.UnionType):
            tp = next(a for a in typing.get_args(tp) if a is not type(None))
        if typing.get_origin(tp) is dict or tp is dict or tp is typing.Any:
            return True  # free-form mapping (e.g. an environment's options)
        if not dataclasses.is_dataclass(tp):
            return False
        hints = typing.get_type_hints(tp)
        names = {f.name for f in dataclasses.fields(tp)}
        if part not in names:
            last = part == key.rsplit(".", 1)[-1]
            return migrated_ok and last and part in getattr(tp, "MOVED_FIELDS", {})
        tp = hints[part]
    return True


def wrong_keys() -> set[str]:
    return {
        f"{rel}:{key}"
        for rel, keys in documented_keys().items()
        for key in keys
        if not resolves(key, migrated_ok=rel.startswith("docs/"))  # docs' migration tables
    }


def test_resolver_accepts_real_keys_and_rejects_wrong_ones():
    good = ["rl.steps", "sft.optim.lr", "tasks.train.weight", "tasks.train.options.horizon"]
    good += ["optimizer.lr", "rollout.seed", "checkpoint.load_dir"]
    for key in good:
        assert resolves(key), key
    bad = ["rl.stpes", "trainer.micro_batch_size", "parallel.tensor_model_parallel_size"]
    bad += ["optimizer.nope", "model.value.freeze_patterns", "rl.steps.x"]
    for key in bad:
        assert not resolves(key), key


def test_extraction_finds_keys_in_every_kind_of_source():
    found = documented_keys()
    assert "rl.steps" in found["README.md"]  # an override line
    assert "checkpoint.resume" in found["docs/CHECKPOINTS.md"]  # an inline code span
    assert "sft.optim" in found["examples/configs/quickstart.yaml"]  # nested YAML keys
    assert "checkpoint.save_dir" in found["launch_scripts/train_slurm.sbatch"]
    assert "checkpoint.keep_last_k" in found["sao_megatron/trainer/checkpoint/config.py"]
    assert not any(k.startswith("sao_megatron.") for keys in found.values() for k in keys)


def test_known_wrong_fixes_resolve():
    for entry, fix in KNOWN_WRONG.items():
        assert not resolves(entry.split(":", 1)[1]) and resolves(fix), entry


def test_documented_keys_resolve_against_the_schema():
    wrong = wrong_keys()
    new = sorted(wrong - set(KNOWN_WRONG))
    fixed = sorted(set(KNOWN_WRONG) - wrong)
    assert (new, fixed) == ([], []), (
        f"config keys that are not fields of JobConfig (file:key): {new}; "
        f"fixed or gone, remove from KNOWN_WRONG: {fixed}"
    )


def _override_lines() -> list[tuple[str, str, list[str]]]:
    """(file, config path, overrides) of every `sao-train CONFIG a.b=c ...` line in the docs."""
    out = []
    for path in _md_sources():
        fence = False
        # a command continued with a trailing backslash is one line
        text = re.sub(r"\\\n\s*", " ", path.read_text())
        for line in text.splitlines():
            if line.strip().startswith("```"):
                fence = not fence
                continue
            for code in [line] if fence else re.findall(r"`([^`]+)`", line):
                m = re.search(r"sao-train\s+(\S+\.yaml)(.*)", code)
                if m is None or not (ROOT / m.group(1)).is_file():  # CONFIG.yaml: a placeholder
                    continue
                words = shlex.split(m.group(2), comments=True)
                overrides = []
                for w in words:
                    if "=" not in w:
                        break
                    overrides.append(w)
                out.append((path.relative_to(ROOT).as_posix(), m.group(1), overrides))
    return out


OVERRIDE_LINES = _override_lines()


def test_override_lines_are_found():
    assert any(o for _, _, o in OVERRIDE_LINES)  # README's rl.steps=40 algorithm.name=grpo ...


@pytest.mark.parametrize(("source", "config", "overrides"), OVERRIDE_LINES)
def test_documented_override_lines_load(source, config, overrides):
    job = load_config(JobConfig, ROOT / config, overrides)
    assert isinstance(job, JobConfig)
