"""Every metainfer Triton kernel compiled for NVIDIA GPUs ahead of time, on a machine without one.

Triton's own compiler (TTIR -> TTGIR -> LLVM IR -> PTX -> ptxas cubin) runs for a GPUTarget
without a device. Each kernel's launcher is called on small CPU tensors with the launch
config of the architecture (kernels/configs.py); the launch is recorded instead of run,
and the recorded arguments (types, constexprs, num_warps / num_stages) are compiled for each
architecture. A kernel fails when Triton or ptxas rejects it, or when it needs more shared
memory per block than the architecture has, or more registers per block (registers per thread
from the cubin's .nv.info, allocated in units of 8, x its threads) than the 64 K a block may
use; a launcher that refuses an architecture with a KernelInputError (FP8 weights before sm_89)
is reported as refused, not failed.

    TRITON_INTERPRET=0 python -m metainfer.lowering.aot [--arch sm_80 sm_89 sm_90] [--json FILE] [--autotune]

The launchers run their config row's one fixed config here (triton.autotune is for a live GPU);
`--autotune` adds, for attention and fp8_gemm, every AUTOTUNE alternative of each row as a
fixed config, so the candidates a GPU will time are known to compile and fit.

It must run with Triton's interpreter off (kernels decorated as GPU kernels): on a CPU build
of torch `import metainfer` turns the interpreter on unless TRITON_INTERPRET is already set.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import inspect
import json
import os
import sys
import time
from typing import Any, Callable

# cc and the most shared memory one block may use (bytes, opt-in), per the CUDA C Programming
# Guide's "Technical Specifications per Compute Capability": A100 163 KB, Ada 99 KB, H100 227 KB.
ARCHS = {"sm_80": (80, 163 * 1024), "sm_89": (89, 99 * 1024), "sm_90": (90, 227 * 1024)}
# 32-bit registers one block may use on all three (the same table): 64 K
REGISTERS_PER_BLOCK = 64 * 1024

KERNEL_MODULES = ("attention", "rmsnorm", "glu", "rope", "token_ids", "paged_attention", "fp8_gemm", "int4_gemm",
                  "moe", "sparse_attention", "mla_decode")
# kernels shared by several launchers (the merge of key splits), launched from their own module
SHARED_MODULES = ("_flash",)


@dataclasses.dataclass
class Launch:
    kernel: str  # module.function
    fn: Any  # the JITFunction
    args: tuple
    kwargs: dict


@dataclasses.dataclass
class Result:
    kernel: str
    case: str
    arch: str
    status: str  # "ok", "failed", "refused"
    shared_bytes: int | None = None
    seconds: float = 0.0
    detail: str = ""
    registers: int | None = None  # per thread, from the cubin
    stack_bytes: int | None = None  # per-thread stack frame (spilled registers and local arrays)


def launched_kernels() -> dict[str, Any]:
    """module.function -> JITFunction for every kernel a launcher starts (`name[grid](...)` in its
    module), not the @triton.jit helpers kernels call."""
    from triton.runtime.jit import KernelInterface

    found = {}
    for name in KERNEL_MODULES + SHARED_MODULES:
        module = importlib.import_module(f"metainfer.kernels.{name}")
        source = inspect.getsource(module)
        for attr, value in vars(module).items():
            # a JITFunction, or an InterpretedFunction under the interpreter
            if isinstance(value, KernelInterface) and f"{attr}[" in source:
                found[f"{name}.{attr}"] = value
    return found


@contextlib.contextmanager
def _recording(cc: int, names_only: bool = False):
    """Launches are recorded, not run; launchers that ask for the GPU's capability get `cc`'s.
    `names_only`: record each launch's kernel name alone (bench/launch_overhead.py times the
    launchers around it, so the stub itself should cost next to nothing)."""
    from metainfer.kernels import _common

    launches: list = []
    kernels = launched_kernels()
    saved = []
    for qualified, fn in kernels.items():
        module = importlib.import_module(f"metainfer.kernels.{qualified.split('.')[0]}")

        class _Recorder:
            def __init__(self, qualified=qualified, fn=fn):
                self.qualified, self.fn = qualified, fn

            def __getitem__(self, grid):
                return self.name if names_only else self.record

            def record(self, *args, **kwargs):
                launches.append(Launch(self.qualified, self.fn, args, kwargs))

            def name(self, *args, **kwargs):
                launches.append(self.qualified)

        saved.append((module, qualified.split(".")[1], fn))
        setattr(module, qualified.split(".")[1], _Recorder())
    previous = _common.AOT_CAPABILITY
    _common.AOT_CAPABILITY = divmod(cc, 10)
    try:
        yield launches
    finally:
        _common.AOT_CAPABILITY = previous
        for module, attr, fn in saved:
            setattr(module, attr, fn)


def _runtime_specialisation(launch: Launch, arch: str):
    """(source, options) of a recorded launch exactly as Triton's JIT would build them on `arch`.

    The runtime binds the arguments with the backend's specialisation: a pointer whose address
    is a multiple of 16 and an integer that is one are marked `tt.divisibility=16`, an integer
    equal to 1 becomes a constant (a unit stride), and those change the code (vectorised loads,
    pipelined copies) and the shared memory it asks for. Recording the CPU tensors' addresses
    gives the same marks a GPU allocation (256 B aligned) would, and views keep their offsets.
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    cc, _ = ARCHS[arch]
    target = GPUTarget("cuda", cc, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(launch.fn.signature, launch.fn.params, backend)
    bound, specialisation, kwargs = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = launch.fn._pack_args(backend, kwargs, bound, specialisation, kwargs)
    return ASTSource(launch.fn, signature, constexprs, attrs), target, options


def compile_launch(launch: Launch, arch: str, specialised=None):
    """triton.compile of one recorded launch for `arch`, specialised as the runtime would
    (`specialised`: `_runtime_specialisation`'s result, if already made): the CompiledKernel."""
    import triton

    source, target, options = specialised or _runtime_specialisation(launch, arch)
    return triton.compile(source, target=target, options=options.__dict__)


def cubin_resources(cubin: bytes, kernel: str) -> tuple[int | None, int | None]:
    """(registers per thread, stack frame bytes per thread) of `kernel` in a cubin: ptxas writes
    them to the ELF's .nv.info section as EIATTR_REGCOUNT (0x2f) and EIATTR_FRAME_SIZE (0x11)
    records of (symbol index, value). The driver reads the same records when it loads the cubin."""
    import struct

    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names_at = headers[shstrndx][4]

    def name(h):
        start = names_at + h[0]
        return cubin[start:cubin.index(b"\0", start)].decode()

    sections = {name(h): (h[4], h[5], h[6]) for h in headers}  # offset, size, link
    # the kernel's symbol index, for the records that name it
    symtab = next((v for k, v in sections.items() if k == ".symtab"), None)
    index = None
    if symtab is not None:
        strtab_off = headers[symtab[2]][4]
        for i in range(symtab[1] // 24):
            st_name, = struct.unpack_from("<I", cubin, symtab[0] + 24 * i)
            start = strtab_off + st_name
            if cubin[start:cubin.index(b"\0", start)].decode() == kernel:
                index = i
    found = {}
    offset, size, _ = sections.get(".nv.info", (0, 0, 0))
    i = offset
    while i + 4 <= offset + size:
        fmt, attr = cubin[i], cubin[i + 1]
        if fmt == 4:  # a record with a payload: 2-byte size, then the payload
            length, = struct.unpack_from("<H", cubin, i + 2)
            if attr in (0x2F, 0x11) and length == 8:
                sym, value = struct.unpack_from("<II", cubin, i + 4)
                if index is None or sym == index:
                    found[attr] = value
            i += 4 + length
        else:
            i += 4
    return found.get(0x2F), found.get(0x11)


def _key(launch: Launch, arch: str, specialised) -> str:
    source, _, options = specialised
    return repr((arch, launch.kernel, source.signature, source.constants, source.attrs, options.__dict__))


# ---- representative launches: (kernel module, case, call(arch)) ---------------------------------

def _cases() -> list[tuple[str, str, Callable[[str], Any]]]:
    import torch

    from metainfer.kernels import attention, fp8_gemm, int4_gemm, mla_decode, moe, paged_attention, rmsnorm, rope, \
        sparse_attention, glu, token_ids
    from metainfer.kernels.configs import config_for_arch

    bf16, f32, e4m3 = torch.bfloat16, torch.float32, torch.float8_e4m3fn
    g = torch.Generator().manual_seed(0)

    def randn(*shape, dtype=bf16):
        return torch.randn(*shape, generator=g).to(dtype)

    def attn(d, dtype, causal, mask, softcap=0.0, window=0):
        def call(arch):
            q, k, v = randn(1, 8, 64, d, dtype=dtype), randn(1, 2, 64, d, dtype=dtype), randn(1, 2, 64, d, dtype=dtype)
            m = (randn(1, 1, 64, 64, dtype=dtype) if mask == "additive"
                 else torch.rand(1, 1, 64, 64, generator=g) > 0.2 if mask == "bool" else None)
            cfg = config_for_arch("attention", arch, head_dim=d, dtype=dtype)
            attention.launch(q, k, v, m, d ** -0.5, causal, 0, softcap=softcap, window=window, config=cfg)
        return call

    def paged(decode, key_index=True, window=0, softcap=0.0):
        def call(arch):
            lens_q, lens_k = ([1, 1, 1], [700, 90, 1500]) if decode else ([37, 5, 64], [37, 300, 64])
            kp, vp = randn(4096, 2, 128), randn(4096, 2, 128)
            cu_q = torch.tensor([0] + lens_q).cumsum(0).to(torch.int32)
            cu_k = torch.tensor([0] + lens_k).cumsum(0).to(torch.int32)
            ki = torch.randperm(4096, generator=g)[:sum(lens_k)].to(torch.int32) if key_index else None
            paged_attention.launch(randn(sum(lens_q), 8, 128), kp, vp, ki, cu_q, cu_k, max(lens_q), max(lens_k),
                                   128 ** -0.5, window, softcap, config=config_for_arch("paged_attention", arch))
        return call

    def attn_decode(d):
        def call(arch):  # batch 1: 8 (batch x head) programs, far below any GPU's SMs
            q, k, v = randn(1, 8, 1, d), randn(1, 2, 4096, d), randn(1, 2, 4096, d)
            cfg = config_for_arch("attention", arch, head_dim=d, dtype=bf16)
            attention.launch(q, k, v, None, d ** -0.5, True, 4095, config=cfg)
        return call

    def gemm(m, act_quant, bias=False, k=1024, block_k=128, block_n=128):
        def call(arch):
            n = 512
            fp8_gemm.launch(randn(m, k), randn(n, k, dtype=e4m3),
                            torch.rand(-(-n // block_n), -(-k // block_k), generator=g), randn(n) if bias else None,
                            block_n, block_k, act_quant, config=config_for_arch("fp8_gemm", arch))
        return call

    def int4(m, group=128, zeros=True, act_order=False, bias=False, k=1024):
        def call(arch):
            n = 512
            qweight = torch.randint(-2**31, 2**31 - 1, (n, k // 8), generator=g, dtype=torch.int64).to(torch.int32)
            scales = torch.rand(n, k // group, generator=g).to(torch.float16)
            z = torch.randint(0, 16, (n, k // group), generator=g).to(torch.uint8) if zeros else None
            perm = torch.randperm(k, generator=g).to(torch.int32) if act_order else None
            int4_gemm.launch(randn(m, k, dtype=torch.float16), qweight, scales, z, perm, randn(n) if bias else None,
                             group, config=config_for_arch("int4_gemm", arch))
        return call

    def experts(fp8, T):  # T x K pairs above GEMV_MAX_PAIRS: the sort and the tile kernels; below: decode's two
        def call(arch):
            E, K, H, I = 8, 2, 256, 256
            ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
            w = (lambda *s: randn(*s, dtype=e4m3)) if fp8 else randn
            s = (lambda *s: torch.rand(*s, generator=g)) if fp8 else (lambda *s: None)
            moe.launch(randn(T, H), ids, torch.rand(T, K, generator=g), w(E, I, H), w(E, I, H), w(E, H, I),
                       s(E, I // 128, H // 128), s(E, I // 128, H // 128), s(E, H // 128, I // 128),
                       config=config_for_arch("moe", arch))
        return call

    def sparse(mask=None, fill=None):
        def call(arch):
            q, k, v = randn(1, 16, 8, 128), randn(1, 1, 256, 128), randn(1, 1, 256, 128)
            idx = torch.randint(0, 256, (1, 8, 64), generator=g, dtype=torch.int32)
            m = randn(1, 1, 8, 256) if mask == "additive" else None
            out = sparse_attention.launch(q, k, v, idx, m, 128 ** -0.5, True, 248,
                                          config=config_for_arch("sparse_attention", arch))
            if fill is not None:
                sparse_attention.launch_unselected_rows(out, q, k, v, idx, m, 128 ** -0.5, True, 248, fill)
        return call

    def mla(sparse_indices, Sq=2, T=300, topk=64, R=512, mask=None):
        def call(arch):
            B, H, P = 1, 16, 64
            idx = torch.randint(0, T, (B, Sq, topk), generator=g, dtype=torch.int32) if sparse_indices else None
            m = (randn(B, 1, Sq, T) if mask == "additive"
                 else torch.rand(B, 1, Sq, T, generator=g) > 0.2 if mask == "bool" else None)
            mla_decode.launch(randn(B, H, Sq, R), randn(B, H, Sq, P), randn(B, T, R), randn(B, T, P), idx, m,
                              (R + P) ** -0.5, m is None, T - Sq, config=config_for_arch("mla_decode", arch))
        return call

    return [
        ("attention", "bf16 d64 causal", attn(64, bf16, True, False)),
        ("attention", "bf16 d128 causal", attn(128, bf16, True, False)),
        ("attention", "bf16 d128 additive mask", attn(128, bf16, False, "additive")),
        ("attention", "bf16 d128 bool mask", attn(128, bf16, False, "bool")),
        ("attention", "bf16 d256 softcap 50, window 32", attn(256, bf16, True, None, softcap=50.0, window=32)),
        ("attention", "fp32 d64 causal", attn(64, f32, True, None)),
        ("attention", "fp32 d128 causal", attn(128, f32, True, None)),
        ("attention", "fp32 d192 causal", attn(192, f32, True, None)),
        ("attention", "fp32 d256 causal", attn(256, f32, True, None)),
        ("attention", "bf16 d256 causal", attn(256, bf16, True, None)),
        ("attention", "bf16 d128 decode, key splits", attn_decode(128)),
        ("paged_attention", "bf16 d128 prefill chunks", paged(False)),
        ("paged_attention", "bf16 d128 decode, key splits", paged(True)),
        ("paged_attention", "bf16 d128 keys in pool order (no key index)", paged(False, key_index=False)),
        ("paged_attention", "bf16 d128 decode, window 512, softcap 30", paged(True, window=512, softcap=30.0)),
        ("rmsnorm", "bf16 4096 + residual",
         lambda arch: rmsnorm.launch(randn(8, 4096), randn(4096), 1e-6, 0.0, bf16, residual=randn(8, 4096),
                                     config=config_for_arch("rmsnorm", arch))),
        ("glu", "silu, bf16 8 x 11008",
         lambda arch: glu.launch(randn(8, 11008), randn(8, 11008), config=config_for_arch("glu", arch))),
        ("glu", "gelu_tanh, bf16 8 x 16384",
         lambda arch: glu.launch(randn(8, 16384), randn(8, 16384), config=config_for_arch("glu", arch),
                                 activation="gelu_tanh")),
        ("rope", "bf16 d128",
         lambda arch: rope.launch(randn(1, 8, 16, 128), randn(1, 1, 16, 128), randn(1, 1, 16, 128),
                                  config=config_for_arch("rope", arch))),
        ("token_ids", "int64 ids",
         lambda arch: token_ids.launch(torch.randint(0, 100, (2, 64), generator=g), 100,
                                       config=config_for_arch("token_ids", arch))),
        ("fp8_gemm", "decode m=4, bf16 activations, split-K", gemm(4, False)),
        ("fp8_gemm", "decode m=24, fp8 activations, split-K", gemm(24, True)),
        ("fp8_gemm", "prefill m=512, fp8 activations", gemm(512, True)),
        ("fp8_gemm", "prefill m=512, bf16 activations, bias", gemm(512, False, bias=True)),
        ("fp8_gemm", "m=64, fp8 activations, K=16 (one small tile)", gemm(64, True, k=16, block_k=16)),
        ("fp8_gemm", "m=64, fp8 activations, scale blocks of 16", gemm(64, True, block_k=16)),
        ("fp8_gemm", "decode m=8, per-channel scales, split-K", gemm(8, False, block_n=1, block_k=1024)),
        ("fp8_gemm", "prefill m=512, per-channel scales, per-token fp8 activations",
         gemm(512, True, block_n=1, block_k=1024)),
        ("int4_gemm", "decode m=1, fp16, group 128, zero points (GEMV)", int4(1)),
        ("int4_gemm", "decode m=8, fp16, act-order, symmetric (GEMV)", int4(8, zeros=False, act_order=True)),
        ("int4_gemm", "prefill m=512, fp16, group 128, zero points, bias", int4(512, bias=True)),
        ("int4_gemm", "prefill m=512, fp16, group 32, act-order", int4(512, group=32, act_order=True)),
        ("moe", "bf16 experts", experts(False, 64)),
        ("moe", "fp8 experts", experts(True, 64)),
        ("moe", "bf16 experts, decode (matrix-vector)", experts(False, 4)),
        ("moe", "fp8 experts, decode (matrix-vector)", experts(True, 4)),
        ("sparse_attention", "bf16 d128 top-64", sparse()),
        ("sparse_attention", "bf16 d128 top-64, additive mask, unselected keys filled",
         sparse("additive", float(torch.finfo(f32).min))),
        ("sparse_attention", "bf16 d128 top-64, unselected keys filled", sparse(None, -1e9)),
        ("mla_decode", "bf16 dense", mla(False)),
        ("mla_decode", "bf16 sparse top-64", mla(True)),
        ("mla_decode", "bf16 dense decode, key splits", mla(False, Sq=1, T=4096)),
        ("mla_decode", "bf16 sparse top-2048 decode, key splits", mla(True, Sq=1, T=4096, topk=2048)),
        ("mla_decode", "bf16 R=1024 dense", mla(False, R=1024)),
        ("mla_decode", "bf16 R=1024 decode, key splits", mla(False, Sq=1, T=4096, R=1024)),
        ("mla_decode", "bf16 additive mask", mla(False, mask="additive")),
        ("mla_decode", "bf16 sparse top-64, bool mask", mla(True, mask="bool")),
    ]


def _autotune_cases() -> list[tuple[str, str, Callable[[str], Any]]]:
    """Every AUTOTUNE alternative of the attention and fp8_gemm rows, launched as a fixed config:
    prefill- and decode-sized problems per attention head-dim row, each fp8_gemm M row."""
    import torch

    from metainfer.kernels import attention, fp8_gemm
    from metainfer.kernels.configs import config_for_arch

    bf16 = torch.bfloat16
    g = torch.Generator().manual_seed(0)

    def randn(*shape, dtype=bf16):
        return torch.randn(*shape, generator=g).to(dtype)

    def attn(d, sq, sk, dtype=bf16):
        def call(arch):
            row = config_for_arch("attention", arch, head_dim=d, dtype=dtype)
            q, k, v = randn(1, 8, sq, d, dtype=dtype), randn(1, 2, sk, d, dtype=dtype), randn(1, 2, sk, d, dtype=dtype)
            for alt in ({}, *row.get("AUTOTUNE", ())):
                attention.launch(q, k, v, None, d ** -0.5, True, sk - sq, config={**row, **alt})
        return call

    def gemm(m):
        def call(arch):
            gpu = config_for_arch("fp8_gemm", arch)
            row, _ = fp8_gemm._row_for_m(gpu, m)
            x, w = randn(m, 1024), randn(512, 1024, dtype=torch.float8_e4m3fn)
            for alt in ({}, *row.get("AUTOTUNE", ())):
                fp8_gemm.launch(x, w, torch.rand(4, 8, generator=g), None, 128, 128, False,
                                config={**row, **alt, "SMALL_M": ()})
        return call

    cases = []
    for d in (64, 128, 256):  # 256 query rows: no candidate's 128-row tile is clamped
        cases.append(("attention", f"autotune d{d} prefill", attn(d, 256, 256)))
        cases.append(("attention", f"autotune d{d} decode", attn(d, 1, 4096)))
    for d in (64, 128, 256):  # float32 heads take the rows of bf16 heads twice as wide
        cases.append(("attention", f"autotune fp32 d{d} prefill", attn(d, 256, 256, torch.float32)))
    for m in (4, 24, 48, 512):
        cases.append(("fp8_gemm", f"autotune m={m}", gemm(m)))
    return cases


def _blocks(launch: Launch) -> str:
    """The launch's tile and pipeline, e.g. '128x64x- w8 s3'."""
    kw = launch.kwargs
    tile = "x".join(str(kw.get(k, "-")) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K"))
    return f"{tile} w{kw.get('num_warps', '-')} s{kw.get('num_stages', '-')}"


def run(archs=tuple(ARCHS), only: set[str] | None = None, progress: Callable[[Result], None] | None = None,
        autotune: bool = False) -> list[Result]:
    """Record every case's launches for each arch and compile them; one Result per kernel launch.
    A kernel no case launched (on any arch) is a failure: it was never compiled."""
    from metainfer.kernels import KernelInputError

    cases = _cases() + (_autotune_cases() if autotune else [])
    results: list[Result] = []
    launched: set[str] = set()
    compiled: dict[str, Any] = {}  # same arguments on the same arch: compiled once
    for arch in archs:
        cc, shared_limit = ARCHS[arch]
        for module, case, call in cases:
            if only and module not in only:
                continue
            with _recording(cc) as launches:
                try:
                    call(arch)
                except KernelInputError as e:
                    results.append(Result(module, case, arch, "refused", detail=str(e)))
                    continue
            for launch in launches:
                launched.add(launch.kernel)
                label = f"{case} {_blocks(launch)}" if case.startswith("autotune") else case
                t0 = time.perf_counter()
                try:
                    specialised = _runtime_specialisation(launch, arch)
                    key = _key(launch, arch, specialised)
                    kernel = compiled.get(key) or compiled.setdefault(key, compile_launch(launch, arch, specialised))
                except Exception as e:  # noqa: BLE001 - every compiler error is this tool's finding
                    r = Result(launch.kernel, label, arch, "failed", seconds=time.perf_counter() - t0,
                               detail=f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300] if str(e).strip() else ''}")
                else:
                    shared = int(kernel.metadata.shared)
                    regs, stack = cubin_resources(kernel.asm["cubin"], kernel.metadata.name)
                    threads = kernel.metadata.num_warps * 32
                    problems = []
                    if shared > shared_limit:
                        problems.append(f"needs {shared} B of shared memory per block, {arch} has {shared_limit}")
                    if regs is not None and -(-regs // 8) * 8 * threads > REGISTERS_PER_BLOCK:
                        problems.append(f"needs {regs} registers x {threads} threads, a block may have "
                                        f"{REGISTERS_PER_BLOCK}")
                    r = Result(launch.kernel, label, arch, "failed" if problems else "ok", shared,
                               time.perf_counter() - t0, "; ".join(problems), regs, stack)
                results.append(r)
                if progress:
                    progress(r)
    in_scope = [k for k in launched_kernels() if only is None or k.split(".")[0] in only]
    results += [Result(k, "-", "-", "failed", detail="no ahead-of-time case launches it")
                for k in sorted(set(in_scope) - launched)]
    return results


def table(results: list[Result]) -> str:
    rows = [("kernel", "case", "arch", "status", "shared KiB", "regs", "stack B", "s", "detail")]
    for r in results:
        rows.append((r.kernel, r.case, r.arch, r.status, "-" if r.shared_bytes is None else f"{r.shared_bytes / 1024:.1f}",
                     "-" if r.registers is None else str(r.registers),
                     "-" if r.stack_bytes is None else str(r.stack_bytes), f"{r.seconds:.1f}", r.detail))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row[:-1], widths)) + "  " + row[-1] for row in rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Compile every metainfer Triton kernel for NVIDIA GPUs, no GPU needed.")
    ap.add_argument("--arch", nargs="+", choices=tuple(ARCHS), default=tuple(ARCHS))
    ap.add_argument("--kernel", nargs="+", choices=KERNEL_MODULES, help="only these kernel files")
    ap.add_argument("--json", metavar="FILE", help="write the results here ('-': standard output)")
    ap.add_argument("--autotune", action="store_true",
                    help="also compile every AUTOTUNE alternative of the attention and fp8_gemm rows")
    a = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") not in (None, "0"):
        print("TRITON_INTERPRET is on: kernels are interpreted functions and cannot be compiled for a GPU; "
              "run with TRITON_INTERPRET=0", file=sys.stderr)
        return 2
    os.environ["TRITON_INTERPRET"] = "0"  # before metainfer decides for a CPU build
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # what launches get today; silences 3.9's notice
    t0 = time.perf_counter()
    results = run(a.arch, set(a.kernel) if a.kernel else None,
                  progress=lambda r: print(f"{r.arch} {r.kernel} ({r.case}): {r.status} {r.detail}", file=sys.stderr,
                                           flush=True), autotune=a.autotune)
    print(table(results))
    failed = [r for r in results if r.status == "failed"]
    print(f"{len(results)} launches, {len(failed)} failed, "
          f"{sum(r.status == 'refused' for r in results)} refused, {time.perf_counter() - t0:.0f} s")
    if a.json:
        text = json.dumps([dataclasses.asdict(r) for r in results], indent=1)
        if a.json == "-":
            print(text)
        else:
            with open(a.json, "w") as f:
                f.write(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
