"""GPU paths checked on CPU (issue 49): what a first GPU lease would trip over, caught here.

- Importing metainfer must not initialise CUDA: a forkserver that preloads metainfer (multirank's
  ranks, `metainfer serve --ranks`) forks children that cannot use CUDA once the parent has
  touched the CUDA runtime (torch.cuda.is_available() does). The test pretends to be a CUDA
  build with a GPU (metadata and NVML patched) and fails if is_available() is called or CUDA
  ends up initialised."""

import os
import subprocess
import sys

import pytest

_PROBE = r"""
import importlib.metadata as md, os, sys
real = md.version
md.version = lambda name: "2.13.0" if name == "torch" else real(name)   # not a "+cpu" build
import torch
calls = []
torch.cuda.is_available = lambda: calls.append("is_available") or True
torch.cuda._is_compiled = lambda: True
torch.cuda._device_count_nvml = lambda: int(sys.argv[1])
import metainfer
print(calls, torch.cuda.is_initialized(), os.environ.get("TRITON_INTERPRET"))
"""


@pytest.mark.parametrize("gpus, interpret", [(1, None), (0, "1")])
def test_importing_metainfer_never_initialises_cuda(tmp_path, gpus, interpret):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "METAINFER_TRITON_INTERPRET")}
    out = subprocess.run([sys.executable, "-c", _PROBE, str(gpus)], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[0] == f"[] False {interpret}"  # no is_available(), CUDA untouched
