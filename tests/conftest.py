"""Shared fixtures: tiny random checkpoints, and the SmolLM2 reference loaded once per session."""

from __future__ import annotations

import os

# libgomp reads its wait policy once, when torch loads it: set before the import below. The test process shares
# two cores with the servers it starts; OpenMP threads spinning for ~30 ms after each op would take a core from
# them. The servers' rank processes inherit it (a user's setting wins over the launcher's ~1 ms spin,
# tokenloom/executor/cpu_threads.py): several processes share these two cores in the tests.
os.environ.setdefault("GOMP_SPINCOUNT", "1000")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.model_factory import make_hf_model


def pytest_addoption(parser):
    parser.addoption("--long", action="store_true",
                     help="run the long forms of the soak and stress tests (same as TOKENLOOM_TEST_LONG=1)")


def pytest_configure(config):
    if config.getoption("--long"):
        os.environ["TOKENLOOM_TEST_LONG"] = "1"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """factory(variant) -> (folder, transformers model), cached per variant for the session."""
    cache: dict[str, tuple[str, torch.nn.Module]] = {}

    def get(variant: str = "llama"):
        if variant not in cache:
            folder = str(tmp_path_factory.mktemp(f"tiny_{variant}"))
            cache[variant] = (folder, make_hf_model(variant, folder))
        return cache[variant]

    return get


@pytest.fixture(scope="session")
def family_model_dir(tmp_path_factory):
    """factory(variant of tests/family_models.VARIANTS) -> (folder, transformers float32 model), cached per
    variant for the session (SmolLM2's tokenizer beside the weights)."""
    from tests.family_models import make_variant

    cache: dict[str, tuple[str, torch.nn.Module]] = {}

    def get(variant: str):
        if variant not in cache:
            folder = str(tmp_path_factory.mktemp(f"family_{variant}") / variant)
            cache[variant] = (folder, make_variant(variant, folder))
        return cache[variant]

    return get


@pytest.fixture(scope="session")
def smollm2_file() -> str:
    from tokenloom.models.default_model import default_model_file

    return default_model_file()


@pytest.fixture(scope="session")
def smollm2_hf_reference(smollm2_file):
    """transformers' own GGUF loader on the same file, float32 (~25 s on 2 cores; loaded once)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(os.path.dirname(smollm2_file),
                                                gguf_file=os.path.basename(smollm2_file),
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smollm2_runner_fp32():
    from tokenloom.config import ServerArgs
    from tokenloom.executor.model_runner import ModelRunner

    # Dequantized at load: the tests that use it compare the forward pass to transformers (which dequantizes
    # the file too) to float32 tolerance; the quantized path has its own tests (test_quantized_gguf.py).
    return ModelRunner(ServerArgs(dtype="float32", quantization="none", max_total_tokens=8192,
                                  max_running_requests=16))


@pytest.fixture(scope="session")
def tiny_runtime_model(tmp_path_factory) -> str:
    """Folder with a tiny random Llama (SmolLM2 vocabulary) and SmolLM2's tokenizer."""
    from tests.model_factory import make_tiny_with_smollm2_tokenizer

    return make_tiny_with_smollm2_tokenizer(str(tmp_path_factory.mktemp("tiny_runtime")))
