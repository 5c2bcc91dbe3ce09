"""Huge pages for a rank's large tensors (executor/huge_pages.py): the environment the launcher adds, the THP
mode and huge-page amount a rank reports, and torch's allocator really backing a large tensor with huge pages
when the variable is set (checked in a fresh process: torch reads it once)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tokenloom.executor import huge_pages


def test_rank_memory_env_leaves_the_users_setting():
    heap = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    assert huge_pages.rank_memory_env({}) == {"THP_MEM_ALLOC_ENABLE": "1", **heap}
    assert huge_pages.rank_memory_env({"THP_MEM_ALLOC_ENABLE": "0"}) == heap
    assert huge_pages.rank_memory_env({"GOMP_SPINCOUNT": "5"}) == {"THP_MEM_ALLOC_ENABLE": "1", **heap}
    # the user's other tunables are kept; their own hugetlb choice wins
    assert huge_pages.rank_memory_env({"THP_MEM_ALLOC_ENABLE": "1", "GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}) == {
        "GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"}
    assert huge_pages.rank_memory_env({"THP_MEM_ALLOC_ENABLE": "1", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}) == {}


@pytest.mark.parametrize("text, mode", [("always [madvise] never\n", "madvise"), ("[always] madvise never", "always"),
                                        ("always madvise [never]\n", "never"), ("garbled\n", None)])
def test_thp_mode_reads_the_bracketed_word(tmp_path, text, mode):
    path = tmp_path / "enabled"
    path.write_text(text)
    assert huge_pages.thp_mode(str(path)) == mode
    assert huge_pages.thp_mode(str(tmp_path / "missing")) is None


def test_anon_huge_mib_parses_smaps_rollup(tmp_path):
    path = tmp_path / "smaps_rollup"
    path.write_text("Rss:             1856484 kB\nAnonHugePages:    651264 kB\nShmemHugePages:        0 kB\n")
    assert huge_pages.anon_huge_mib(str(path)) == 636.0
    path.write_text("Rss: 10 kB\n")
    assert huge_pages.anon_huge_mib(str(path)) is None
    assert huge_pages.anon_huge_mib(str(tmp_path / "missing")) is None


_ALLOCATE = """
import json, torch
from tokenloom.executor.huge_pages import anon_huge_mib
before = anon_huge_mib()
t = torch.ones(64 * 2**20, dtype=torch.uint8)  # 64 MiB, every page touched
print(json.dumps({"before": before, "after": anon_huge_mib(), "sum": int(t[::4096].sum())}))
"""


def _run_fresh(script: str, name: str, value: str | None) -> dict:
    """`script`'s last printed JSON line, run in a fresh interpreter with variable `name` set to `value` (or
    removed): the allocators read their variables once, at start-up."""
    import os
    env = {k: v for k, v in os.environ.items() if k != name}
    if value is not None:
        env[name] = value
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _huge_mib_of_a_64_mib_tensor(env_value: str | None) -> float:
    report = _run_fresh(_ALLOCATE, huge_pages.THP_ENV, env_value)
    assert report["sum"] == 64 * 2**20 // 4096
    return report["after"] - report["before"]


def test_torch_backs_large_tensors_with_huge_pages_when_the_rank_variable_is_set():
    mode = huge_pages.thp_mode()
    if mode not in ("madvise", "always") or huge_pages.anon_huge_mib() is None:
        pytest.skip(f"transparent huge pages unavailable here (mode {mode})")
    # most of the 64 MiB in 2 MiB pages (a fragmented machine may serve a few with 4 KiB pages)
    assert _huge_mib_of_a_64_mib_tensor("1") >= 32
    if mode == "madvise":  # without the variable torch does not ask: what the launcher's default changes
        assert _huge_mib_of_a_64_mib_tensor(None) < 8


_MALLOC_HEAP = """
import ctypes, json
from tokenloom.executor.huge_pages import anon_huge_mib
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
before = anon_huge_mib()
blocks = []
for _ in range(1024):  # 64 MiB in 64 KiB blocks: below malloc's mmap threshold, so from its heap
    block = libc.malloc(64 * 1024)
    ctypes.memset(block, 1, 64 * 1024)
    blocks.append(block)
print(json.dumps({"before": before, "after": anon_huge_mib()}))
"""


def _huge_mib_of_a_64_mib_heap(tunables: str | None) -> float:
    report = _run_fresh(_MALLOC_HEAP, huge_pages.TUNABLES_ENV, tunables)
    return report["after"] - report["before"]


def test_glibc_backs_the_malloc_heap_with_huge_pages_under_the_rank_tunable():
    import platform
    mode = huge_pages.thp_mode()
    libc, version = platform.libc_ver()
    if mode != "madvise" or huge_pages.anon_huge_mib() is None:
        pytest.skip(f"transparent huge pages not in madvise mode here (mode {mode})")
    if libc != "glibc" or tuple(int(x) for x in version.split(".")[:2]) < (2, 35):
        pytest.skip(f"glibc.malloc.hugetlb needs glibc >= 2.35 (here {libc} {version})")
    assert _huge_mib_of_a_64_mib_heap(huge_pages.rank_memory_env({})[huge_pages.TUNABLES_ENV]) >= 32
    assert _huge_mib_of_a_64_mib_heap(None) < 8  # without it the heap stays in 4 KiB pages
