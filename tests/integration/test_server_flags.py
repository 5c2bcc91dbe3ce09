"""Server flags do what they say, for the flags whose effect no other test checks: --mem-fraction-static
(SGLang's meaning, with the machine's memory injected), --max-total-tokens over it, --random-seed,
--dtype, --load-format, --quantization, --tokenizer-path, --decode-slot-run, --num-threads,
--cpu-threads-policy (and the libgomp wait settings the launcher gives its rank processes), --stream-interval,
--enable-metrics / --api-key and --log-level. Tiny random model, in-process (the rank environment: through a
real Engine)."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from tests.scheduler_harness import Harness
from tokenloom.cache.memory_budget import MemoryBudgetError
from tokenloom.config import ServerArgs
from tokenloom.executor import huge_pages, model_runner
from tokenloom.executor.model_runner import ModelRunner
from tokenloom.model_config import ModelConfigError
from tokenloom.models.loader import resolve_model_source
from tokenloom.protocol import RequestAccepted

MIB = 2**20
# The tiny Llama (tests/model_factory.TINY) in float32, by hand: per layer qkv 128x64 + o 64x64 + gate_up
# 256x64 + down 64x128 + 2 norms of 64 = 36992 params; 2 layers, embed and untied lm_head 256x64 each, final
# norm 64: 106816 params = 427264 bytes; the rotary cos/sin tables 2 x 512 x 16 float32 = 65536 bytes.
TINY_FP32_WEIGHT_BYTES = 427264 + 65536
# KV per token: 2 layers x (K, V) x 2 kv heads x head_dim 16 x 4 bytes.
TINY_FP32_KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return tiny_model_dir("llama")[0]


@pytest.fixture
def memory(monkeypatch):
    """Set the memory the runner sees as available at start (instead of reading the machine)."""
    def set_memory(nbytes: int) -> None:
        monkeypatch.setattr(model_runner, "available_memory_bytes", lambda device: nbytes)
    return set_memory


def _runner(folder: str, **kw) -> ModelRunner:
    return ModelRunner(ServerArgs(model_path=folder, **{"dtype": "float32", "max_running_requests": 4, **kw}))


@pytest.mark.parametrize("fraction", [0.5, 0.85, 0.9])
def test_mem_fraction_static_is_the_share_for_weights_plus_kv(folder, memory, fraction):
    memory(64 * MIB)
    runner = _runner(folder, mem_fraction_static=fraction)
    expected = int(fraction * 64 * MIB - TINY_FP32_WEIGHT_BYTES) // TINY_FP32_KV_BYTES_PER_TOKEN
    assert runner.max_total_num_tokens == expected
    assert runner.kv_pool.nbytes() == (expected + 1) * TINY_FP32_KV_BYTES_PER_TOKEN  # + the dummy slot


def test_default_on_the_cpu_is_a_quarter_of_what_the_weights_left(folder, memory):
    memory(64 * MIB)
    expected = int((64 * MIB - TINY_FP32_WEIGHT_BYTES) * 0.25) // TINY_FP32_KV_BYTES_PER_TOKEN
    assert _runner(folder).max_total_num_tokens == expected
    paged = _runner(folder, page_size=16)
    assert paged.max_total_num_tokens == expected // 16 * 16


def test_weights_above_the_fraction_are_a_clear_error(folder, memory):
    memory(1 * MIB)  # 0.3 MiB for weights + KV, but the weights take 0.47 MiB
    with pytest.raises(MemoryBudgetError, match="--mem-fraction-static 0.3 .*the weights alone take"):
        _runner(folder, mem_fraction_static=0.3)


def test_max_total_tokens_overrides_the_memory_budget(folder, memory):
    memory(1 * MIB)
    assert _runner(folder, mem_fraction_static=0.3, max_total_tokens=96).max_total_num_tokens == 96


def test_random_seed_seeds_dummy_weights_and_the_sampler(folder):
    def weights(seed: int) -> torch.Tensor:
        runner = _runner(folder, load_format="dummy", random_seed=seed, max_total_tokens=64)
        assert runner.sampler.generator.initial_seed() == seed
        return runner.model.layers[0].mlp.down_proj.weight.clone()

    a, b, c = weights(1), weights(1), weights(2)
    assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize("dtype, expected", [("auto", torch.bfloat16), ("float32", torch.float32),
                                             ("bfloat16", torch.bfloat16), ("float16", torch.float16)])
def test_dtype_sets_weights_and_kv_cache(folder, dtype, expected):
    from tests.scheduler_harness import generate_in_process

    runner = _runner(folder, dtype=dtype, max_total_tokens=128)
    assert runner.dtype == expected == runner.kv_pool.dtype
    assert runner.model.layers[0].self_attn.qkv_proj.weight.dtype == expected
    params = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
    out = generate_in_process(runner, [[1, 2, 3, 4]], [params], [0])
    assert len(out[0]) == 3 and all(0 <= t < 256 for t in out[0])


def test_load_format_each_value(folder, tmp_path, monkeypatch):
    from types import SimpleNamespace

    from tokenloom.models import loader

    def fmt(path: str, load_format: str) -> str:
        return resolve_model_source(ServerArgs(model_path=path, load_format=load_format)).load_format

    assert [fmt(folder, f) for f in ("auto", "safetensors", "dummy")] == ["safetensors", "safetensors", "dummy"]
    with pytest.raises(ModelConfigError, match="--load-format gguf needs a .gguf file"):
        fmt(folder, "gguf")
    config = resolve_model_source(ServerArgs(model_path=folder)).config
    monkeypatch.setattr(loader, "GGUFFile", lambda path: SimpleNamespace(model_config=lambda: config,
                                                                         tensor_types=lambda: set()))
    gguf = tmp_path / "model.gguf"  # parsing a real file is test_load_errors' job; here only the choice
    gguf.write_bytes(b"")
    assert [fmt(str(gguf), f) for f in ("auto", "gguf", "dummy")] == ["gguf", "gguf", "dummy"]
    with pytest.raises(ModelConfigError, match="needs --load-format gguf"):
        fmt(str(gguf), "safetensors")


def test_quantization_each_value(folder, tmp_path):
    import transformers

    from tests.gguf_factory import write_gguf
    from tests.model_factory import TINY
    from tokenloom.config import ConfigError
    from tokenloom.entrypoints.launch_server import parse_args

    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**TINY, "tie_word_embeddings": True}))
    gguf = str(tmp_path / "tiny.gguf")
    write_gguf(gguf, hf, lambda name: "Q8_0")

    def quant(path: str, **kw) -> str:
        return resolve_model_source(ServerArgs(model_path=path, **kw)).quantization

    # A .gguf file: its quantized tensors kept (default, gguf) or dequantized to --dtype (none).
    assert [quant(gguf), quant(gguf, quantization="gguf"), quant(gguf, quantization="none")] == \
        ["gguf", "gguf", "none"]
    assert quant(gguf, load_format="dummy") == "none"  # random float weights
    assert quant(gguf, device="cuda") == "none"  # the quantized kernels are the CPU's
    with pytest.raises(ModelConfigError, match="--quantization gguf .*runs on the CPU only"):
        quant(gguf, device="cuda", quantization="gguf")
    with pytest.raises(ConfigError, match="--quantization gguf .*--load-format dummy"):
        ServerArgs(model_path=gguf, quantization="gguf", load_format="dummy")
    kept = _runner(gguf, max_total_tokens=64).model.layers[0].self_attn.qkv_proj
    dense = _runner(gguf, quantization="none", max_total_tokens=64).model.layers[0].self_attn.qkv_proj
    assert kept.weight is None and kept.quant is not None
    assert dense.quant is None and dense.weight.dtype == torch.float32
    # A Hugging Face folder holds float weights: none (default) works, gguf is a start-up error.
    assert [quant(folder), quant(folder, quantization="none")] == ["none", "none"]
    with pytest.raises(ModelConfigError, match="--quantization gguf needs a .gguf file"):
        quant(folder, quantization="gguf")
    # SGLang's other methods are refused by name; anything else lists the choices.
    for method in ("torchao", "fp8", "marlin"):
        with pytest.raises(ConfigError, match=f"--quantization {method} is not implemented"):
            ServerArgs(quantization=method)
    # gptq / awq / compressed-tensors name a checkpoint's own quantization (tests/integration/test_hf_quant.py,
    # test_compressed_tensors.py): a float one is refused.
    for method in ("gptq", "compressed-tensors"):
        with pytest.raises(ModelConfigError, match=f"--quantization {method}, but the checkpoint is a float one"):
            quant(folder, quantization=method)
    with pytest.raises(ConfigError, match="--quantization must be one of gguf, none, gptq, awq, compressed-tensors, "
                                          "w8a8_int8; got 'q4'"):
        ServerArgs(quantization="q4")
    assert parse_args(["--quantization", "none"]).quantization == "none"
    assert parse_args([]).quantization is None


def test_tokenizer_path_is_used_and_must_be_a_folder(folder, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tokenloom.tokenizer import load_tokenizer

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 7, "world": 9}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(tmp_path / "tok")
    source = resolve_model_source(ServerArgs(model_path=folder))
    assert load_tokenizer(source, str(tmp_path / "tok"))("hello world").input_ids == [7, 9]
    with pytest.raises(ValueError, match="--tokenizer-path '/no/such/tokenizer' is not a folder"):
        load_tokenizer(source, "/no/such/tokenizer")


@pytest.mark.parametrize("run", [1, 4, 16])
def test_decode_slot_run_reaches_the_allocator(folder, run):
    assert _runner(folder, decode_slot_run=run, max_total_tokens=128).token_allocator.decode_run == run


@pytest.mark.parametrize("threads", [1, 2])
def test_num_threads_sets_torch_threads(folder, threads):
    old = torch.get_num_threads()
    try:
        _runner(folder, num_threads=threads, max_total_tokens=64)
        assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("policy", ["adaptive", "fixed"])
def test_cpu_threads_policy_reaches_the_forward(folder, policy):
    old = torch.get_num_threads()
    try:
        h = Harness(folder, cpu_threads_policy=policy, num_threads=2, max_total_tokens=256)
        threads = h.loop.guard.threads
        if policy == "fixed":
            assert threads is None and "forward_threads" not in h.scheduler.internal_state(h.loop.info())
            return
        assert threads.max_threads == 2 and threads.threads == 2
        h.submit("warm", [5, 6, 7], {"max_new_tokens": 3, "temperature": 0})
        assert len(h.run()["warm"].output_ids) == 3
        two_cores = len(os.sched_getaffinity(0)) == 2  # one forward thread a core (executor/team_placement.py)
        assert h.scheduler.internal_state(h.loop.info())["forward_threads_bound"] is two_cores

        class Busy:  # other processes keep both cores busy
            cores = {0, 1}

            def others(self) -> float:
                return 2.0

        threads.share = Busy()
        threads.measure()  # what the policy's sampler thread does every interval
        h.submit("r", [5, 6, 7], {"max_new_tokens": 3, "temperature": 0})
        assert len(h.run()["r"].output_ids) == 3
        assert threads.threads == 1 and torch.get_num_threads() == 1  # set on the thread that ran the step
        state = h.scheduler.internal_state(h.loop.info())  # what /get_server_info reports
        assert (state["forward_threads"], state["forward_thread_changes"]) == (1, 1)
        assert state["forward_threads_bound"] is False  # one thread: free to move away from the busy cores
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("user_env, policy, expected, thp, tunables", [
    ({}, "adaptive", {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": "10000"}, "1", "glibc.malloc.hugetlb=1"),
    ({}, "fixed", {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": "1000"}, "1", "glibc.malloc.hugetlb=1"),
    ({"OMP_WAIT_POLICY": "PASSIVE", "THP_MEM_ALLOC_ENABLE": "0", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"},
     "fixed", {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": None}, "0", "glibc.malloc.hugetlb=0"),
])
def test_rank_processes_start_with_the_wait_policy(tiny_runtime_model, monkeypatch, user_env, policy, expected,
                                                   thp, tunables):
    from tokenloom import Engine

    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "THP_MEM_ALLOC_ENABLE", "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)
    for name, value in user_env.items():
        monkeypatch.setenv(name, value)
    with Engine(tiny_runtime_model, dtype="float32", max_total_tokens=512, log_level="warning",
                cpu_threads_policy=policy) as eng:
        info = eng.tokenizer_manager.scheduler_info
        assert info["rank_omp_env"] == expected  # the rank environment
        assert info["thp_mem_alloc_enable"] == thp  # torch's huge-page allocation, unless the user said no
        assert info["glibc_tunables"] == tunables  # glibc's heap in huge pages, unless the user said no
        assert info["thp_mode"] == huge_pages.thp_mode()
        # the rank counts this process (the server's root) and its children as its own server's
        assert eng.tokenizer_manager.scheduler_info["server_root_pid"] == os.getpid()
    assert "GOMP_SPINCOUNT" not in os.environ or user_env.get("GOMP_SPINCOUNT")  # this process: unchanged


class _ChunkRecorder(Harness):
    """Records how many new tokens each output message carried, per request."""

    def _collect(self) -> None:
        for msg in self.outbox.recv_all():
            if isinstance(msg, RequestAccepted):
                continue
            for i, rid in enumerate(msg.rids):
                self.results.setdefault(rid, []).append(len(msg.new_token_ids[i]))  # type: ignore[arg-type]


@pytest.mark.parametrize("interval, per_request, stream, chunks", [
    (1, None, True, [1] * 10),
    (3, None, True, [3, 3, 3, 1]),
    (3, 5, True, [5, 5]),          # the request's own stream_interval wins
    (3, None, False, [10]),        # not streaming: one message at the end
])
def test_stream_interval_sets_streamed_chunk_size(folder, interval, per_request, stream, chunks):
    h = _ChunkRecorder(folder, stream_interval=interval)
    params = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 10}
    if per_request is not None:
        params["stream_interval"] = per_request
    h.submit("r", list(range(1, 9)), params, stream=stream)
    h.run()
    assert h.results["r"] == chunks


@pytest.mark.parametrize("flags", [[], ["--enable-metrics"], ["--api-key", "k"],
                                   ["--enable-metrics", "--api-key", "k"]])
def test_enable_metrics_and_api_key_shape_the_app(folder, flags):
    from types import SimpleNamespace

    from tokenloom.entrypoints.http_server import ApiKeyMiddleware, create_app
    from tokenloom.entrypoints.launch_server import parse_args

    args = parse_args(flags)
    tm = SimpleNamespace(source=resolve_model_source(ServerArgs(model_path=folder)))  # routes call nothing yet
    app = create_app(tm, args)  # type: ignore[arg-type]
    assert ("/metrics" in {getattr(r, "path", None) for r in app.routes}) == args.enable_metrics
    assert any(m.cls is ApiKeyMiddleware for m in app.user_middleware) == (args.api_key is not None)


@pytest.mark.parametrize("level", ["debug", "info", "warning", "error"])
def test_log_level_sets_the_root_level(level):
    from tokenloom.frontend.process_utils import configure_logging

    root = logging.getLogger()
    saved_handlers, saved_level = root.handlers[:], root.level
    try:
        configure_logging(level, "test")
        assert root.level == getattr(logging, level.upper())
    finally:
        for handler in root.handlers[:]:
            root.removeHandler(handler)
        for handler in saved_handlers:
            root.addHandler(handler)
        root.setLevel(saved_level)
