"""Collectives through shared memory for ranks on one host: `metainfer::shm_all_reduce`,
`shm_all_gather`, `shm_reduce_scatter`, the path select_collectives may pick instead of the
process group's library (gloo's TCP loopback, the only transport torch 2.13's gloo has) for
CPU ranks.

The work is in shm_collectives.c (copy into this rank's slot, barrier, read every slot; fixed
rank order, fp32 sums for 16-bit floats: every rank gets the same bits). It is compiled with
the system C compiler on first use into <cache>/shm_collectives/ ($METAINFER_CACHE_DIR or
~/.cache/metainfer) and called through ctypes, which releases the GIL for the call.

One segment per process group: `attach(group_name)` is collective over the group. Its first
rank creates /dev/shm/metainfer-<pid>-<random> (space reserved with posix_fallocate, so a full
/dev/shm is an error here and not a SIGBUS later), maps it and unlinks the name at once, keeping
its descriptor; the others open it through /proc/<pid>/fd/<fd>; once the ranks agree that all
of them mapped it the descriptor is closed. The segment lives only as long as the processes
that map it: nothing is left behind, whenever a rank dies. A rank waiting at a barrier notices a peer that died (its pid gone), a peer that
gave up (the abort word) or the group's timeout, and raises naming that rank and the step.
"""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import secrets
import shutil
import subprocess
import sys
import threading
import weakref
from pathlib import Path

import torch
from torch import Tensor

from . import spec

SOURCE = Path(__file__).with_name("shm_collectives.c")
SHM_DIR = Path("/dev/shm")
DATA_OFFSET = 4096  # as in the C file
SLOT_BYTES = 4 << 20  # per rank and parity: messages are cut into pieces of this size
MIN_SLOT_BYTES = 64 << 10
MAX_WORLD = 63  # rank lines that fit the header page (the C file's MAX_WORLD)
DEFAULT_TIMEOUT_S = 300.0
_DTYPES = {torch.float32: 0, torch.float64: 1, torch.bfloat16: 2, torch.float16: 3, torch.int32: 4, torch.int64: 5}
DTYPES = tuple(_DTYPES)
_ERRORS = {1: "timed out waiting for", 2: "lost", 3: "was stopped by", 4: "does not match", 5: "bad arguments"}


class ShmUnavailable(RuntimeError):
    """The shared-memory path cannot run for this group (said why)."""


class ShmCollectiveError(RuntimeError):
    """A shared-memory collective failed: a peer died, gave up, timed out or entered another one."""


# ---- the compiled library -----------------------------------------------------------------

_lib: "ctypes.CDLL | None" = None
_lib_error: "str | None" = None
_lib_lock = threading.Lock()


def _cache_root() -> Path:
    d = os.environ.get("METAINFER_CACHE_DIR")
    return (Path(d).expanduser() if d else Path.home() / ".cache" / "metainfer") / "shm_collectives"


def _compile() -> Path:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise ShmUnavailable("no C compiler (cc, gcc or clang; or $CC) to build shm_collectives.c")
    flags = ["-O3", "-shared", "-fPIC", "-std=gnu11"]
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join([cc, *flags, sys.platform]).encode()).hexdigest()[:16]
    root = _cache_root()
    out = root / f"shm_collectives-{key}.so"
    if out.exists():
        return out
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{out.name}.{os.getpid()}.{secrets.token_hex(4)}"
    run = subprocess.run([cc, *flags, "-o", str(tmp), str(SOURCE)], capture_output=True, text=True, timeout=120)
    if run.returncode:
        tmp.unlink(missing_ok=True)
        raise ShmUnavailable(f"{cc} could not build {SOURCE.name}: {run.stderr.strip()[:500]}")
    os.replace(tmp, out)  # atomic: ranks building at once each install a whole file
    return out


def library() -> ctypes.CDLL:
    """The compiled C library (built on first use; ShmUnavailable if it cannot be)."""
    global _lib, _lib_error
    with _lib_lock:
        if _lib is None and _lib_error is None:
            try:
                lib = ctypes.CDLL(str(_compile()))
            except (ShmUnavailable, OSError, subprocess.SubprocessError) as e:
                _lib_error = str(e)
            else:
                _declare(lib)
                _lib = lib
    if _lib is None:
        raise ShmUnavailable(_lib_error)
    return _lib


def _declare(lib: ctypes.CDLL) -> None:
    p, i, u64, d = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_double
    for name, res, args in (("mi_init_header", i, (p, i, u64)), ("mi_open", p, (p, i, i, u64, d)),
                            ("mi_close", None, (p,)), ("mi_missing", i, (p,)), ("mi_pid", ctypes.c_int64, (p, i)),
                            ("mi_abort", None, (p,)), ("mi_posted", u64, (p, i, i)), ("mi_barrier", i, (p,)),
                            ("mi_all_reduce", i, (p, p, p, u64, i)), ("mi_all_gather", i, (p, p, p, u64)),
                            ("mi_reduce_scatter", i, (p, p, p, u64, i)), ("mi_broadcast", i, (p, p, u64, i))):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, list(args)


def unavailable_reason() -> str | None:
    """Why this process cannot use the path (None: it can): Linux with a writable /dev/shm and
    a C compiler."""
    if not sys.platform.startswith("linux"):
        return f"shared-memory collectives are implemented for Linux, not {sys.platform}"
    if not (SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)):
        return f"{SHM_DIR} is not a writable directory"
    try:
        library()
    except ShmUnavailable as e:
        return str(e)
    return None


# ---- one segment per process group --------------------------------------------------------

def _segment_bytes(world: int, slot_bytes: int) -> int:
    return DATA_OFFSET + 2 * world * slot_bytes


def slot_bytes_for(world: int, free_bytes: int) -> int:
    """SLOT_BYTES, or less so that the segment takes at most half of /dev/shm's free space
    (a container's /dev/shm is often 64 MiB); 0 if even MIN_SLOT_BYTES does not fit."""
    slot = SLOT_BYTES
    while slot >= MIN_SLOT_BYTES:
        if 2 * _segment_bytes(world, slot) <= free_bytes:
            return slot
        slot //= 2
    return 0


class _Mapping:
    """The segment mapped into this process. The creating rank unlinks the name as soon as it
    has mapped it and keeps its descriptor open until the peers have opened theirs through
    /proc/<pid>/fd/<fd>: no name outlives the few microseconds of its creation, so no rank's
    death at any point can leave a file in /dev/shm."""

    def __init__(self, path: Path, size: int, create: bool):
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        self.fd = None
        try:
            if create:
                os.unlink(path)  # the descriptor keeps it; the peers open /proc/<pid>/fd/<fd>
                os.posix_fallocate(fd, 0, size)  # ENOSPC now rather than SIGBUS on first touch
            elif os.fstat(fd).st_size != size:
                raise OSError(f"{path} has {os.fstat(fd).st_size} bytes, expected {size}")
            self.mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        if create:
            self.fd = fd
        else:
            os.close(fd)
        self._anchor = ctypes.c_char.from_buffer(self.mm)
        self.address = ctypes.addressof(self._anchor)

    @property
    def shared_path(self) -> str:
        return f"/proc/{os.getpid()}/fd/{self.fd}"

    def release_descriptor(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def close(self) -> None:
        self.release_descriptor()
        self._anchor = None
        try:
            self.mm.close()
        except BufferError:  # a view still exported: the OS unmaps it at exit
            pass


def _timeout_s(pg) -> float:
    try:
        return pg._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except Exception:  # noqa: BLE001 - a backend without options: the project's default
        return DEFAULT_TIMEOUT_S


def _resolve(group_name: str):
    import torch.distributed as dist

    return dist.distributed_c10d._resolve_process_group(group_name)


class Communicator:
    """This rank's handle on a group's segment; `attach` makes one."""

    def __init__(self, pg, group_name: str, mapping: _Mapping, slot_bytes: int, timeout_s: float):
        import torch.distributed as dist

        self.group_name = group_name
        self.members = tuple(dist.get_process_group_ranks(pg))
        self.rank, self.world = pg.rank(), pg.size()
        self.slot_bytes, self.timeout_s = slot_bytes, timeout_s
        self._pg = weakref.ref(pg)
        self._map = mapping
        self._lib = library()
        self._comm = self._lib.mi_open(mapping.address, self.rank, self.world, slot_bytes, timeout_s)
        if not self._comm:
            raise ShmUnavailable(f"the segment of group {group_name!r} has another header than this rank expects")
        self.steps = 0  # collectives done: the step an error names
        self.failed: str | None = None  # the error that ended this group's path (it stays ended)
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, Communicator._release, self._lib, self._comm, mapping)

    @staticmethod
    def _release(lib, comm, mapping) -> None:
        lib.mi_close(comm)
        mapping.close()

    def belongs_to(self, pg) -> bool:
        return self._pg() is pg

    def close(self) -> None:
        self._finalizer()

    def _ready(self, what: str) -> None:
        if self.failed is not None:
            raise ShmCollectiveError(f"shm {what} (group {self.group_name!r}): the group's shared-memory path failed "
                                     f"earlier: {self.failed}")
        if os.getpid() != self._pid:
            raise ShmCollectiveError(f"shm {what} (group {self.group_name!r}): this process was forked from the rank "
                                     "that attached the segment; attach in the rank itself")

    def _done(self, rc: int, what: str) -> None:
        self.steps += 1
        if rc == 0:
            return
        missing = self._lib.mi_missing(self._comm)
        peer = self.members[missing] if 0 <= missing < self.world else missing
        where = f"shm {what} (group {self.group_name!r}, step {self.steps}) on rank {self.members[self.rank]}"
        if rc == 2:
            why = f"rank {peer} (pid {self._lib.mi_pid(self._comm, missing)}) exited before reaching it"
        elif rc == 1:
            why = f"rank {peer} did not reach it within the group's timeout of {self.timeout_s:g} s"
        elif rc == 3:
            why = f"rank {peer} gave up on the group"
        elif rc == 4:
            kind, nbytes = self._lib.mi_posted(self._comm, missing, 0), self._lib.mi_posted(self._comm, missing, 1)
            mine = self._lib.mi_posted(self._comm, self.rank, 0), self._lib.mi_posted(self._comm, self.rank, 1)
            why = (f"rank {peer} entered another collective ({_describe(kind, nbytes)}) than this rank "
                   f"({_describe(*mine)})")
        else:
            raise ValueError(f"shm {what}: bad arguments")
        self._lib.mi_abort(self._comm)  # the others stop waiting for this rank
        self.failed = f"{where}: {why}"
        raise ShmCollectiveError(self.failed)

    def all_reduce(self, x: Tensor) -> Tensor:
        x = _checked(x, "all_reduce")
        out = torch.empty_like(x)
        with self._lock:
            self._ready("all_reduce")
            rc = self._lib.mi_all_reduce(self._comm, x.data_ptr(), out.data_ptr(), x.numel() * x.element_size(),
                                         _DTYPES[x.dtype])
            self._done(rc, "all_reduce")
        return out

    def all_gather(self, x: Tensor) -> Tensor:
        x = _checked(x, "all_gather", reduce=False)
        out = x.new_empty((self.world * x.shape[0], *x.shape[1:]) if x.dim() else (self.world,))
        with self._lock:
            self._ready("all_gather")
            rc = self._lib.mi_all_gather(self._comm, x.data_ptr(), out.data_ptr(), x.numel() * x.element_size())
            self._done(rc, "all_gather")
        return out

    def reduce_scatter(self, x: Tensor) -> Tensor:
        x = _checked(x, "reduce_scatter")
        if x.dim() == 0 or x.shape[0] % self.world:
            raise ValueError(f"shm reduce_scatter: dim 0 ({tuple(x.shape)}) must divide by the group's "
                             f"{self.world} ranks")
        out = x.new_empty((x.shape[0] // self.world, *x.shape[1:]))
        with self._lock:
            self._ready("reduce_scatter")
            rc = self._lib.mi_reduce_scatter(self._comm, x.data_ptr(), out.data_ptr(),
                                             out.numel() * out.element_size(), _DTYPES[x.dtype])
            self._done(rc, "reduce_scatter")
        return out

    def broadcast_bytes(self, data: bytes | None, nbytes: int, root: int = 0) -> bytes:
        """`root`'s `data` (exactly `nbytes`; None on the other members) on every member of the
        group; `root` and `nbytes` are the same on every member."""
        buf = ctypes.create_string_buffer(max(1, nbytes))
        if self.rank == root:
            if data is None or len(data) != nbytes:
                raise ValueError(f"shm broadcast: the root has {None if data is None else len(data)} bytes, "
                                 f"not the {nbytes} every member was told")
            ctypes.memmove(buf, data, nbytes)
        with self._lock:
            self._ready("broadcast")
            self._done(self._lib.mi_broadcast(self._comm, buf, nbytes, root), "broadcast")
        return buf.raw[:nbytes]

    def barrier(self) -> None:
        with self._lock:
            self._ready("barrier")
            self._done(self._lib.mi_barrier(self._comm), "barrier")


_KINDS = {1: "all_reduce", 2: "all_gather", 3: "reduce_scatter", 4: "broadcast"}


def _describe(kind: int, nbytes: int) -> str:
    dtype = {v: k for k, v in _DTYPES.items()}.get(kind % 8)
    what = _KINDS.get((kind & 0xFFFFFFFF) >> 3, f"kind {(kind & 0xFFFFFFFF) >> 3}")
    if what == "broadcast":  # its root in the high word (root + 1)
        return f"broadcast of {nbytes} bytes from member {(kind >> 32) - 1}"
    return f"{what} of {nbytes} bytes" + (f" {str(dtype).replace('torch.', '')}" if what != "all_gather" else "")


def _checked(x: Tensor, what: str, reduce: bool = True) -> Tensor:
    if x.device.type != "cpu":
        raise ValueError(f"shm {what}: a CPU tensor is needed, got one on {x.device}")
    if x.dtype not in _DTYPES and (reduce or x.element_size() == 0):
        raise ValueError(f"shm {what}: dtype {x.dtype} is not one of {[str(d) for d in DTYPES]}")
    return x.contiguous()


_COMMS: dict[str, Communicator] = {}


def _all_gather_objects(pg):
    import torch.distributed as dist

    def exchange(obj) -> list:
        out: list = [None] * pg.size()
        dist.all_gather_object(out, obj, group=pg)
        return out

    return exchange


def attach(group_name: str, slot_bytes: int | None = None, exchange=None) -> Communicator:
    """This rank's communicator for process group `group_name`, made now if it has none:
    collective over the group (every member calls it, in the same order as its other
    collectives). ShmUnavailable, on every member alike, if any of them cannot.
    `exchange(obj) -> [every member's obj]` is how the members agree (default: the group's
    own all_gather_object; a pass inside the compiler passes one through the job's store)."""
    import torch.distributed as dist

    pg = _resolve(group_name)
    exchange = exchange or _all_gather_objects(pg)
    comm = _COMMS.get(group_name)
    if comm is not None and comm.belongs_to(pg):
        return comm
    members = dist.get_process_group_ranks(pg)
    me, world = pg.rank(), pg.size()
    why = unavailable_reason()
    if why is None and world > MAX_WORLD:
        why = f"{world} ranks: the segment's header holds at most {MAX_WORLD}"
    if slot_bytes is None and why is None:
        slot_bytes = slot_bytes_for(world, _free_bytes())
        if not slot_bytes:
            why = f"{SHM_DIR} has {_free_bytes() / 2**20:.1f} MiB free, too little for {world} ranks' slots"
    mapping = shared = None
    if me == 0 and why is None:
        path = SHM_DIR / f"metainfer-{os.getpid()}-{secrets.token_hex(6)}"
        try:
            mapping = _Mapping(path, _segment_bytes(world, slot_bytes), create=True)
            library().mi_init_header(mapping.address, world, slot_bytes)
            shared = mapping.shared_path
        except OSError as e:
            path.unlink(missing_ok=True)
            why = f"creating {path}: {e}"
    try:
        name, slot_bytes, first_why = exchange((shared, slot_bytes, why))[0]
        comm = None
        if me != 0 and why is None and name is not None:
            try:
                mapping = _Mapping(Path(name), _segment_bytes(world, slot_bytes), create=False)
            except OSError as e:
                why = f"mapping {name}: {e}"
        if why is None and mapping is not None:
            try:
                comm = Communicator(pg, group_name, mapping, slot_bytes, _timeout_s(pg))
            except ShmUnavailable as e:
                why = str(e)
        verdicts = exchange(why if name is not None else first_why)
    finally:
        if mapping is not None:
            mapping.release_descriptor()  # every rank has it mapped (or gave up)
    failed = [(r, w) for r, w in enumerate(verdicts) if w is not None]
    if failed:
        if comm is not None:
            comm.close()
        elif mapping is not None:
            mapping.close()
        r, w = failed[0]
        raise ShmUnavailable(f"member {r} (rank {members[r]}) of group {group_name!r}: {w}")
    _COMMS[group_name] = comm
    return comm


def _free_bytes() -> int:
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def reserve(group_name: str, exchange=None) -> str | None:
    """Attach now (collective over the group; `exchange` as for attach); None, or why the path
    cannot run there (the same answer on every member)."""
    try:
        attach(group_name, exchange=exchange)
    except ShmUnavailable as e:
        return str(e)
    return None


def detach(group_name: str) -> None:
    """Drop this rank's communicator for the group (its mapping goes when nothing uses it)."""
    comm = _COMMS.pop(group_name, None)
    if comm is not None:
        comm.close()


def communicator(group_name: str) -> Communicator:
    """The group's communicator, attached on first use (a graph Inductor served from its cache
    did not run the pass that attaches it)."""
    comm = _COMMS.get(group_name)
    if comm is not None and comm.belongs_to(_resolve(group_name)):
        return comm
    return attach(group_name)


# ---- the ops --------------------------------------------------------------------------------

_LIB = torch.library.Library("metainfer", "FRAGMENT")
_LIB.define("shm_all_reduce(Tensor x, str group_name) -> Tensor", tags=(torch.Tag.pt2_compliant_tag,))
_LIB.define("shm_all_gather(Tensor x, int group_size, str group_name) -> Tensor", tags=(torch.Tag.pt2_compliant_tag,))
_LIB.define("shm_reduce_scatter(Tensor x, int group_size, str group_name) -> Tensor",
            tags=(torch.Tag.pt2_compliant_tag,))


def _group(group_size: int, group_name: str) -> Communicator:
    comm = communicator(group_name)
    if comm.world != group_size:
        raise ValueError(f"group {group_name!r} has {comm.world} ranks, the op says {group_size}")
    return comm


def _all_reduce(x: Tensor, group_name: str) -> Tensor:
    return communicator(group_name).all_reduce(x)


def _all_gather(x: Tensor, group_size: int, group_name: str) -> Tensor:
    return _group(group_size, group_name).all_gather(x)


def _reduce_scatter(x: Tensor, group_size: int, group_name: str) -> Tensor:
    return _group(group_size, group_name).reduce_scatter(x)


_LIB.impl("shm_all_reduce", _all_reduce, "CPU")
_LIB.impl("shm_all_gather", _all_gather, "CPU")
_LIB.impl("shm_reduce_scatter", _reduce_scatter, "CPU")


@torch.library.register_fake("metainfer::shm_all_reduce", lib=_LIB)
def _(x: Tensor, group_name: str) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("metainfer::shm_all_gather", lib=_LIB)
def _(x: Tensor, group_size: int, group_name: str) -> Tensor:
    return x.new_empty((group_size * x.shape[0], *x.shape[1:]))


@torch.library.register_fake("metainfer::shm_reduce_scatter", lib=_LIB)
def _(x: Tensor, group_size: int, group_name: str) -> Tensor:
    torch._check(x.shape[0] % group_size == 0, lambda: f"dim 0 ({x.shape[0]}) must divide by {group_size}")
    return x.new_empty((x.shape[0] // group_size, *x.shape[1:]))


# ---- the declarations (kernels/spec.py) ---------------------------------------------------------

def _example(*sizes):
    return lambda: (torch.randn(4, 8), *sizes, "example_group")


# the group: its name (last argument), or its size where the op takes one
OPS = (
    spec.OpSpec("shm_all_reduce", spec.COLLECTIVE, spec.by_bytes, spec.OPAQUE_LAYOUT, _example(),
                collective=spec.Collective("all_reduce", "shm")),
    spec.OpSpec("shm_all_gather", spec.COLLECTIVE, spec.by_bytes, spec.OPAQUE_LAYOUT, _example(2),
                collective=spec.Collective("all_gather", "shm", group_size_arg=1)),
    spec.OpSpec("shm_reduce_scatter", spec.COLLECTIVE, spec.by_bytes, spec.OPAQUE_LAYOUT, _example(2),
                collective=spec.Collective("reduce_scatter", "shm", group_size_arg=1)),
)
