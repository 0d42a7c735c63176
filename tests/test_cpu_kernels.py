"""The second CPU of CI (``make test-other-cpu``): the settings of ``tests/other-cpu.env`` really
select other kernels on this machine, so the tests that compare numbers, rerun under them, see
float32 results that differ in their last bits from the default run's, as on another CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

OTHER_CPU = Path(__file__).with_name("other-cpu.env")

PROBE = """
import hashlib, torch
torch.manual_seed(0)
a, b, x = torch.randn(64, 333), torch.randn(333, 77), torch.randn(2, 4, 40, 16)
parts = [a @ b, torch.softmax(torch.randn(8, 1001), -1), torch.randn(10007).exp(),
         torch.nn.functional.scaled_dot_product_attention(x, x, x)]
print(torch.backends.cpu.get_cpu_capability())
print(" ".join(hashlib.sha256(p.contiguous().numpy().tobytes()).hexdigest()[:16] for p in parts))
"""


def other_cpu_settings() -> dict[str, str]:
    """``tests/other-cpu.env`` as a dict (KEY=VALUE lines, # comments)."""
    pairs = (line.split("=", 1) for line in OTHER_CPU.read_text().splitlines()
             if line.strip() and not line.startswith("#"))
    return {key.strip(): value.strip() for key, value in pairs}


def _probe(extra: dict[str, str]) -> tuple[str, list[str]]:
    env = {k: v for k, v in os.environ.items() if k not in other_cpu_settings()}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**env, "OMP_NUM_THREADS": "1", **extra},
                         capture_output=True, text=True, check=True, timeout=120).stdout.split("\n")
    return out[0], out[1].split()


def test_the_other_cpu_settings_change_float32_results() -> None:
    """Same inputs, same process code: the default kernels and the other CPU's differ in float32
    bits (matmul, softmax, exp, attention), and torch reports the other capability."""
    native, native_bits = _probe({})
    if native in ("AVX2", "DEFAULT"):
        pytest.skip(f"this CPU's kernels are already {native}: the other-CPU run equals the default one here")
    other, other_bits = _probe(other_cpu_settings())
    assert other == "AVX2"
    differing = [i for i, (a, b) in enumerate(zip(native_bits, other_bits, strict=True)) if a != b]
    assert differing, "tests/other-cpu.env selects the same kernels as the default run: it tests nothing"


def test_this_process_runs_the_kernels_its_environment_asks_for() -> None:
    """Under ``make test-other-cpu`` this process itself runs AVX2 kernels (the rerun is real)."""
    wanted = os.environ.get("ATEN_CPU_CAPABILITY")
    if wanted is None:
        pytest.skip("not the other-CPU run")
    assert torch.backends.cpu.get_cpu_capability() == wanted.upper()
