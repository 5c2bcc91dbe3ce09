"""A Qwen3-MoE-shaped model with random weights, as a Q4_K_M GGUF made by llama.cpp's own tools, and a short
batch-1 decode comparison against llama-server on that file (issue 31's MoE speed case).

    .venv/bin/python bench/moe.py --make          # make the files once (minutes; ~12 GB of disk while making)
    .venv/bin/python bench/moe.py                 # make if needed, then both servers measured in turns

Shape: Qwen3-30B-A3B's routing (128 experts, top-8, norm_topk_prob, q/k head norms) at a size that fits here:
hidden 1024, 24 layers, 16 heads / 4 KV heads of 64, expert FFN 256, SmolLM2's vocabulary (49152, untied). That
is ~2.6B parameters in total and ~0.27B read per token (8 of 128 experts, attention, the LM head): the bandwidth
case where reading only the active experts is the whole game. Every size is a multiple of 256 so llama-quantize
keeps Q4_K/Q6_K.

Files (under `<tokenloom cache>/gguf/moe2b/`, each written to a temporary name and renamed): `hf/` (bf16
safetensors written one layer per shard with random normal weights, std 0.02, seed 0, so the model never sits
whole in memory in float32; SmolLM2's tokenizer beside it), `moe2b-bf16.gguf` (convert_hf_to_gguf.py),
`moe2b-q4_k_m.gguf` (llama-quantize).

The run: both servers up on the Q4_K_M file at once (tokenloom with AMX off, as on the AMD EPYC this project
targets), measured in turns so that the machine's load hits both alike. Per turn and server: the batch-1 ITL
(one request, a 64-token prompt; the median of `--itl-samples` differences of a long and a 1-token answer,
so prefill and HTTP cancel out) and the output throughput of `--concurrency` (32) requests at once; medians
over `--repeats` turns.
Beside them, the bandwidth bound of a batch-1 step: the bytes of the active experts (top-k of each expert
tensor), attention and LM head over the read bandwidth measured in the same run.
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
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.llama1b import find_convert_script  # noqa: E402
from bench.llama_server import _quantize, find_llama_server, find_quantize, make_file  # noqa: E402

SEED = 0
CONFIG = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=1024, num_hidden_layers=24,
              num_attention_heads=16, num_key_value_heads=4, head_dim=64, intermediate_size=3072,
              moe_intermediate_size=256, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
              decoder_sparse_step=1, mlp_only_layers=[], vocab_size=49152, tie_word_embeddings=False,
              rope_theta=1000000.0, max_position_embeddings=8192, rms_norm_eps=1e-6, hidden_act="silu",
              attention_bias=False, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16")


def folder() -> str:
    from tokenloom.local_cache import cache_dir

    return os.path.join(cache_dir(), "gguf", "moe2b")


def gguf_path(kind: str) -> str:
    return os.path.join(folder(), f"moe2b-{kind}.gguf")


def _layer_tensors(i: int, gen) -> dict:
    import torch

    c = CONFIG
    h, d, e, inter = c["hidden_size"], c["head_dim"], c["num_experts"], c["moe_intermediate_size"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    p = f"model.layers.{i}."
    out = {p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
           p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
           p + "self_attn.q_norm.weight": torch.ones(d, dtype=torch.bfloat16),
           p + "self_attn.k_norm.weight": torch.ones(d, dtype=torch.bfloat16),
           p + "self_attn.q_proj.weight": rnd(q, h), p + "self_attn.k_proj.weight": rnd(kv, h),
           p + "self_attn.v_proj.weight": rnd(kv, h), p + "self_attn.o_proj.weight": rnd(h, q),
           p + "mlp.gate.weight": rnd(e, h)}
    for x in range(e):
        out[f"{p}mlp.experts.{x}.gate_proj.weight"] = rnd(inter, h)
        out[f"{p}mlp.experts.{x}.up_proj.weight"] = rnd(inter, h)
        out[f"{p}mlp.experts.{x}.down_proj.weight"] = rnd(h, inter)
    return out


def make_hf() -> str:
    """The bf16 safetensors folder, one shard per layer (see the module docstring), made once."""
    target = os.path.join(folder(), "hf")
    if os.path.exists(os.path.join(target, "config.json")):
        return target
    import torch
    from safetensors.torch import save_file

    from tokenloom.config import ServerArgs
    from tokenloom.models.loader import resolve_model_source
    from tokenloom.tokenizer import load_tokenizer

    print(f"Making {target} (once): random Qwen3-MoE-shaped bf16 weights, seed {SEED} ...", flush=True)
    tmp = f"{target}.tmp{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    gen = torch.Generator().manual_seed(SEED)
    h, vocab = CONFIG["hidden_size"], CONFIG["vocab_size"]
    weight_map: dict[str, str] = {}
    shards = [{"model.embed_tokens.weight": (torch.randn(vocab, h, generator=gen) * 0.02).to(torch.bfloat16),
               "lm_head.weight": (torch.randn(vocab, h, generator=gen) * 0.02).to(torch.bfloat16),
               "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}]
    for i in range(-1, CONFIG["num_hidden_layers"]):
        tensors = shards[0] if i < 0 else _layer_tensors(i, gen)
        name = f"model-{i + 2:05d}.safetensors"
        save_file(tensors, os.path.join(tmp, name), metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})
    with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(CONFIG, f, indent=1)
    load_tokenizer(resolve_model_source(ServerArgs())).save_pretrained(tmp)
    os.replace(tmp, target)
    return target


def ensure_files() -> str:
    """The Q4_K_M file, made (HF folder -> bf16 GGUF -> Q4_K_M) when missing."""
    dst = gguf_path("q4_k_m")
    if os.path.exists(dst):
        return dst
    exe = find_llama_server(None)
    quantize = find_quantize(exe) if exe else None
    convert = find_convert_script()
    if quantize is None or convert is None:
        raise SystemExit("bench/moe.py needs llama.cpp's llama-quantize and convert_hf_to_gguf.py "
                         "(bench/llama_server.py says how to build them)")
    bf16 = gguf_path("bf16")
    if not os.path.exists(bf16):
        hf = make_hf()
        tmp = f"{bf16}.tmp{os.getpid()}"
        make_file([sys.executable, convert, hf, "--outtype", "bf16", "--outfile", tmp], tmp, bf16,
                  "convert_hf_to_gguf.py")
    _quantize(quantize, bf16, dst, "q4_k_m", requantize=False)
    return dst


def _post(url: str, body: dict, timeout: float = 600) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _wait(url: str, proc: subprocess.Popen, timeout: float = 900) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError("server did not become healthy")


def _itl_ms(generate, new_tokens: int, repeats: int) -> float:
    """Median over `repeats` of (time of `new_tokens` answer - time of a 1-token answer) / (new_tokens - 1)."""
    generate(2)  # warm-up
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        generate(1)
        t1 = time.perf_counter()
        generate(new_tokens)
        t2 = time.perf_counter()
        runs.append(((t2 - t1) - (t1 - t0)) / (new_tokens - 1) * 1000)
    return statistics.median(runs)


def _throughput(generate, concurrency: int, new_tokens: int) -> float:
    """Output tokens per second of `concurrency` requests of `new_tokens` each, sent at once."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(lambda i: generate(2, i), range(concurrency)))  # warm-up at the same batch
        t0 = time.perf_counter()
        list(pool.map(lambda i: generate(new_tokens, i), range(concurrency)))
        return concurrency * new_tokens / (time.perf_counter() - t0)


def run_pair(path: str, threads: int, new_tokens: int, repeats: int, concurrency: int, itl_samples: int = 5
             ) -> dict[str, dict[str, float]]:
    """Both servers up on `path` at once, measured in turns (tokenloom, llama.cpp, tokenloom, ...), so a
    load that comes and goes hits both alike: per server the median over `repeats` turns of the batch-1 ITL
    and of the output throughput of `concurrency` requests at once."""
    from bench.peer_engines import free_port

    env = {**os.environ, "TOKENLOOM_DISABLE_AMX": "1", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16",
           "MKL_ENABLE_INSTRUCTIONS": "AVX512"}
    servers: dict[str, tuple[subprocess.Popen, object]] = {}
    try:
        for name in ("tokenloom", "llama.cpp"):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            if name == "tokenloom":
                cmd = [sys.executable, "-m", "tokenloom.launch_server", "--model-path", path, "--port", str(port),
                       "--num-threads", str(threads), "--max-total-tokens", "16384"]

                def generate(n: int, i: int = 0, url: str = url) -> None:
                    _post(url + "/generate", {"input_ids": _prompt(i), "sampling_params": {
                        "temperature": 0, "max_new_tokens": n, "ignore_eos": True}})
            else:  # one slot per concurrent request, each with the context a request needs
                cmd = [find_llama_server(None), "-m", path, "--port", str(port), "-t", str(threads),
                       "-c", str(concurrency * 512), "-np", str(concurrency)]

                def generate(n: int, i: int = 0, url: str = url) -> None:
                    _post(url + "/completion", {"prompt": _prompt(i), "n_predict": n, "temperature": 0,
                                                "ignore_eos": True, "cache_prompt": False})
            log = tempfile.NamedTemporaryFile(prefix=f"moe-{name}-", suffix=".log", delete=False)  # noqa: SIM115
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            servers[name] = (proc, generate)
            _wait(url, proc)
            print(f"{name} up (log {log.name})", flush=True)
        runs: dict[str, dict[str, list[float]]] = {n: {"itl_ms": [], "throughput_tok_s": []} for n in servers}
        for turn in range(repeats):
            for name, (_, generate) in servers.items():
                runs[name]["itl_ms"].append(_itl_ms(generate, new_tokens, itl_samples))
                runs[name]["throughput_tok_s"].append(_throughput(generate, concurrency, new_tokens))
                print(f"turn {turn}: {name} ITL {runs[name]['itl_ms'][-1]:.2f} ms, {concurrency} concurrent "
                      f"{runs[name]['throughput_tok_s'][-1]:.1f} tok/s", flush=True)
        return {name: {key: statistics.median(values) for key, values in r.items()} | {"runs": r}
                for name, r in runs.items()}
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=60)


def _prompt(i: int) -> list[int]:
    """A 64-token prompt per request index (distinct, so no request reuses another's prefix)."""
    return [100 + (i * 131 + j * 7) % 40000 for j in range(64)]


def active_step_bytes(path: str) -> int:
    """Weight bytes one batch-1 decode step reads: every tensor a dense step reads (bench/gguf_bound.py's
    rule) but of each expert tensor (`ffn_*_exps`, all experts stacked) only the top-k experts' share."""
    from bench.gguf_bound import gguf_tensor_bytes, step_weight_bytes

    share = CONFIG["num_experts_per_tok"] / CONFIG["num_experts"]
    return step_weight_bytes((name, int(n * share) if "_exps." in name else n)
                             for name, n in gguf_tensor_bytes(path))


def bound_ms(path: str, threads: int) -> dict[str, float]:
    """The batch-1 bandwidth bound: active bytes / the read bandwidth measured now on `threads` threads."""
    from bench.gguf_bound import GB, measure_read_gbps

    gbps = measure_read_gbps(threads=threads)
    active = active_step_bytes(path)
    return {"active_gb": active / GB, "read_gbps": gbps, "bound_ms": active / (gbps * GB) * 1e3}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--make", action="store_true", help="only make the files")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--new-tokens", type=int, default=33)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--itl-samples", type=int, default=5,
                   help="(long - short) answer differences a turn, their median its ITL (one alone swung 10-17 ms)")
    p.add_argument("--concurrency", type=int, default=32)
    args = p.parse_args()
    path = ensure_files()
    from bench.gguf_bound import gguf_step_bytes

    print(f"{path}: file {os.path.getsize(path) / 1e9:.2f} GB; a dense step would read "
          f"{gguf_step_bytes(path) / 1e9:.2f} GB (all experts)", flush=True)
    if args.make:
        return 0
    r = run_pair(path, args.threads, args.new_tokens, args.repeats, args.concurrency, args.itl_samples)
    ours, peer = r["tokenloom"], r["llama.cpp"]
    print(json.dumps({**r, "itl_speedup": peer["itl_ms"] / ours["itl_ms"],
                      "throughput_ratio": ours["throughput_tok_s"] / peer["throughput_tok_s"],
                      "bound_ms": bound_ms(path, args.threads)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
