"""scripts/gpu-check's driver, run here on host memory registered as fake-device memory.

The driver (scripts/gpu_check/check.py) runs HandoffConnector as vLLM's GPU model runner
drives it, with a stub of the vLLM names it imports: P and D engine processes, every GPU layout
handoff derives (FlashAttention and FlashInfer shapes, NHD and HND strides, vLLM 0.33's
per-layer views in LBHNC and LBNHC strides, a kernel block smaller than the scheduler's), pull and streamed push, TP 1->1, 2->1 and 1->2; every prompt
row compared, sentinel blocks, nothing left pending, and the digest's negative control. With
HANDOFF_VLLM_TEST_FAKE_DEVICE the workers register the host tensors as the memory of a fake
CUDA device that aliases them: every transfer, tail zeroing and digest goes through device
copies, and a host slice of that memory would fault. The same driver runs on a real GPU with
scripts/gpu-check (docs/src/guides/gpu.md); this test keeps it working between GPU sessions.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import REPORT

ROOT = Path(__file__).resolve().parents[4]
CHECK = ROOT / "scripts" / "gpu_check" / "check.py"
STUB = ROOT / "scripts" / "gpu_check" / "stub"


def run_check(env_extra: dict, *args: str) -> tuple[dict, str]:
    env = dict(os.environ, PYTHONPATH=str(STUB), RUST_LOG="warn", **env_extra)
    r = subprocess.run([sys.executable, str(CHECK), "cpu", *args], env=env, capture_output=True,
                       text=True, timeout=900)
    lines = r.stdout.strip().splitlines()
    assert lines, f"no result (exit {r.returncode}): {r.stderr[-4000:]}"
    return json.loads(lines[-1]), r.stderr


def test_the_device_check_passes_over_fake_device_memory():
    result, log = run_check({"HANDOFF_VLLM_TEST_FAKE_DEVICE": "1"})
    REPORT["device_check_fake_device"] = {
        "cases": len(result["cases"]),
        "passed": sum(1 for v in result["cases"].values() if v is True),
        "controls": result["controls"],
    }
    assert "fake device" in log, "the switch took effect (the worker says so)"
    failed = [name for name, ok in result["cases"].items() if not ok]
    assert not failed, f"{failed}\n{log[-4000:]}"
    # Every layout, pull and push, the TP mismatches, and vLLM 0.33's views (K and V rows
    # interleaved) against each other and against K and V planes.
    assert len(result["cases"]) == 25, result["cases"]
    # The digest's negative control: a READ that lands with one byte changed must fail D's
    # request.
    assert result["controls"]["digest"] is True, log[-4000:]
    assert result["passed"] is True


def test_the_device_check_s_nixl_cases_pass_on_host_memory():
    """The NIXL cases of the device check (pull, streamed push, TP 2->1, a 0.33 view over NIXL) on host
    memory, which NIXL registers as DRAM here (its UCX has no CUDA): the connector's NIXL path
    under the driver the GPU run uses. TP 2->1 has D's rank read one block's heads from two P
    ranks at once, two READs into one chunk of its region (NIXL refused the second before its
    posts were deferred, and D recomputed)."""
    result, log = run_check({}, "nixl")
    REPORT["device_check_nixl_host"] = {"cases": result["cases"],
                                        "throughput": result.get("nixl_throughput")}
    assert len(result["cases"]) == 4, result["cases"]
    failed = [name for name, ok in result["cases"].items() if not ok]
    assert not failed, f"{failed}\n{log[-4000:]}"
    # The GPU run's NIXL comparison, both halves, small: handoff NIXL and raw NIXL.
    t = result["nixl_throughput"]
    assert t["handoff_nixl_gbps"] and t["raw_nixl_gbps"], t
    assert result["passed"] is True
