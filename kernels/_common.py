"""Small helpers shared by the kernel launchers."""

from __future__ import annotations

import contextvars
import functools
import inspect
import os
import warnings
from collections.abc import Mapping

import torch
import triton

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class KernelInputError(ValueError):
    """A launcher was called with inputs its kernel does not support."""


def check(cond: bool, kernel: str, msg: str) -> None:
    if not cond:
        raise KernelInputError(f"{kernel}: {msg}")


def fail(kernel: str, msg: str):
    """Raise the KernelInputError of a failed check. Checks whose message is formatted write
    `if not cond: fail(...)`: a launch that passes formats nothing (check()'s f-string argument
    would be built on every call, a few microseconds each)."""
    raise KernelInputError(f"{kernel}: {msg}")


GRID_YZ_MAX = 65535  # CUDA's limit on a grid's y and z dimensions (x goes to 2^31 - 1)


def check_grid(grid: tuple, kernel: str, what: str) -> None:
    """A launch grid CUDA accepts: y and z at most GRID_YZ_MAX (`what` names what y counts)."""
    if not all(g <= GRID_YZ_MAX for g in grid[1:]):
        fail(kernel, f"{what} need a launch grid of {tuple(grid)}, past CUDA's {GRID_YZ_MAX} programs along y / z")


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for the host: Triton 3.9's triton.cdiv is a constexpr function whose call
    unwraps its arguments (~5 us a call, several per launch)."""
    return -(-a // b)


def broadcasts_to(shape, target) -> bool:
    """Whether a tensor of `shape` broadcasts to exactly `target` (torch.broadcast_shapes costs
    ~20 us a call on the launch path)."""
    if len(shape) > len(target):
        return False
    return all(s == 1 or s == t for s, t in zip(reversed(tuple(shape)), reversed(tuple(target))))


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def dot_block(kernel: str, config, key: str) -> int:
    """config[key], which must be a power of two >= 16 (a tl.dot tile), else KernelInputError."""
    val = config[key]
    if not (isinstance(val, int) and val >= 16 and val & (val - 1) == 0):
        fail(kernel, f"config {key} must be a power of two >= 16 (tl.dot tiles), got {val!r}")
    return val


def check_float(kernel: str, name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        fail(kernel, f"{name} must be a tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        fail(kernel, f"{name} has dtype {t.dtype}; supported: float32, bfloat16, float16")


def check_qkv(kernel: str, q, k, v) -> tuple[int, int, int, int, int, int]:
    """Attention's q (B, Hq, Sq, D), k (B, Hkv, Sk, D), v (B, Hkv, Sk, Dv): float, one dtype and
    device, grouped heads; (B, Hq, Sq, D, Hkv, Sk)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_float(kernel, name, t)
        if t.dim() != 4:
            fail(kernel, f"{name} must be 4-D (batch, heads, seq, head_dim), got shape {tuple(t.shape)}")
    if not q.dtype == k.dtype == v.dtype:
        fail(kernel, f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    check(q.device == k.device == v.device, kernel, "q, k, v are on different devices")
    B, Hq, Sq, D = q.shape
    Bk, Hkv, Sk, Dk = k.shape
    if not (Bk == B and v.shape[0] == B):
        fail(kernel, f"batch sizes differ: q {B}, k {Bk}, v {v.shape[0]}")
    if Dk != D:
        fail(kernel, f"q and k head dims differ: {D} vs {Dk}")
    if tuple(v.shape[1:3]) != (Hkv, Sk):
        fail(kernel, f"v shape {tuple(v.shape)} does not match k shape {tuple(k.shape)} in heads/seq")
    if not (Hkv > 0 and Hq % Hkv == 0):
        fail(kernel, f"query heads ({Hq}) must be a multiple of kv heads ({Hkv})")
    return B, Hq, Sq, D, Hkv, Sk


def as_rows(kernel: str, name: str, t: torch.Tensor) -> torch.Tensor:
    """View `t` (..., N) as (rows, N) without copying; its last dim must have stride 1."""
    if not t.dim() >= 1:
        fail(kernel, f"{name} must have at least one dimension")
    n = t.shape[-1]
    if not (t.stride(-1) == 1 or n == 1):
        fail(kernel, f"{name} must have unit stride in its last dimension (got strides {tuple(t.stride())}); "
          "call .contiguous() first")
    try:
        return t.view(-1, n)
    except RuntimeError:
        raise KernelInputError(f"{kernel}: {name} with shape {tuple(t.shape)} and strides "
                               f"{tuple(t.stride())} cannot be viewed as rows; call .contiguous() first")


def rows_of(kernel: str, name: str, t: torch.Tensor) -> tuple[int, int]:
    """(rows, row stride) of `t` (..., N) seen as (rows, N), as `as_rows` sees it; a contiguous
    tensor is answered from its size without building the view (~0.8 us a launch)."""
    n = t.shape[-1]
    if n and t.is_contiguous():
        return t.numel() // n, n
    rows = as_rows(kernel, name, t)
    return rows.shape[0], rows.stride(0)


def contiguous_like(t: torch.Tensor, dtype: torch.dtype | None = None, dense: bool = False) -> torch.Tensor:
    """A new contiguous tensor of t's shape (in `dtype`, default t's). `dense`: t is contiguous
    (a launch plan knows it), so a plain empty_like gives that layout (~0.7 us against ~1 us
    with a memory format)."""
    if dense:
        return torch.empty_like(t, dtype=dtype)
    return torch.empty_like(t, dtype=dtype, memory_format=torch.contiguous_format)


def softmax_rows(s: torch.Tensor, zero_empty_rows: bool) -> torch.Tensor:
    """softmax over the last dim of scores; a row with every key masked (-inf) gives NaN, or 0
    with `zero_empty_rows` (SDPA's convention): the torch paths' and references' shared step."""
    p = torch.softmax(s, dim=-1)
    return p.nan_to_num(nan=0.0) if zero_empty_rows else p


def strides_as(t: torch.Tensor, shape) -> tuple[int, ...]:
    """`t.expand(shape).stride()` without building the view: t's strides aligned to `shape` from
    the right, 0 on the dims t lacks or broadcasts (the caller has checked `broadcasts_to`)."""
    size, stride = t.shape, t.stride()
    pad = len(shape) - len(size)
    return (0,) * pad + tuple(0 if n == 1 and m != 1 else s for n, m, s in zip(size, shape[pad:], stride))


def interpreted() -> bool:
    """Whether the kernels were built for Triton's interpreter (CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


# Bumped by kernels/configs.activate: plans that looked their config up are made again.
CONFIG_GENERATION = 0
# The kernel rows of the compiled graph now running (kernels/configs.using, configs.rows_of's
# tuple): its generation keeps their plans apart from the default's and from another graph's.
SCOPED_ROWS: contextvars.ContextVar = contextvars.ContextVar("metainfer_kernel_rows", default=None)


def config_generation():
    """Which kernel rows a launch that looks its config up reads now (see configs.using)."""
    scoped = SCOPED_ROWS.get()
    return CONFIG_GENERATION if scoped is None else scoped[2]

# Set by lowering/aot.py while it records launches for a GPU architecture it compiles for
# ahead of time: launchers then decide as they would on a GPU of that compute capability.
AOT_CAPABILITY: tuple[int, int] | None = None


def gpu_capability(device: torch.device) -> tuple[int, int] | None:
    """The compute capability the kernels are built for: the ahead-of-time recording's, a
    CUDA device's, or None (the interpreter on CPU tensors)."""
    if AOT_CAPABILITY is not None:
        return AOT_CAPABILITY
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(device)


def split_count(config: Mapping, programs: int, length: int, align: int) -> tuple[int, int]:
    """(splits, length per split) for cutting a long axis (attention's keys, a GEMM's K) of a
    launch of `programs` programs over several programs each; see SplitRule."""
    return SplitRule(config, programs, align)(length)


class SplitRule:
    """How a launch of `programs` programs cuts a long axis, decided once per launch signature
    and applied per call to the axis' length (a decode context grows every step).

    Decode launches few programs (batch x heads, N / BLOCK_N tiles) over long axes: with fewer
    programs than the GPU has SMs (the config's SM_COUNT) the axis is cut into splits of at
    least SPLIT_MIN elements, enough to give every SM a program, at most MAX_SPLITS. `SPLITS`
    in the config forces a count (tests). The length per split is a multiple of `align` (the
    launch's block along the axis), so splits start on block boundaries."""

    __slots__ = ("forced", "most", "split_min", "align", "last")

    def __init__(self, config: Mapping, programs: int, align: int):
        forced = config.get("SPLITS")
        self.forced = None if forced is None else max(1, int(forced))
        sms = config.get("SM_COUNT", 0)
        # without a forced count: at most this many splits (1 when the programs fill the GPU)
        self.most = 1 if programs >= sms else min(config.get("MAX_SPLITS", 16), cdiv(sms, programs))
        self.split_min, self.align = config.get("SPLIT_MIN", 256), align
        self.last = (None, None)  # (length, answer): every layer of a decode step asks the same

    def __call__(self, length: int) -> tuple[int, int]:
        last = self.last
        if last[0] == length:
            return last[1]
        n = max(length, 1)
        if self.forced is None and self.most == 1:
            answer = (1, n)
        else:
            splits = self.forced if self.forced is not None else min(self.most, n // self.split_min)
            align = self.align
            splits = max(1, min(splits, -(-n // align)))
            per_split = -(-(-(-n // splits)) // align) * align
            answer = (-(-n // per_split), per_split)
        self.last = (length, answer)
        return answer


# ---- triton.autotune, on a CUDA GPU only ---------------------------------------------------------

# The keys of a config row that triton.autotune may choose (the rest are the launcher's own).
TUNED_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")

# How the tuner times a candidate; None is Triton's own benchmarker (do_bench on the GPU). Tests
# put a stub here to run the tuned launch path under the interpreter.
AUTOTUNE_BENCH = None

_tuners: dict = {}


# Tuning stops once a server has warmed up (freeze_tuning): a shape first seen later runs its
# table row instead of timing 2-4 configs in the middle of a serving step.
_TUNING = {"frozen": False}


def freeze_tuning(frozen: bool = True) -> None:
    """From now on launchers take their table row for shapes not tuned yet (a server calls this
    after its warm-up); tuners already made keep what they chose."""
    _TUNING["frozen"] = frozen


def autotune_enabled(device: torch.device) -> bool:
    """Whether a launcher lets triton.autotune pick among its config's candidates: on a CUDA GPU
    only, never inside a CUDA-graph capture (timing launches there would be captured) nor once
    tuning is frozen. Under the interpreter (CI) and while lowering/aot.py records launches the
    row's one fixed config runs, so tests and compiled code stay fast and deterministic."""
    if device.type != "cuda" or AOT_CAPABILITY is not None or interpreted() or _TUNING["frozen"]:
        return False
    return not torch.cuda.is_current_stream_capturing()


def tune_candidates(config: dict, clamp) -> list[dict]:
    """The row's own config first, then its AUTOTUNE alternatives, each passed through
    `clamp(candidate) -> candidate` (the launcher's limits for this shape), duplicates dropped."""
    out: list[dict] = []
    for alt in ({}, *config.get("AUTOTUNE", ())):
        cand = clamp({k: alt.get(k, config.get(k)) for k in TUNED_KEYS if k in alt or k in config})
        if cand not in out:
            out.append(cand)
    return out


_AUTOTUNE_CACHES = "cache_results" in inspect.signature(triton.autotune).parameters  # Triton >= 3.3


def autotuned(kernel, candidates: list[dict], key: tuple[str, ...], bucket):
    """`kernel` wrapped in triton.autotune over `candidates`, one tuner per shape `bucket`: it times
    them on its first call for each value of the `key` arguments (constexprs such as head dims;
    tensor dtypes are added by Triton) and reuses the fastest. A bucket is coarse (e.g. powers of
    two of the sequence length), so a growing decode context is not re-tuned every step."""
    frozen = tuple(tuple(sorted(c.items())) for c in candidates)
    memo = (kernel, frozen, tuple(key), bucket, AUTOTUNE_BENCH)
    tuner = _tuners.get(memo)
    if tuner is None:
        configs = [triton.Config({k: v for k, v in c.items() if k.startswith("BLOCK_")},
                                 num_warps=c.get("num_warps", 4), num_stages=c.get("num_stages", 2))
                   for c in candidates]
        bench = {} if AUTOTUNE_BENCH is None else {"do_bench": AUTOTUNE_BENCH}
        if _AUTOTUNE_CACHES:  # timings kept on disk (Triton's cache dir: metainfer's, per GPU and driver)
            bench["cache_results"] = True
        tuner = _tuners[memo] = triton.autotune(configs=configs, key=list(key), **bench)(kernel)
    return tuner


# ---- per-signature launch decisions ----------------------------------------------------------------

class LaunchPlans:
    """A launcher's decisions (blocks, splits, grid, constexprs, tuner) kept per signature: the
    sizes they depend on, flags and dtypes, and the config they were made from. A decode step
    launches the same signatures every step, so it pays for the decisions once. Sizes that move
    every step (a growing context) stay out of the key: launchers decide those per call.

    An entry holds its config and is used only for that same object (lowering's configs are
    shared, read-only); the key also carries the state that changes decisions between calls
    (the AOT recording's architecture, the autotune benchmarker). Bounded: a launcher that meets
    more than `limit` signatures (prefill lengths) starts over."""

    def __init__(self, limit: int = 1024):
        self._plans: dict = {}
        self._limit = limit

    def get(self, key: tuple, config, build, *build_args):
        """The plan for `key` made from `config`, else `build(*build_args)`'s (arguments, not a
        closure: a lambda over the launcher's locals would turn each of them into a cell).
        `config` None: the launcher looks its config up inside `build` (an op's call), and the
        plan lasts until a target activates other rows (CONFIG_GENERATION)."""
        key = (key, AOT_CAPABILITY, AUTOTUNE_BENCH, config_generation() if config is None else -1)
        try:
            hit = self._plans.get(key)
        except TypeError:  # an unhashable argument: the build's checks say what is wrong with it
            return build(*build_args)
        if hit is not None and hit[0] is config:
            return hit[1]
        if len(self._plans) >= self._limit:
            self._plans.clear()
        plan = build(*build_args)
        self._plans[key] = (config, plan)
        return plan


try:  # Dynamo's guard on tensors' metadata, checked in C++; private, so optional
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except ImportError:  # pragma: no cover - every torch metainfer supports has it
    _TensorGuards = None


class _MetadataGuard:
    """The Python stand-in for TensorGuards where torch lacks it or refuses the tensors (one
    tensor given twice): dtype, device, requires_grad, sizes and strides."""

    __slots__ = ("expected", "loose")

    def __init__(self, tensors: tuple, sizes: list, strides: list):
        # per tensor: None when every size and stride is fixed, else (size free, stride free) per dim
        self.loose = tuple(None if None not in sz and None not in st else
                           (tuple(n is None for n in sz), tuple(n is None for n in st))
                           for sz, st in zip(sizes, strides))
        self.expected = tuple(_metadata(t, loose) for t, loose in zip(tensors, self.loose))

    def check(self, *tensors) -> bool:
        if len(tensors) != len(self.expected):
            raise TypeError("wrong length")  # as TensorGuards does
        return all(isinstance(t, torch.Tensor) and (loose is None or t.dim() == len(loose[0]))
                   and _metadata(t, loose) == e for t, loose, e in zip(tensors, self.loose, self.expected))


def _metadata(t: torch.Tensor, loose: tuple | None) -> tuple:
    if loose is None:
        return t.shape, t.stride(), t.dtype, t.device, t.requires_grad
    return (tuple(None if free else n for n, free in zip(t.shape, loose[0])),
            tuple(None if free else n for n, free in zip(t.stride(), loose[1])), t.dtype, t.device, t.requires_grad)


class GuardedPlans(LaunchPlans):
    """LaunchPlans with the few plans used last in front (per bucket of the launch's scalars), each
    found by one guard check over the launch's tensors instead of a Python signature hashed per
    call. Dynamo's TensorGuards checks
    dtype, device, dispatch keys, requires_grad, sizes and strides of every tensor in C++
    (~0.12 us a tensor against ~0.45 us to read one tensor's signature in Python).

    `vary`: {position in the launch's tensors: (dims whose size may vary, dims whose stride may
    vary)}, None for every dim; what a plan does not depend on (a decode cache's length, and its
    strides when it grows by concatenation; paged attention's pool rows). The rank is always
    checked. A miss falls back to the signature dict behind."""

    def __init__(self, vary: dict | None = None, recent: int = 8, limit: int = 1024):
        super().__init__(limit)
        self._vary, self._recent_max = vary or {}, recent
        # (scalars, tensor count, global state) -> ((config, guard, plan), ...), the last used first;
        # a launcher with many signatures of the same scalars per step (fp8_gemm's linears) puts a
        # cheap discriminator (the weight's shape) in its scalars, so no bucket cycles past `recent`
        self._recent: dict = {}

    def get_guarded(self, scalars: tuple, tensors: tuple, config, key_fn, build, *build_args):
        """The plan for these tensors' metadata and `scalars` (hashable; must tell apart launches
        whose tensors are not the same list, e.g. an optional one given or not), else
        `self.get(key_fn(*build_args), config, build, *build_args)`'s, which is then put in front."""
        state = (scalars, len(tensors), AOT_CAPABILITY, AUTOTUNE_BENCH, config_generation() if config is None else -1)
        entries = self._recent.get(state, ())
        for i, entry in enumerate(entries):
            if entry[0] is config and entry[1].check(*tensors):
                if i:
                    self._recent[state] = (entry, *entries[:i], *entries[i + 1:])
                return entry[2]
        plan = self.get(key_fn(*build_args), config, build, *build_args)
        if len(self._recent) >= self._limit:
            self._recent.clear()
        self._recent[state] = ((config, self._guard(tensors), plan), *entries[:self._recent_max - 1])
        return plan

    def _guard(self, tensors: tuple):
        sizes, strides = [], []
        for i, t in enumerate(tensors):
            free_sizes, free_strides = self._vary.get(i, ((), ()))
            sizes.append([None if free_sizes is None or d in free_sizes else n for d, n in enumerate(t.shape)])
            strides.append([None if free_strides is None or d in free_strides else n for d, n in enumerate(t.stride())])
        # TensorGuards passes only distinct tensors (Dynamo guards aliasing apart): a launch given one
        # tensor twice (gate and up weights tied) gets the Python guard
        if _TensorGuards is not None and len({id(t) for t in tensors}) == len(tensors):
            try:
                return _TensorGuards(*tensors, dynamic_dims_sizes=sizes, dynamic_dims_strides=strides)
            except (TypeError, RuntimeError):  # a tensor it refuses: the Python guard checks the same
                pass
        return _MetadataGuard(tensors, sizes, strides)


def signature(*args) -> tuple:
    """A launch's arguments as a key: each tensor's shape, strides, dtype and device, other values
    as they are. For launchers whose decode-step arguments repeat exactly every step."""
    return tuple([(a.shape, a.stride(), a.dtype, a.device) if isinstance(a, torch.Tensor) else a for a in args])


# ---- out of resources: a smaller config instead of an error ------------------------------------

def out_of_resources() -> type[Exception]:
    """Triton's error for a launch refused for want of shared memory or registers."""
    from triton.runtime.errors import OutOfResources
    return OutOfResources


def smaller_config(config: dict) -> dict | None:
    """One step down from `config`: fewer pipeline stages, then half BLOCK_N, then half BLOCK_M
    (never below 16, tl.dot's least); None when nothing is left to shrink. Tuning is dropped: the
    alternatives were the row's, sized for the device the row was written for."""
    cfg = {k: v for k, v in config.items() if k not in ("AUTOTUNE", "SMALL_M", "WIDE_R")}
    if cfg.get("num_stages", 2) > 1:
        return {**cfg, "num_stages": cfg.get("num_stages", 2) - 1}
    for key in ("BLOCK_N", "BLOCK_M", "BLOCK_K"):
        if cfg.get(key, 0) > 16:
            return {**cfg, key: cfg[key] // 2}
    return None


# launcher -> {(its config, the tensors' dtypes and last dims) -> the config that fitted}: only a
# launcher that was refused once looks its fits up on later calls
_fitted: dict = {}


def _fit_key(config: dict, args) -> tuple:
    shapes = tuple((a.dtype, a.shape[-1] if a.dim() else 0) if isinstance(a, torch.Tensor) else type(a).__name__
                   for a in args)
    return repr(sorted(config.items(), key=lambda kv: kv[0])), shapes


def retries_smaller(kernel: str, default_config=None):
    """A launcher decorator: when Triton refuses the launch for want of shared memory or registers
    (OutOfResources, raised before anything runs), launch again with `smaller_config` until one
    fits, and reuse that config for the same launcher, config and dtypes / last dims. Each shrink
    is warned of once, naming the kernel and both configs. A launch called with config=None uses
    `default_config(*args)`'s row (the launcher looks it up itself while the row fits)."""

    def wrap(launch):
        @functools.wraps(launch)
        def launcher(*args, config: dict | None = None, **kwargs):
            cfg = config
            # nothing added to a launch that fits: the key is built only once this launcher was refused
            fits = _fitted.get(kernel)
            if fits:
                base = config if config is not None else default_config(*args)
                cfg = fits.get(_fit_key(base, args), config)
            while True:
                try:
                    out = launch(*args, config=cfg, **kwargs)
                except out_of_resources() as e:
                    current = cfg if cfg is not None else default_config(*args)
                    smaller = smaller_config(current)
                    if smaller is None:
                        raise
                    warnings.warn(f"{kernel}: {e}; retrying with {smaller} instead of {current}", stacklevel=2)
                    cfg = smaller
                    continue
                if cfg is not config:
                    base = config if config is not None else default_config(*args)
                    _fitted.setdefault(kernel, {})[_fit_key(base, args)] = cfg
                return out
        return launcher
    return wrap
