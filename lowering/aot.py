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
    for name in kernel_modules() + SHARED_MODULES:
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


# ---- representative launches: (kernel module, case, call(arch)), from each kernel file's
# declaration (kernels/spec.py: KernelSpec.aot_cases) --------------------------------------------

def kernel_modules() -> tuple[str, ...]:
    """The Triton kernel files, by their declarations."""
    from metainfer.kernels import spec

    return tuple(k.name for k in spec.kernel_specs())


def _cases() -> list[tuple[str, str, Callable[[str], Any]]]:
    from metainfer.kernels import spec

    return [(k.name, case, call) for k in spec.kernel_specs() for case, call in k.aot_cases()]


def _autotune_cases() -> list[tuple[str, str, Callable[[str], Any]]]:
    """Every AUTOTUNE alternative of the kernels that have them (attention, fp8_gemm), each
    launched as a fixed config."""
    from metainfer.kernels import spec

    return [(k.name, case, call) for k in spec.kernel_specs() if k.aot_autotune_cases
            for case, call in k.aot_autotune_cases()]


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
    ap.add_argument("--kernel", nargs="+", choices=kernel_modules(), help="only these kernel files")
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
