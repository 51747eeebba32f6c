"""weight_sync/ is the trainer side of a weight update (gather, export, the slot file, the sink
protocol) and sits below rollout/ (docs/ARCHITECTURE.md, "Layers"): it imports nothing of
`sao_megatron.rollout`; the engine side (`EngineFleet`, `sync_engine`) lives in rollout/."""

from __future__ import annotations

import subprocess
import sys

from tests.test_import_graph import ROOT, import_graph


def test_weight_sync_imports_no_rollout_module():
    graph = import_graph()
    ours = {m: deps for m, deps in graph.items() if m.startswith("sao_megatron.weight_sync")}
    assert "sao_megatron.weight_sync.publish" in ours  # the parse saw the package
    upward = {
        m: sorted(d for d in deps if d.startswith("sao_megatron.rollout"))
        for m, deps in ours.items()
    }
    assert {m: d for m, d in upward.items() if d} == {}


def test_importing_weight_sync_loads_no_rollout_module():
    code = (
        "import sys; import sao_megatron.weight_sync.publish, sao_megatron.weight_sync.publisher; "
        "print(sorted(m for m in sys.modules if m.startswith('sao_megatron.rollout')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_the_engine_side_of_a_weight_update_is_the_rollouts():
    from sao_megatron.rollout import engines

    assert hasattr(engines, "sync_engine") and hasattr(engines, "EngineFleet")
    assert not (ROOT / "sao_megatron" / "weight_sync" / "engines.py").exists()
