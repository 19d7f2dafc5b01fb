"""Ring attention on two GPUs: runs tests/distributed/ring_check.py under torchrun (NCCL, two
processes), which compares ring attention with single-GPU flashgen attention and float64 on
the gathered sequence (f16/bf16, causal or not, grouped-query or not, gradients too)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("cupy")
if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA GPUs", allow_module_level=True)

pytestmark = pytest.mark.gpu
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ring_over_two_gpus_equals_single_gpu_attention():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          os.path.join(ROOT, "tests", "distributed", "ring_check.py")],
                         env=env, capture_output=True, text=True, timeout=1200)
    print(run.stdout[-20000:], run.stderr[-20000:])
    assert run.returncode == 0 and "all cases within bounds" in run.stdout, run.stdout[-4000:] + run.stderr[-4000:]
