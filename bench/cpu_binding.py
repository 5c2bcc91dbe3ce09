"""Each rank bound to its own cores (`TOKENLOOM_CPU_OMP_THREADS_BIND=auto`, the default) vs left to the kernel
(`nobind`), served through HTTP, side by side in one run.

    .venv/bin/python bench/cpu_binding.py                 # TP=2 and PP=2, 3 rounds
    .venv/bin/python bench/cpu_binding.py --shapes tp2 --rounds 1 --num-prompts 16

Servers: `python -m tokenloom.launch_server` with `--tp-size 2` or `--pp-size 2` on SmolLM2's shape with its
heads regrouped 12 x 48 (kv 4 x 48) so that TP=2 splits it (the same model as `bench/tensor_parallel.py`),
`--load-format dummy`, bf16, the ranks sharing this machine's cores (one thread each). Per round and shape,
a bound and an unbound server, each started fresh (who goes first alternates), each serving the same workload
with `python -m tokenloom.bench_serving` (random-ids `--num-prompts` prompts of `--input-len` tokens, exactly
`--output-len` new tokens each, all at once). Reported: output throughput of every run and, per shape, the
median over rounds of the within-round ratio bound / unbound (above 1: binding is faster). The last stdout line
is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import dummy_model_folder, stop_process_group  # noqa: E402
from bench.tensor_parallel import MODELS  # noqa: E402

PY = sys.executable
STARTUP_TIMEOUT_S = 300
SHAPES = {"tp2": ["--tp-size", "2"], "pp2": ["--pp-size", "2"]}


def model_folder() -> str:
    spec = MODELS["smollm2-135m-shape"]
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", max_position_embeddings=2048,
                  rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, hidden_act="silu", torch_dtype="bfloat16",
                  **spec)
    return dummy_model_folder("tokenloom-bench-cpu-binding", config)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def serve_once(folder: str, shape: str, binding: str, ns: argparse.Namespace, log_dir: str) -> dict[str, Any]:
    """Start a server with `binding`, run the client once, stop it; the client's result line."""
    from bench.serve_vs_peers import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "TOKENLOOM_CPU_OMP_THREADS_BIND": binding}
    log_path = os.path.join(log_dir, f"server_{shape}_{binding}.log")
    cmd = [PY, "-m", "tokenloom.launch_server", "--model-path", folder, "--load-format", "dummy",
           "--host", "127.0.0.1", "--port", str(port), "--max-running-requests", str(ns.num_prompts),
           "--log-level", "warning", *SHAPES[shape]]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not _healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{shape} server ({binding}) did not start; log: {log_path}")
            time.sleep(1)
        out_file = os.path.join(log_dir, f"{shape}_{binding}_{time.monotonic_ns()}.jsonl")
        client = [PY, "-m", "tokenloom.bench_serving", "--base-url", url, "--backend", "tokenloom",
                  "--model", folder, "--tokenizer", folder, "--dataset-name", "random-ids",
                  "--num-prompts", str(ns.num_prompts), "--random-input-len", str(ns.input_len),
                  "--random-output-len", str(ns.output_len), "--random-range-ratio", "1", "--seed", "1",
                  "--output-file", out_file, "--disable-tqdm", "--warmup-requests", "2"]
        done = subprocess.run(client, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            raise RuntimeError(f"the client failed against the {shape} server ({binding}): {done.stderr[-500:]}")
        with open(out_file) as f:
            return json.loads(f.read().splitlines()[-1])
    finally:
        stop_process_group(proc, 60)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="tp2,pp2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ns = ap.parse_args()
    folder = model_folder()
    log_dir = tempfile.mkdtemp(prefix="tokenloom-bench-binding-")
    report: dict[str, Any] = {"bench": "cpu_binding", "cores": len(os.sched_getaffinity(0)), "shapes": {}}
    for shape in ns.shapes.split(","):
        runs: dict[str, list[float]] = {"auto": [], "nobind": []}
        ratios = []
        for r in range(ns.rounds):
            order = ("auto", "nobind") if r % 2 == 0 else ("nobind", "auto")
            for binding in order:
                result = serve_once(folder, shape, binding, ns, log_dir)
                runs[binding].append(result["output_throughput"])
            ratios.append(runs["auto"][-1] / runs["nobind"][-1])
            print(f"[{shape}] round {r + 1}: bound {runs['auto'][-1]:7.1f} tok/s, unbound {runs['nobind'][-1]:7.1f}"
                  f" tok/s (bound / unbound {ratios[-1]:.3f})", flush=True)
        report["shapes"][shape] = {"bound_tok_s": runs["auto"], "unbound_tok_s": runs["nobind"],
                                   "ratios": ratios, "median_ratio": statistics.median(ratios)}
        print(f"[{shape}] median bound / unbound: {statistics.median(ratios):.3f}", flush=True)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
