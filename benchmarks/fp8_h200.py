"""The FP8 checks for an H200, in one run: the FP8 tests on the GPU (the FP8 GEMV and FP8
tensor-core products, the KV-write, decode and extend kernels over an FP8 cache, the accuracy
gates on the default model against HF fp32), ``fp8_linear.py`` (FP8 products against bf16 per
projection and row count), then ``gpu_decode.py`` (Heron only, dummy weights) with the FP8 KV
cache (its workload A) and with FP8 weights (its batch 1).

    PYTHONPATH=$PWD python3 benchmarks/fp8_h200.py
"""

from __future__ import annotations

import subprocess
import sys

TESTS = [
    "tests/layers/test_fp8_linear.py",
    "tests/ops/test_fp8_kv_cache.py",
    "tests/test_fp8_accuracy.py",
]
# On the GPU: every test but the CPU accuracy run and the sm_90 lowering (checked off the GPU).
PYTEST = [sys.executable, "-m", "pytest", "-q", "-s", "-rxs", "-k", "not on_the_cpu and not lower"]
DECODE = [sys.executable, "benchmarks/gpu_decode.py", "--skip-hf", "--load-format", "dummy"]
STEPS = [
    [*PYTEST, *TESTS],
    [sys.executable, "benchmarks/fp8_linear.py"],
    [*DECODE, "--kv-cache-dtype", "fp8"],
    [*DECODE, "--quantization", "fp8"],
]


def main() -> int:
    failed = 0
    for step in STEPS:
        print("$", " ".join(step[1:]), flush=True)
        failed += subprocess.run(step).returncode != 0
    return failed


if __name__ == "__main__":
    sys.exit(main())
