"""``sao-train`` with a recorder: runs ``sao_megatron.cli.train.main`` unchanged and writes the
token ids of the first training batch's trajectories to ``<run_dir>/first_batch.json`` (the
smoke test decodes them to check the chat template was used)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from sao_megatron.cli import train
from sao_megatron.trainer import context

_pack = context.pack_trajectories


def _recording_pack(trajs, **kw):
    out = Path(_RUN_DIR) / "first_batch.json"
    if not out.exists():
        rows = [
            [tok for n in t.nodes for tok in n.observation_token_ids + n.action_token_ids]
            for t in trajs
        ]
        out.write_text(json.dumps(rows))
    return _pack(trajs, **kw)


if __name__ == "__main__":
    _RUN_DIR = next(a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("run_dir="))
    context.pack_trajectories = _recording_pack
    sys.exit(train.main(sys.argv[1:]))
