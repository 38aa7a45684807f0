"""The plugin matrix's worker: a few training steps of a tiny model through ``blutrain.train.Trainer`` per
combination, all combinations of one launch in one process (imports and the launch are paid once).

Usage: ``matrix_train.py OUT.json SPEC.json``; SPEC is a list of ``{"id", "model", "device", "optimizer",
"parallel", "compile", "batch_size"}``. Run alone for single-process combinations, under ``blutrain run -n N`` for
parallel ones (every rank runs the same list in the same order, so their collectives meet). Each
combination's per-step losses (averaged over ranks, as the trainer logs them), the sum of squares of the
parameters before and after (single process), and the optimizer's class go to OUT.json from rank 0. In a single
process an exception is recorded as that combination's error and the next combination runs; on several ranks
the rank that raised prints it and exits 1, and ``blutrain run`` stops the others (they would otherwise wait for
it in the combination's collectives).
"""

from __future__ import annotations

import io
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

STEPS = 4  # with --compile: step 1 eager, step 2 traced, steps 3 and 4 replayed (4's loss follows a replayed update)
# each family's tiny preset made smaller; a family not listed trains its tiny preset at block_size 16. Llama's
# heads: 4 query heads sharing 2 K/V heads (grouped-query attention), both divisible by tp=2.
MODELS: dict[str, dict[str, Any]] = {
    "gpt2": {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 16},
    "llama": {"n_layer": 1, "n_head": 4, "n_kv_head": 2, "n_embd": 32, "ffn_hidden": 64, "block_size": 16},
}


def sum_of_squares(model: Any) -> float:
    return float(sum((p.detach().double() ** 2).sum().item() for p in model.parameters()))


def train(spec: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    from blutrain.train import TrainConfig, Trainer

    cfg = TrainConfig(model=spec["model"], device=spec["device"], optimizer=spec["optimizer"],
                      parallel=spec["parallel"], compile=spec["compile"], batch_size=spec["batch_size"], seq_len=16,
                      max_steps=STEPS, warmup_steps=1, eval_every=0, eval_batches=1, out=str(out_dir / spec["id"]),
                      model_overrides=dict(MODELS.get(spec["model"], {"block_size": 16})))
    trainer = Trainer(cfg, stream=io.StringIO())
    before = sum_of_squares(trainer.net) if trainer.world == 1 else None
    losses = [float(trainer.train_step()["loss"]) for _ in range(STEPS)]
    after = sum_of_squares(trainer.net) if trainer.world == 1 else None
    return {"losses": losses, "params_before": before, "params_after": after,
            "optimizer_class": type(trainer.optimizer).__name__, "world": trainer.world, "rank": trainer.rank}


def main() -> int:
    from blutrain import dist

    out, specs = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
    results: dict[str, Any] = {}
    rank = 0
    for spec in specs:
        started = time.monotonic()
        try:
            results[spec["id"]] = train(spec, out.parent)
            rank = results[spec["id"]]["rank"]
        except Exception:
            results[spec["id"]] = {"error": traceback.format_exc()}
            if dist.detect().world_size > 1:
                # the other ranks would wait for this one in the combination's collectives (a collective
                # captured in a CUDA graph has no timeout): end the launch, the error in its output
                print(f"matrix_train: {spec['id']}: error on this rank, stopping the launch:\n"
                      f"{results[spec['id']]['error']}", file=sys.stderr, flush=True)
                return 1
        # progress on stderr, line by line: a launch stopped from outside still shows how far it got
        status = "error" if "error" in results[spec["id"]] else "ok"
        print(f"matrix_train: {spec['id']}: {status} in {time.monotonic() - started:.1f} s", file=sys.stderr,
              flush=True)
    if dist.is_initialized():
        rank = dist.get_rank()
        dist.destroy_process_group()
    if rank == 0:
        out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
