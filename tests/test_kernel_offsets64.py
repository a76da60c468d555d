"""64-bit address arithmetic in the kernels (under the interpreter): each kernel reads a tensor
whose strides put some of its elements past 2^31 elements from the start, so an offset computed
in int32 would wrap (reading the wrong memory, or crashing). The storage is a few GiB of
untouched virtual memory, only the pages the views use are written. Run in a child process: a
wrapped address can end it with a segmentation fault rather than a wrong number."""

import os
import subprocess
import sys

import torch

# kv head h of a (.., heads, keys, D) view starts at h x STRIDE: head 2 lies past 2^31 while the
# stride itself fits in int32 (a stride >= 2^31 is passed as int64 and would hide the bug)
STRIDE = 2**30 + 64


def _store(elements, dtype):
    # torch.empty maps the pages lazily: the untouched gigabytes cost no memory
    return torch.empty(elements, dtype=dtype)


def attention_case():
    from metainfer.kernels import attention as A
    from metainfer.kernels.configs import config_for

    store = _store(2 * STRIDE + 24 * 16, torch.float16)
    k = store.as_strided((1, 3, 24, 16), (0, STRIDE, 16, 1))
    k.copy_(torch.randn(1, 3, 24, 16))
    q = torch.randn(1, 6, 5, 16).half()
    args = (q, k, k, None, 0.25, True, 19, False)
    return A.launch(*args, config=config_for("attention", q.device, head_dim=16)), A.reference(*args)


def sparse_attention_case():
    from metainfer.kernels import sparse_attention as SA

    store = _store(2 * STRIDE + 24 * 16, torch.float16)
    k = store.as_strided((1, 3, 24, 16), (0, STRIDE, 16, 1))
    k.copy_(torch.randn(1, 3, 24, 16))
    q = torch.randn(1, 3, 4, 16).half()
    idx = torch.stack([torch.randperm(24)[:10] for _ in range(4)])[None]
    args = (q, k, k, idx, None, 0.25, False, 0)
    return SA.launch(*args, config=SA.DEFAULT_CONFIGS["interpreter"]), SA.reference(*args)


def paged_attention_case():
    from metainfer.kernels import paged_attention as P
    from metainfer.kernels.configs import config_for

    # a pool stored head-major, (Hkv, rows, D), seen as (rows, Hkv, D)
    store = _store(2 * STRIDE + 40 * 16, torch.float16)
    pool = store.as_strided((40, 3, 16), (16, STRIDE, 1))
    pool.copy_(torch.randn(40, 3, 16))
    q = torch.randn(4, 6, 16).half()
    cu_q, cu_k = torch.tensor([0, 1, 4], dtype=torch.int32), torch.tensor([0, 17, 37], dtype=torch.int32)
    ki = torch.randperm(40)[:37]
    out = P.launch(q, pool, pool, ki, cu_q, cu_k, 3, 20, 0.25, config=config_for("paged_attention", q.device))
    return out, P.reference(q, pool, pool, ki, cu_q, cu_k, 0.25)


def fp8_gemm_case():
    from metainfer.kernels import fp8_gemm as F

    # a K-major weight (stride_wk > 1): column k at k x 2^24 elements, k >= 128 past 2^31
    n, kd, stride_k = 16, 160, 2**24 + 16
    store = _store((kd - 1) * stride_k + n, torch.uint8)
    w8, s = F.quantize_weight(torch.randn(n, kd), 16, 32)
    w = store.as_strided((n, kd), (1, stride_k)).view(torch.float8_e4m3fn)
    w.copy_(w8)
    x = torch.randn(3, kd)
    args = (x, w, s, None, 16, 32, False)
    return F.launch(*args, config=F.DEFAULT_CONFIGS["interpreter"]), F.reference(*args)


CASES = [attention_case, sparse_attention_case, paged_attention_case, fp8_gemm_case]


def test_offsets_past_two_to_the_31_elements():
    env = {**os.environ, "METAINFER_TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    done = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("ok ")]
    started = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("run ")]
    assert proc.returncode == 0, (f"exit {proc.returncode} in {started[-1] if started else '?'}\n"
                                  + proc.stdout[-2000:] + proc.stderr[-2000:])
    assert done == [c.__name__ for c in CASES]


if __name__ == "__main__":
    import metainfer.kernels  # noqa: F401  (the interpreter switch, before the kernel modules)

    torch.manual_seed(0)
    for case in CASES:
        print("run", case.__name__, flush=True)
        out, ref = case()
        torch.testing.assert_close(out.float(), ref.float(), atol=4e-3, rtol=4e-3)
        print("ok", case.__name__, flush=True)
