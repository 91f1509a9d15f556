"""Where the ``vllm`` engine runs on the host build at rollout TP 1: in the actor's process (inside its process group,
the engine's choice since 2026-12-03) or in vLLM's own layout (engine core + worker processes, what a standalone
engine still gets). docs/rollout-vllm.md ("TP = 1 on the host build") says why the two differ.

Run: ``.venv/bin/python benchmarks/vllm_cpu_layout.py [--model small] [--rounds 2] [--threads 0]``. Each layout runs
in a child process of its own (a fresh vLLM), the children in turns (``--rounds`` of each), so a busy machine skews
both alike. A child builds our engine (``build_vllm_rollout``) for the model, in a gloo world of one rank (in-process)
or with no process group (vLLM's layout), generates one warm-up batch, then times one rollout batch of the
realistic shape (16 prompts of the synthetic task x 8 samples, up to 512 tokens, seeded, so both layouts sample the
same responses up to float rounding). Prints each child's seconds and tokens and the ratio of medians. ``--threads``
sets torch's threads in the child (0: the machine's CPUs, what one actor gets by default). Not run by CI.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # runnable as `python benchmarks/vllm_cpu_layout.py` from anywhere
    sys.path.insert(0, str(REPO))

LAYOUTS = ("in-process", "vllm-processes")
PROMPTS, N, MAX_NEW_TOKENS = 16, 8, 512


def child(layout: str, model: str, threads: int) -> dict:
    """One layout: build the engine, warm up, time one rollout batch; returns seconds, tokens and how it ran."""
    import torch

    from gspo_ascend.config import load_config
    from gspo_ascend.data.loader import load_prompts
    from gspo_ascend.data.prepare import embedded_data_dir
    from gspo_ascend.device import get_backend
    from gspo_ascend.engines.base import SamplingParams
    from gspo_ascend.engines.vllm_rollout import build_vllm_rollout
    from gspo_ascend.tiny import ensure_tiny_model

    torch.set_num_threads(threads or os.cpu_count() or 1)
    if layout == "in-process":
        import tempfile

        import torch.distributed as dist

        store = Path(tempfile.mkdtemp()) / "store"  # a world of one rank: no port to find
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    path = str(ensure_tiny_model(size=model))
    sets = {"model.path": path, "model.dtype": "float32", "rollout.engine": "vllm", "rollout.n": N,
            "data.max_prompt_length": 64, "data.max_response_length": MAX_NEW_TOKENS,
            "data.train_batch_size": PROMPTS, "rollout.enforce_eager": True}  # fmt: skip
    cfg = load_config(None, [f"{k}={json.dumps(v)}" for k, v in sets.items()])
    engine = build_vllm_rollout(cfg, get_backend("cpu"), path)
    from transformers import AutoTokenizer

    records = load_prompts(embedded_data_dir() / "train.parquet", "prompt", AutoTokenizer.from_pretrained(path), 64)
    prompts = [r.prompt_ids for r in records.records[:PROMPTS]]
    params = SamplingParams(n=N, temperature=1.0, max_new_tokens=MAX_NEW_TOKENS, seed=0)
    engine.generate(prompts, params)  # warm-up: the first call pays one-off costs
    start = time.perf_counter()
    batch = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    return {"layout": layout, "seconds": seconds, "tokens": int(batch.response_mask.sum()),
            "in_process": bool(engine.external_launcher), "threads": torch.get_num_threads()}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("tiny", "small"), default="small", help="make-tiny-model size")
    p.add_argument("--rounds", type=int, default=2, help="children per layout, in turns")
    p.add_argument("--threads", type=int, default=0, help="torch threads in each child (0: the machine's CPUs)")
    p.add_argument("--onednn-off", action="store_true", help="vLLM's oneDNN linears off (verl_side/onednn_off)")
    p.add_argument("--json", type=Path, default=None, help="write every child's numbers here")
    p.add_argument("--child", choices=LAYOUTS, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args.model, args.threads)), flush=True)
        return
    env = dict(os.environ)
    if args.onednn_off:  # the handicap the e2e benchmark's ours-vllm-noonednn and verl sides carry
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(REPO / "benchmarks/verl_side/onednn_off"), env.get("PYTHONPATH")])
        )
    results = []
    for _ in range(args.rounds):
        for layout in LAYOUTS:
            cmd = [sys.executable, __file__, "--child", layout, "--model", args.model, "--threads", str(args.threads)]
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                sys.exit(f"vllm_cpu_layout: the {layout} child failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
            results.append(json.loads(lines[-1].removeprefix("RESULT ")))
            r = results[-1]
            print(f"{layout:>15}: {r['seconds']:6.2f} s, {r['tokens']} tokens, {r['threads']} threads", flush=True)
    median = {k: statistics.median(r["seconds"] for r in results if r["layout"] == k) for k in LAYOUTS}
    print(f"generate, in-process / vLLM's processes (medians): {median['in-process'] / median['vllm-processes']:.3f}")
    if args.json:
        args.json.write_text(json.dumps({"results": results, "medians_s": median}, indent=1) + "\n")


if __name__ == "__main__":
    main()
