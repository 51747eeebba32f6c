"""Linear probe of the critic's features: can the value model's trunk, as initialised from the
SFT policy, already tell the value targets apart? (issue 14, item 3)

Ridge regression (float64, closed form) from the final-norm hidden states the value head reads
(the state before each action token, on the value mask) to the value targets, fitted on the
first --train batches of tools/bench_critic.py's collected rollouts and scored by explained
variance on the last --heldout batches. A probe EV far above the critic's learnt EV means the
features carry the return and the critic's optimisation is what fails; a probe EV near 0 means
the trunk must learn new features first. Also reports the EV of the targets' best linear fit on
one scalar: the "Moves left" number of the row's observation (its own feature, not the model's).

    python tools/probe_critic.py --config examples/configs/hanoi_plan.yaml --out runs/plan3
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_critic  # noqa: E402
from benchlib import REPO  # noqa: E402


def features(step, batch):
    """(hidden [N, h] float64, targets [N] float64, row index [N]) on the value mask."""
    from sao_megatron.data.micro_batches import values_at_predictions

    critic = step._value_model("probe")
    model = critic.value.unwrapped[0] if hasattr(critic.value, "unwrapped") else critic.value.model
    captured = []
    hook = model.output_layer.register_forward_hook(
        lambda mod, args, out: captured.append(args[0].detach().float().transpose(0, 1).cpu())
    )
    try:
        state = step.start(batch, train_version=0)
        values = critic.values(state.batch)
        _, returns, vmask = critic.advantages.compute(state, values)
    finally:
        hook.remove()
    h = torch.cat(captured)  # [R, T, hidden]: state after reading token t
    at, _ = values_at_predictions(h)  # [R, T-1, hidden]: the state before token p+1, as vmask
    rows = torch.arange(vmask.shape[0])[:, None].expand_as(vmask)
    return at[vmask].double(), returns[vmask].double(), rows[vmask]


def ridge_ev(xtr, ytr, xte, yte, lam: float) -> float:
    mu, ym = xtr.mean(0), ytr.mean()
    a, b = xtr - mu, ytr - ym
    w = torch.linalg.solve(a.T @ a + lam * torch.eye(a.shape[1], dtype=a.dtype), a.T @ b)
    pred = (xte - mu) @ w + ym
    return float(1 - (yte - pred).var(unbiased=False) / yte.var(unbiased=False))


def moves_left(batch, rows: torch.Tensor, tokenizer) -> torch.Tensor:
    """The "Moves left: N" number of each row's context (NaN where absent)."""
    out = []
    for r in range(batch.token_ids.shape[0]):
        text = tokenizer.decode([int(t) for t in batch.token_ids[r] if int(t) != tokenizer.pad_id])
        m = re.findall(r"[Mm]oves left:?\s*(\d+)", text)
        out.append(float(m[-1]) if m else float("nan"))
    return torch.tensor(out, dtype=torch.float64)[rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="examples/configs/hanoi_plan.yaml")
    ap.add_argument("--out", default="runs/plan3")
    ap.add_argument("--train", type=int, default=6, help="first batches to fit the probe on")
    ap.add_argument("--heldout", type=int, default=2, help="last batches to score it on")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    from sao_megatron.data.batch import pack_trajectories
    from sao_megatron.trainer.controller import Controller

    out = REPO / args.out
    data = torch.load(out / "rollouts.pt", weights_only=False)
    job = bench_critic._job(args.config, out / "collect", args.overrides)
    c = Controller(job, bench_critic._parallel(job))
    c.prepare()
    step = c.build_rl(None, None).step_fn

    def pack(trajs):
        return pack_trajectories(
            trajs, pad_token_id=c.tokenizer.pad_id, max_seq_len=job.model.max_position_embeddings
        )

    parts = {"train": data["batches"][: args.train], "heldout": data["batches"][-args.heldout :]}
    feats = {}
    for name, batches in parts.items():
        b = pack([t for bb in batches for t in bb])
        x, y, rows = features(step, b)
        feats[name] = (x, y, moves_left(b, rows, c.tokenizer))
    (xtr, ytr, mtr), (xte, yte, mte) = feats["train"], feats["heldout"]
    res = {"train_tokens": len(ytr), "heldout_tokens": len(yte)}
    for lam in (1e-3, 1e-1, 10.0):
        res[f"probe_ev_lambda_{lam:g}"] = ridge_ev(xtr, ytr, xte, yte, lam)
    ok_tr, ok_te = mtr == mtr, mte == mte
    res["moves_left_found"] = float(ok_te.double().mean())
    if ok_tr.any() and ok_te.any():
        res["moves_left_linear_ev"] = ridge_ev(
            mtr[ok_tr, None], ytr[ok_tr], mte[ok_te, None], yte[ok_te], 1e-9
        )
    print(json.dumps(res, indent=1))
    (out / "probe.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
