"""Every Triton kernel compiles for sm_80, sm_89 and sm_90 with no GPU (lowering/aot.py): Triton's
compiler down to ptxas cubins, in a process with the interpreter off, from an empty Triton
cache so nothing compiled earlier is reused. A kernel that does not compile, or needs more
shared memory than an architecture has, fails this test."""

import json
import os
import subprocess
import sys

from metainfer.lowering import aot


def test_every_kernel_compiles_for_every_gpu_arch(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("METAINFER_TRITON_INTERPRET",)}
    env.update(TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path / "triton-cache"))
    out = tmp_path / "aot.json"
    proc = subprocess.run([sys.executable, "-m", "metainfer.lowering.aot", "--json", str(out)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert out.exists(), proc.stderr[-3000:]
    results = json.loads(out.read_text())
    failed = [r for r in results if r["status"] == "failed"]
    assert not failed, "\n".join(f"{r['arch']} {r['kernel']} ({r['case']}): {r['detail']}" for r in failed)
    assert proc.returncode == 0, proc.stdout[-3000:]
    compiled = {(r["kernel"], r["arch"]) for r in results if r["status"] == "ok"}
    kernels = {r["kernel"] for r in results if r["status"] == "ok"}
    # every launched kernel: moe's four (routing sort, two GEMMs, pair sum) and its decode pair
    # (two matrix-vector kernels), the merge of key splits, fp8_gemm's split-K sum, the dense redo of
    # sparse attention's unselected rows, int4_gemm's tiles and its matrix-vector decode kernel
    assert len(kernels) == 20, sorted(kernels)
    assert {"_flash._combine_splits", "fp8_gemm._sum_splits", "moe._moe_align", "moe._moe_sum",
            "moe._moe_gemv_gate_up", "moe._moe_gemv_down", "int4_gemm._int4_gemm", "int4_gemm._int4_gemv"} <= kernels
    assert compiled == {(k, a) for k in kernels for a in aot.ARCHS}
    # the decode paths: key splits of attention and MLA (dense and top-k), small-M split-K GEMMs
    cases = {(r["kernel"], r["case"]) for r in results if r["status"] == "ok"}
    for kernel, case in [("attention", "bf16 d128 decode, key splits"), ("mla_decode", "bf16 dense decode, key splits"),
                         ("mla_decode", "bf16 sparse top-2048 decode, key splits"),
                         ("fp8_gemm", "decode m=4, bf16 activations, split-K"),
                         ("fp8_gemm", "decode m=24, fp8 activations, split-K")]:
        assert ("_flash._combine_splits" if kernel != "fp8_gemm" else "fp8_gemm._sum_splits", case) in cases
    # registers per thread from each cubin: within ptxas's 255, more for a wide accumulator than
    # for a copy, and within a block's 64 K (else the launch is a failure above)
    regs = {(r["kernel"], r["case"], r["arch"]): r["registers"] for r in results if r["status"] == "ok"}
    assert all(1 <= v <= 255 for v in regs.values()), regs
    assert regs[("attention._attention_fwd", "bf16 d256 causal", "sm_90")] > \
        regs[("rmsnorm._rmsnorm_fwd", "bf16 4096 + residual", "sm_90")]
    # the only refusals are the launcher's own: FP8 experts (both paths) before sm_89
    assert [(r["kernel"], r["arch"]) for r in results if r["status"] == "refused"] == [("moe", "sm_80")] * 2


def test_the_tool_refuses_to_run_under_the_interpreter(capsys, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert aot.main([]) == 2
    assert "TRITON_INTERPRET is on" in capsys.readouterr().err


def test_launched_kernels_are_found_in_the_kernel_files():
    """The kernels launchers start, not the @triton.jit helpers they call (found by name[grid])."""
    found = set(aot.launched_kernels())
    assert {"attention._attention_fwd", "paged_attention._paged_fwd", "moe._moe_gate_up", "moe._moe_down",
            "_flash._combine_splits", "fp8_gemm._sum_splits"} <= found
    assert not {"_flash.dot", "_flash.softmax_step", "_flash.normalise", "fp8_gemm._e4m3_bits_to_f32",
                "moe._w_tile"} & found


def test_a_kernel_no_case_launches_fails(monkeypatch):
    """Coverage is per launched kernel, not per file: a split kernel no case reaches is reported."""
    monkeypatch.setattr(aot, "_cases", lambda: [])
    results = aot.run(archs=("sm_90",), only={"fp8_gemm"})
    assert {(r.kernel, r.status) for r in results} == {("fp8_gemm._fp8_gemm_fwd", "failed"),
                                                      ("fp8_gemm._sum_splits", "failed")}

