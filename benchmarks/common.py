"""Helpers shared by benchmarks/bench.py and scripts/gpu_check.py (GPU measurements of dplr-gen vs fla-core).

Both scripts are a parent that never runs a kernel and workers (subprocesses of the same script) that do: a
compiler abort, an illegal address or a run-time autotune that takes minutes kills or stalls one worker, not
the run. A worker prints one ``RESULT {json}`` line per finished job; the parent restarts a worker that died
for the jobs it had left, enforces one deadline for everything, and writes its JSON after every worker.

Conventions: tensors in fla's layout [B, T, H, K]; RWKV-7 names r, w, k, v, a, b, h0 (w is a log-decay, the gk
of the DPLR rule: fla's chunk_rwkv7 passes it as gk to chunk_dplr_delta_rule, whose naive reference
multiplies the state by exp(gk)); both systems receive the very same tensors; scale = 1.0 (RWKV-7).
"""

from __future__ import annotations

import datetime as _dt
import gc
import hashlib
import inspect
import itertools
import json
import math
import os
import queue
import random
import signal
import subprocess
import sys
import tempfile
import threading
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

REPO = Path(__file__).resolve().parent.parent
RESULT_TAG = "RESULT "
CONTEXT_LOST_RC = 75  # a worker whose device is unusable after a job exits with this: restart, charge no job
GATE_BOUND = -0.61  # the lower_bound promise handed to both systems' fast paths
RWKV7_W_MIN = -0.6065  # RWKV-7's decay clamp: w = -exp(-0.5) * sigmoid(x)
INPUTS = ("r", "w", "k", "v", "a", "b", "h0")  # differentiable inputs, in gradient order
QUANTITIES = ("o", "ht", "dr", "dw", "dk", "dv", "da", "db", "dh0")  # what every accuracy check compares
HBM_BYTES_PER_S = 3.0e12  # H100 device copy (read + write), measured with torch on one H100 80GB HBM3


# ----------------------------------------------------------------------------------------------------------
# files and machine


def out_dir() -> Path:
    d = Path(os.environ.get("OUT") or ".")
    d.mkdir(parents=True, exist_ok=True)
    return d


def stamp() -> str:
    return _dt.datetime.now().strftime("%Y%m%d-%H%M%S")


# Set by scripts/run_gpu.sh to the archive of fla's Triton autotune results it restored before the run.
FLA_AUTOTUNE_ENV = "DPLR_BENCH_FLA_AUTOTUNE"


def fla_autotune_seed() -> dict[str, str] | None:
    """{path, sha256} of the restored fla autotune archive, or None when fla autotuned from scratch."""
    path = os.environ.get(FLA_AUTOTUNE_ENV)
    if not path:
        return None
    import hashlib

    if not Path(path).is_file():  # a run from another folder than the one that set it (an A/B's base tree)
        raise FileNotFoundError(f"{FLA_AUTOTUNE_ENV}={path!r}: no such file from {os.getcwd()}; set it to the "
                                "archive's absolute path (scripts/gpu_setup.sh does) or unset it")
    return {"path": path, "sha256": hashlib.sha256(Path(path).read_bytes()).hexdigest()}


def jsonable(x: Any) -> Any:
    """JSON-safe copy: non-finite floats become the strings "inf", "-inf", "nan"; tuples become lists."""
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, Mapping):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)


def write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(jsonable(obj), indent=1, allow_nan=False) + "\n")
    os.replace(tmp, path)


def _cmd(*argv: str) -> str | None:
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=20)
        return r.stdout.strip() or None if r.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def package_version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


SOURCE_GLOBS = ("dplr_gen/**/*.py", "dplr_gen/spec/data/*", "dplr_gen/render/templates/*", "specs/*.yaml", "generated/*/index.json")


def source_digest() -> str:
    """sha256 (16 hex) of the files that decide the kernels and how they run, independent of git."""
    h = hashlib.sha256()
    for f in sorted({f for g in SOURCE_GLOBS for f in REPO.glob(g) if f.is_file()}):
        h.update(f.relative_to(REPO).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def machine_info(device: str = "cuda") -> dict[str, Any]:
    """GPU, driver and library versions (the parent calls this: it initialises CUDA but runs no kernel)."""
    import torch
    import triton

    info: dict[str, Any] = {
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "triton": triton.__version__,
        "fla_core": package_version("fla-core"),
        # the GPU machine's copy of the tree may carry a stale .git: the caller can name the commit, and the
        # digest of the sources says which tree ran either way (`python -m benchmarks.common` prints it here)
        "dplr_gen_commit": os.environ.get("DPLR_GEN_COMMIT") or _cmd("git", "-C", str(REPO), "rev-parse", "--short", "HEAD"),
        "dplr_gen_source_sha": source_digest(),
        "device": device,
    }
    if device == "cuda" and torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(
            gpu=torch.cuda.get_device_name(0), capability=f"sm_{p.major}{p.minor}",
            gpu_memory_gb=round(p.total_memory / 2**30, 1), cuda=torch.version.cuda,
            driver=_cmd("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"),
        )
    return info


# ----------------------------------------------------------------------------------------------------------
# systems under test


@dataclass(frozen=True)
class System:
    name: str
    impl: str  # "dplr", "fla" or "wind" (the hand-written CUDA kernel, built on the GPU machine)
    label: str
    kwargs: tuple[tuple[str, Any], ...] = ()

    @property
    def cu_dtype(self) -> str:
        """cu_seqlens' dtype where a shape does not name one: int64, fla-core's type hint (and the CUDA kernel's
        requirement), for every system."""
        return "int64"


SYSTEMS: dict[str, System] = {
    s.name: s
    for s in (
        System("dplr-fast", "dplr", "dplr-gen chunk_rwkv7, lower_bound=-0.61 (bounded-gate variant, chunk 16)", (("lower_bound", GATE_BOUND),)),
        System("dplr-keep", "dplr", "dplr-gen chunk_rwkv7, lower_bound=-0.61, disable_recompute=True (states kept)",
               (("lower_bound", GATE_BOUND), ("disable_recompute", True))),
        System("dplr-generic", "dplr", "dplr-gen chunk_rwkv7, defaults (generic gate, chunk 16)"),
        System("fla-best", "fla", "fla-core chunk_rwkv7, chunk_size=64, lower_bound=-0.61",
               (("chunk_size", 64), ("lower_bound", GATE_BOUND))),
        System("fla-default", "fla", "fla-core chunk_rwkv7, defaults (chunk 16)"),
        System("wind-cuda", "wind", "the hand-written chunked bf16 CUDA kernel (Johan Wind's wind_rwkv, "
               "chunked_cuda / chunked_cuda_varlen; no gate promise; needs every length a multiple of 16)"),
    )
}
# where the CUDA peer's source is (a checkout of github.com/johanwind/wind_rwkv, never part of this repository)
WIND_DIR_ENV = "DPLR_BENCH_WIND_DIR"
BASELINE = "fla-best"


def fla_kwargs(wanted: Mapping[str, Any], accepted: Iterable[str]) -> tuple[dict[str, Any], list[str]]:
    """The kwargs fla's signature accepts, and notes on what had to change (an older fla has no lower_bound:
    its equivalent promise is safe_gate=True)."""
    acc = set(accepted)
    used = {k: v for k, v in wanted.items() if k in acc}
    notes = [f"{k} not accepted by this fla; dropped" for k in wanted if k not in acc]
    if "lower_bound" in wanted and "lower_bound" not in acc and "safe_gate" in acc:
        used["safe_gate"] = True
        notes.append("used safe_gate=True as the bounded-gate equivalent")
    return used, notes


Op = Callable[..., tuple[Any, Any]]


# Set to n: every Triton autotuner created afterwards in the process keeps n of its configs (spread over its
# list). fla-core's first calls autotune for minutes at D=128 (more than a GPU call may last); its error
# depends on its algorithm, not on which of its own tile configs runs, so accuracy checks can bound that time.
FLA_MAX_CONFIGS_ENV = "DPLR_BENCH_FLA_MAX_CONFIGS"


def limit_autotune_configs(n: int) -> None:
    """Make every triton Autotuner constructed from now on keep at most ``n`` configs, evenly spaced."""
    from triton.runtime import autotuner

    base = autotuner.Autotuner
    if getattr(base, "_dplr_limited", None) == n:
        return
    init = base.__init__

    def limited_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        cfgs = list(self.configs)
        if len(cfgs) > n:
            step = (len(cfgs) - 1) / max(n - 1, 1)
            self.configs = [cfgs[round(i * step)] for i in range(n)]

    base.__init__ = limited_init  # type: ignore[method-assign]
    base._dplr_limited = n  # type: ignore[attr-defined]


def load_wind(head_size: int, varlen: bool) -> Any:
    """The CUDA peer's module for ``head_size`` (its extension compiled by torch.utils.cpp_extension on first
    use, cached in TORCH_EXTENSIONS_DIR; one head size per process, its own rule)."""
    import importlib

    root = os.environ.get(WIND_DIR_ENV)
    if not root or not Path(root, "wind_rwkv").is_dir():
        raise ImportError(f"the CUDA peer is not here: set {WIND_DIR_ENV} to a checkout of "
                          "github.com/johanwind/wind_rwkv (scripts/run_gpu.sh does)")
    if root not in sys.path:
        sys.path.insert(0, root)
    # a build folder per head size: torch keys its extension builds by name alone, and the name is the peer's
    base = os.environ.get("TORCH_EXTENSIONS_DIR") or str(Path(tempfile.gettempdir()) / "torch_extensions")
    os.environ["TORCH_EXTENSIONS_DIR"] = str(Path(base.split("/wind-d")[0]) / f"wind-d{head_size}")
    name = "chunked_cuda_varlen" if varlen else "chunked_cuda"
    mod = importlib.import_module(f"wind_rwkv.rwkv7.{name}.{name}")
    getattr(mod, f"load_{name}")(head_size)
    return mod


def native_inputs(system: System, x: dict[str, Any], do: Any, dht: Any) -> tuple[dict[str, Any], Any, Any]:
    """Inputs in the system's own form, made once before timing. The CUDA peer takes w as log(-log decay)
    (its decay is exp(-exp(w))), the states transposed ([V, K] per head) and in bf16; the others take them
    as they are."""
    if system.impl != "wind":
        return x, do, dht
    import torch

    y = dict(x)
    y["w"] = torch.log(-x["w"].float()).to(x["w"].dtype)
    y["h0"] = x["h0"].transpose(-1, -2).contiguous().to(x["r"].dtype)
    return y, do, dht.transpose(-1, -2).contiguous().to(x["r"].dtype)


def load_op(system: System, package: str | Path, head_size: int | None = None,
            varlen: bool = False) -> tuple[Op, dict[str, Any]]:
    """``op(x, cu, cu_cpu) -> (o, ht)`` calling the system's chunk_rwkv7 with output_final_state=True, and a
    record of what was called. Raises ImportError (fla, the CUDA peer) or the package's own error (dplr) if
    unusable. ``head_size``, ``varlen``: what the CUDA peer is built for."""
    if system.impl == "wind":
        mod = load_wind(int(head_size or 64), varlen)
        info = {"callable": f"wind_rwkv.rwkv7.{mod.__name__.rsplit('.', 1)[-1]}", "head_size": head_size,
                "source": os.environ.get(WIND_DIR_ENV)}

        def wind_op(x: Mapping[str, Any], cu: Any = None, cu_cpu: Any = None) -> tuple[Any, Any]:
            args = [x[n] for n in ("r", "w", "k", "v", "a", "b")]
            if cu is None:
                return mod.attn_chunked_cuda(*args, x["h0"])
            if cu.dtype != __import__("torch").int64:
                raise TypeError("the CUDA peer takes cu_seqlens as int64 only")
            y, sT = mod.attn_chunked_cuda_varlen(*(t[0] for t in args), x["h0"], cu)
            return y.unsqueeze(0), sT

        return wind_op, info
    if system.impl == "dplr":
        from dplr_gen.runtime import ops
        from dplr_gen.runtime.loader import package_at

        fn: Callable[..., Any] = ops.chunk_rwkv7
        kw: dict[str, Any] = {"package": package_at(package), **dict(system.kwargs)}
        info = {"callable": "dplr_gen.runtime.ops.chunk_rwkv7", "package": str(package), "kwargs": dict(system.kwargs)}
    else:
        limit = int(os.environ.get(FLA_MAX_CONFIGS_ENV) or 0)
        if limit:
            limit_autotune_configs(limit)
        try:
            from fla.ops.rwkv7 import chunk_rwkv7 as fn  # type: ignore[no-redef]
        except Exception as e:  # noqa: BLE001 - any import failure means "not available"
            raise ImportError(f"fla not available: {type(e).__name__}: {e}") from e
        params = inspect.signature(fn).parameters
        kw, notes = fla_kwargs(dict(system.kwargs), params)
        info = {"callable": "fla.ops.rwkv7.chunk_rwkv7", "fla_core": package_version("fla-core"),
                "kwargs": kw, "notes": notes}
        if "cu_seqlens_cpu" not in params:
            info["notes"].append("no cu_seqlens_cpu argument")
        if limit:
            info["notes"].append(f"autotuning limited to {limit} config(s) per kernel ({FLA_MAX_CONFIGS_ENV})")

    def op(x: Mapping[str, Any], cu: Any = None, cu_cpu: Any = None) -> tuple[Any, Any]:
        extra = {} if cu_cpu is None else {"cu_seqlens_cpu": cu_cpu}
        return fn(r=x["r"], w=x["w"], k=x["k"], v=x["v"], a=x["a"], b=x["b"], scale=1.0, initial_state=x["h0"],
                  output_final_state=True, cu_seqlens=cu, **extra, **kw)

    return op, info


def dplr_variant(system: System, package: str | Path, x: Mapping[str, Any], cu: Any = None) -> str:
    """The variant dplr-gen's chunk_rwkv7 runs for these inputs (the op's own choice, for the record)."""
    from dplr_gen.runtime import ops
    from dplr_gen.runtime.loader import package_at

    kw = dict(system.kwargs)
    return ops.variant_for(package_at(package), "chunk", x["r"], x["v"], x["w"], cu, kw.get("chunk_size"),
                           kw.get("lower_bound"))


def overlap_picked(package: str | Path, x: Mapping[str, Any], lengths: Sequence[int] | None = None) -> bool:
    """Whether dplr-gen's chunk backward would run its states pass beside the reverse pass for these dplr-fast
    inputs by itself (the variant's knob and the grid; chunk_driver._overlap), for the record; ``lengths``: the
    sequences of a varlen batch (packed in x, B = 1), whose starts the op reads on the host."""
    from dplr_gen.runtime import chunk_driver
    from dplr_gen.runtime.ops import _kernels
    from dplr_gen.runtime.loader import package_at

    cu = None if lengths is None else cu_tensors(lengths, "int32", x["r"].device)[0]
    name = dplr_variant(SYSTEMS["dplr-fast"], package, x, cu)
    q = x["r"]
    ks = _kernels(str(package_at(package).dir), name, q.device)[0]
    N = q.shape[0] if lengths is None else len(lengths)
    offsets = None if lengths is None else cu_seqlens_of(lengths)
    return chunk_driver._overlap(ks, q, N, x["v"].shape[-1], offsets)


# ----------------------------------------------------------------------------------------------------------
# shapes and inputs


@dataclass(frozen=True)
class Shape:
    B: int
    T: int
    H: int
    D: int
    lengths: tuple[int, ...] | None = None  # varlen: sequences laid end to end (B = 1)
    name: str = ""
    # varlen call forms: cu_seqlens' dtype (None: the system's, int64), and a new tensor each call (a data
    # loader's: copied from the host every step) instead of one tensor reused; ``reordered_cu``: each call's new
    # tensor holds other boundaries, the same lengths in another order (a data loader's next batch: new values,
    # the same work), cycling through CU_ORDERS orders
    cu_dtype: str | None = None
    fresh_cu: bool = False
    reordered_cu: bool = False

    @property
    def label(self) -> str:
        base = self.name or f"{self.B}x{self.T}x{self.H}x{self.D}"
        form = "-reordered" if self.reordered_cu else "-fresh" if self.fresh_cu else ""
        return base + (f"-{self.cu_dtype}" if self.cu_dtype else "") + form

    def cu_orders(self, n: int | None = None) -> list[list[int]]:
        """The boundaries of ``n`` (default CU_ORDERS) distinct orders of the lengths, deterministic; fewer where
        the lengths have fewer orders (a varlen shape's; [] for a dense one)."""
        if self.lengths is None:
            return []
        n = CU_ORDERS if n is None else n
        rng = random.Random(len(self.lengths))
        seen: set[tuple[int, ...]] = set()
        out: list[list[int]] = []
        for _ in range(100 * n):
            if len(out) == n:
                break
            order = tuple(rng.sample(self.lengths, len(self.lengths)))
            if order not in seen:
                seen.add(order)
                out.append(cu_seqlens_of(order))
        return out

    @property
    def N(self) -> int:
        return self.B if self.lengths is None else len(self.lengths)

    @property
    def cu_seqlens(self) -> list[int] | None:
        return None if self.lengths is None else cu_seqlens_of(self.lengths)


# orders a reordered call form cycles through: more than dplr-gen keeps boundaries of (32), so that every call's
# values are new to it
CU_ORDERS = 64


def mixed_lengths(n: int, total: int, seed: int = 0, min_len: int = 1) -> tuple[int, ...]:
    """n deterministic, uneven sequence lengths (from about total/(5n) to 1.8 total/n) summing to total."""
    rng = random.Random(seed)
    weights = [rng.uniform(0.2, 1.8) for _ in range(n)]
    s = sum(weights)
    lens = [max(min_len, int(total * w / s)) for w in weights]
    lens[-1] += total - sum(lens)
    if lens[-1] < min_len:
        raise ValueError(f"cannot split {total} tokens into {n} sequences of at least {min_len}")
    return tuple(lens)


# the bench's varlen call form: 11 sequences of 512-8192 tokens (32,768; multiples of 16, so the CUDA kernel runs
# too), the mixed lengths of a packed training batch
LENGTHS11 = (512, 1024, 4096, 8192, 2048, 768, 6144, 1536, 3072, 2560, 2816)


def cu_seqlens_of(lengths: Sequence[int]) -> list[int]:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def parse_shape(text: str, presets: Mapping[str, Shape]) -> Shape:
    if text in presets:
        return presets[text]
    parts = text.lower().split("x")
    if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"shape {text!r}: give BxTxHxD (e.g. 4x4096x32x64) or one of {', '.join(presets)}")
    return Shape(*(int(p) for p in parts))


def rwkv7_case(
    B: int, T: int, H: int, K: int, V: int | None = None, *, dtype: Any, device: Any, seed: int,
    n_states: int | None = None, h0: str = "random", raw: bool = False,
) -> dict[str, Any]:
    """RWKV-7-like inputs r, w, k, v, a, b (dtype) and h0 (fp32 [N, H, K, V]), made on ``device``.

    The formulas of dplr_gen.testing.rwkv7_inputs (a = -kk, b = kk * iclr, kk L2-normalised, iclr in (0, 1),
    w in (-0.6065, 0), k scaled by K**-0.5, h0 = 0.5 randn), but drawn by a generator on the device, in place,
    one tensor at a time: fast for 10^9-element tensors, and the same seed gives the same tensors in every
    process on the same device. ``raw``: r, k, v, a, b all plain randn (the original failure report's inputs);
    ``h0``: "random", "zeros" or "none".
    """
    import torch

    V = K if V is None else V
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32)

    x: dict[str, Any] = {}
    x["r"] = rnd(B, T, H, K).to(dtype)
    t = rnd(B, T, H, K)
    x["k"] = (t if raw else t.mul_(K**-0.5)).to(dtype)
    del t
    x["v"] = rnd(B, T, H, V).to(dtype)
    if raw:
        x["a"], x["b"] = rnd(B, T, H, K).to(dtype), rnd(B, T, H, K).to(dtype)
    else:
        kk = torch.nn.functional.normalize(rnd(B, T, H, K), dim=-1)
        x["a"] = kk.neg().to(dtype)
        x["b"] = rnd(B, T, H, K).sigmoid_().mul_(kk).to(dtype)
        del kk
    x["w"] = rnd(B, T, H, K).sigmoid_().mul_(RWKV7_W_MIN).to(dtype)
    N = B if n_states is None else n_states
    if h0 == "random":
        x["h0"] = rnd(N, H, K, V).mul_(0.5)
    elif h0 == "zeros":
        x["h0"] = torch.zeros(N, H, K, V, device=device, dtype=torch.float32)
    elif h0 == "none":
        x["h0"] = None
    else:
        raise ValueError(f"h0 must be random, zeros or none, got {h0!r}")
    return x


def mixed_gates(w: Any) -> None:
    """Edit RWKV-7 gates w [B, T, H, K] in place so that an any-gate variant takes both of its forms: in every
    256 tokens, 16 of -5 (a whole 16-token chunk whose exponents pass 30: the exact form), a reset (-inf) in
    half the channels at token 100, and -3 over tokens 150-189 in a third of the channels."""
    import torch

    t = torch.arange(w.shape[1], device=w.device) % 256
    w[:, (t >= 16) & (t < 32)] = -5.0
    w[:, t == 100, :, ::2] = -math.inf
    w[:, (t >= 150) & (t < 190), :, 1::3] = -3.0


def grad_outputs(x: Mapping[str, Any], seed: int) -> tuple[Any, Any]:
    """Random cotangents (do like o, dht like the fp32 final state): loss = <o, do> + <ht, dht>."""
    import torch

    r, v = x["r"], x["v"]
    N = x["h0"].shape[0] if x.get("h0") is not None else r.shape[0]
    gen = torch.Generator(device=r.device)
    gen.manual_seed(seed + 7919)
    do = torch.randn(v.shape, generator=gen, device=r.device, dtype=torch.float32).to(r.dtype)
    dht = torch.randn(N, r.shape[2], r.shape[3], v.shape[3], generator=gen, device=r.device, dtype=torch.float32)
    return do, dht


def checksums(x: Mapping[str, Any]) -> dict[str, float]:
    """float64 sums of every input: equal checksums across processes show the systems saw the same tensors."""
    return {n: float(t.detach().double().sum().item()) for n, t in x.items() if t is not None}


def same_inputs(results: Mapping[str, Mapping[str, Any]], group: Callable[[str], str | None]) -> dict[str, bool]:
    """Per group of jobs (group(job) -> name, None to ignore): did every job see the same inputs (checksums)?"""
    seen: dict[str, list[Any]] = {}
    for job, r in results.items():
        g = group(job)
        if g is not None and "checksums" in r:
            seen.setdefault(g, []).append(r["checksums"])
    return {g: all(c == v[0] for c in v) for g, v in seen.items()}


def cu_tensors(lengths: Sequence[int] | None, dtype: str, device: Any) -> tuple[Any, Any]:
    """(cu_seqlens on the device, cu_seqlens on the CPU) in ``dtype`` ("int32"/"int64"), or (None, None)."""
    import torch

    if lengths is None:
        return None, None
    cpu = torch.tensor(cu_seqlens_of(lengths), dtype=getattr(torch, dtype))
    return cpu.to(device), cpu


def leaves(x: Mapping[str, Any]) -> dict[str, Any]:
    """Fresh leaf tensors that require grad (the same values), for one system's run."""
    return {n: (None if t is None else t.detach().clone().requires_grad_(True)) for n, t in x.items()}


def fwd_bwd(op: Op, xl: Mapping[str, Any], do: Any, dht: Any, cu: Any = None, cu_cpu: Any = None) -> dict[str, Any]:
    """o, ht and the gradients of <o, do> + <ht, dht> w.r.t. every input (keys of QUANTITIES)."""
    import torch

    o, ht = op(xl, cu, cu_cpu)
    names = [n for n in INPUTS if xl.get(n) is not None]
    grads = torch.autograd.grad((o, ht), [xl[n] for n in names], (do, dht))
    return {"o": o.detach(), "ht": ht.detach(), **{"d" + n: g for n, g in zip(names, grads)}}


def fwd_loss_backward(op: Op, xl: Mapping[str, Any], do: Any, dht: Any, cu: Any = None, cu_cpu: Any = None,
                      sync: Callable[[], None] = lambda: None) -> tuple[dict[str, Any], float]:
    """As :func:`fwd_bwd`, but the backward as a training loop calls it: ``loss.backward()`` on the scalar
    <o, do> + <ht, dht>, gradients read from ``.grad``. (``torch.autograd.grad`` with grad_outputs makes torch
    import sympy for its shape check on the first call: seconds that belong to neither kernel library.)
    Returns the results and the forward's seconds (``sync`` is called before reading the clock)."""
    t0 = time.perf_counter()
    o, ht = op(xl, cu, cu_cpu)
    sync()
    t_fwd = time.perf_counter() - t0
    ((o.float() * do.float()).sum() + (ht.float() * dht.float()).sum()).backward()
    names = [n for n in INPUTS if xl.get(n) is not None]
    return {"o": o.detach(), "ht": ht.detach(), **{"d" + n: xl[n].grad for n in names}}, t_fwd


def step_closures(op: Op, xl: Mapping[str, Any], do: Any, dht: Any, cu: Any = None,
                  cu_cpu: Any = None, fresh_cu: bool = False, cu_cycle: Sequence[Any] = ()
                  ) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """(forward, forward+backward) as the speed measurements time them: the op on the leaves ``xl``, then
    torch.autograd.grad of <o, do> + <ht, dht> w.r.t. every input leaf (nothing accumulated into .grad).
    ``fresh_cu``: each call gets a new cu_seqlens tensor, copied from ``cu_cpu`` (a data loader's step);
    ``cu_cycle`` (host tensors): copied from the next of them instead, round and round (new values each call)."""
    import torch

    leaves = [xl[n] for n in INPUTS if xl.get(n) is not None]
    turn = itertools.count()

    def boundaries() -> Any:
        if cu is None or not (fresh_cu or cu_cycle):
            return cu
        src = cu_cycle[next(turn) % len(cu_cycle)] if cu_cycle else cu_cpu
        return src.to(cu.device, copy=True)

    def fwd() -> Any:
        return op(xl, boundaries())

    def fwd_bwd() -> Any:
        return torch.autograd.grad(op(xl, boundaries()), leaves, (do, dht))

    return fwd, fwd_bwd


def wall_ms(fn: Callable[[], Any], device: Any, n: int = 50, repeats: int = 5) -> float:
    """Wall time per call of ``n`` calls back to back (the device synchronised before and after), the median of
    ``repeats`` such runs (a shared host's time per call wanders from run to run): the host's time per call where
    the host bounds the work, the device's where the device does."""
    fn()
    sync(device)
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        sync(device)
        runs.append((time.perf_counter() - t0) / n * 1e3)
    return statistics.median(runs)


def capture(fn: Callable[[], Any], warm: int = 3) -> tuple[Any, Any]:
    """(a CUDA graph of one call of ``fn``, the call's outputs in the graph's memory), warmed up on a side
    stream first, as capture requires."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warm):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g, out


def graph_ms(fn: Callable[[], Any], device: Any, warmup: int = 10, rep: int = 50) -> tuple[float, Any, Any]:
    """(median ms of replaying ``fn`` captured in a CUDA graph, the captured outputs, the graph): the device's
    time of one call without the host's."""
    g, out = capture(fn)
    g.replay()
    sync(device)
    return bench_ms(g.replay, device, warmup, rep), out, g


def max_diff(a: Any, b: Any) -> float:
    """The largest absolute difference between two sequences of tensors (inf where a shape differs)."""
    return max((float((x.float() - y.float()).abs().max()) if x.shape == y.shape else float("inf"))
               for x, y in zip(a, b))


def floor_op() -> Op:
    """torch's own cost of an op with these inputs and outputs: an autograd Function taking every input leaf,
    returning o and the final state (one copy each) and, in its backward, a gradient per input (one copy, the
    rest allocated). What any eager op of this form pays in autograd and dispatch before its own work."""
    import torch

    class Floor(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, *xs: Any) -> Any:
            ctx.inputs = xs
            return xs[3].clone(), xs[-1].clone()

        @staticmethod
        def backward(ctx: Any, do: Any, dht: Any) -> Any:
            g = [torch.empty_like(t) for t in ctx.inputs]
            g[3].copy_(do)
            return tuple(g)

    def op(xl: Mapping[str, Any], cu: Any = None) -> Any:
        return Floor.apply(*[xl[n] for n in INPUTS if xl.get(n) is not None])

    return op


def graphed_fwd_bwd(op: Op, xl: Mapping[str, Any], do: Any, dht: Any, cu: Any = None) -> Callable[[], Any]:
    """forward+backward as step_closures times it, through torch.cuda.make_graphed_callables: the op's forward
    and backward each captured once and replayed, the inputs and gradients copied through the graphs' buffers
    (how a host-bound training step takes the host out of the loop)."""
    import torch

    names = [n for n in INPUTS if xl.get(n) is not None]
    leaves = [xl[n] for n in names]

    class Call(torch.nn.Module):
        def forward(self, *xs: Any) -> Any:
            return op(dict(zip(names, xs)), cu)

    sample = tuple(t.detach().clone().requires_grad_(True) for t in leaves)
    graphed = torch.cuda.make_graphed_callables(Call(), sample)

    def fwd_bwd() -> Any:
        return torch.autograd.grad(graphed(*leaves), leaves, (do, dht))

    return fwd_bwd


def reference(x: Mapping[str, Any], do: Any, dht: Any, lengths: Sequence[int] | None = None,
              scale: float = 1.0, grads: bool = True) -> dict[str, Any]:
    """float64 ground truth of fwd_bwd on the inputs' device, from dplr_gen.reference.naive_dplr_delta_rule.

    Dense batches are folded into heads ([B, T, H] -> [1, T, B*H]) so the step loop runs once, not B times."""
    import torch

    from dplr_gen.reference import naive_dplr_delta_rule

    names = [n for n in INPUTS if x.get(n) is not None]
    x64 = {n: x[n].detach().double().requires_grad_(grads) for n in names}
    B, T, H, K = x64["r"].shape
    V = x64["v"].shape[-1]
    fold = lengths is None and B > 1

    def f(t: torch.Tensor) -> torch.Tensor:
        return t.transpose(0, 1).reshape(1, T, B * H, t.shape[-1]) if fold else t

    h0 = x64.get("h0")
    if fold and h0 is not None:
        h0 = h0.reshape(1, B * H, K, V)
    cu = None if lengths is None else torch.tensor(cu_seqlens_of(lengths), device=x64["r"].device)
    with torch.set_grad_enabled(grads):
        o, ht = naive_dplr_delta_rule(f(x64["r"]), f(x64["k"]), f(x64["v"]), f(x64["a"]), f(x64["b"]),
                                      f(x64["w"]), scale, h0, True, cu)
        if fold:
            o, ht = o.reshape(T, B, H, V).transpose(0, 1), ht.reshape(B, H, K, V)
        out = {"o": o.detach(), "ht": ht.detach()}
        if grads:
            g = torch.autograd.grad((o, ht), [x64[n] for n in names], (do.double(), dht.double()))
            out.update({"d" + n: t for n, t in zip(names, g)})
    return out


def one_step_reference(q: Any, k: Any, v: Any, a: Any, b: Any, gk: Any, h0: Any, scale: float) -> tuple[Any, Any]:
    """Vectorised float64 decode step (T = 1): S = exp(g) S0 + b (a^T S0) + k v^T, o = scale S^T q."""
    import torch

    q, k, v, a, b, gk = (t[:, 0].double() for t in (q, k, v, a, b, gk))  # [N, H, K]
    S0 = h0.double()
    u = torch.einsum("nhk,nhkv->nhv", a, S0)
    S = gk.exp()[..., None] * S0 + b[..., None] * u[:, :, None, :] + k[..., None] * v[:, :, None, :]
    return (scale * torch.einsum("nhk,nhkv->nhv", q, S))[:, None], S


def rel_err(x: Any, ref: Any) -> float:
    """dplr_gen.testing.rel_err (||x - ref|| / ||ref|| in float64, inf if x is not finite), computed on the
    tensors' device: the decode check compares 5e8-element states."""
    x64, r64 = x.detach().double(), ref.detach().double().to(x.device)
    if not bool(x64.isfinite().all()):
        return float("inf")
    den = float(r64.norm())
    return float((x64 - r64).norm()) / (den if den > 0 else 1.0)


def errors(got: Mapping[str, Any], ref: Mapping[str, Any]) -> dict[str, float]:
    return {n: rel_err(got[n], ref[n]) for n in QUANTITIES if n in got and n in ref}


def all_finite(got: Mapping[str, Any]) -> dict[str, bool]:
    import torch

    return {n: bool(torch.isfinite(t).all().item()) for n, t in got.items()}


def cached(cache_dir: str | None, key: str, make: Callable[[], dict[str, Any]], device: Any) -> dict[str, Any]:
    """``make()`` (a dict of tensors), stored under cache_dir so that another worker process reuses it."""
    import torch

    if not cache_dir:
        return make()
    path = Path(cache_dir) / (key.replace(":", "_").replace("/", "_") + ".pt")
    if path.exists():
        return torch.load(path, map_location=device)
    value = make()
    tmp = path.with_suffix(".tmp")
    torch.save(value, tmp)
    os.replace(tmp, path)
    return value


def free(device: Any) -> None:
    import torch

    gc.collect()
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def sync(device: Any) -> None:
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------------------------------------
# timing, memory, floor


def bench_ms(fn: Callable[[], Any], device: Any, warmup: int = 25, rep: int = 100) -> float:
    """Median ms: triton.testing.do_bench (CUDA events, L2 flushed between calls) on a GPU; on CPU (dry runs)
    the median wall time of two calls."""
    if str(device).startswith("cuda"):
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
    ts = []
    for _ in range(2):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return sorted(ts)[len(ts) // 2]


def peak_bytes(fn: Callable[[], Any], device: Any) -> int | None:
    """Memory one call adds at its peak: max_memory_allocated() during fn minus memory_allocated() before it.
    Whatever is alive before the call (inputs, cotangents) is excluded; what the call allocates (outputs,
    saved tensors, workspace, gradients) is included. None on CPU."""
    import torch

    if not str(device).startswith("cuda"):
        return None
    free(device)
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated() - base)


def bytes_moved(B: int, T: int, H: int, K: int, V: int, N: int, elt: int = 2, state_elt: int = 4) -> dict[str, int]:
    """Least DRAM traffic: forward reads r, w, k, v, a, b and h0 once and writes o and ht once; the backward
    reads the six inputs, h0, do and dht once and writes the seven gradients once."""
    tok = B * T * H
    inputs = tok * (5 * K + V) * elt
    o = tok * V * elt
    state = N * H * K * V * state_elt
    fwd = inputs + o + 2 * state
    bwd = inputs + o + inputs + 3 * state  # inputs + do read, grads written; h0 + dht read, dh0 written
    return {"fwd": fwd, "fwd_bwd": fwd + bwd}


def floor_ms(nbytes: int, bandwidth: float = HBM_BYTES_PER_S) -> float:
    return nbytes / bandwidth * 1e3


# ----------------------------------------------------------------------------------------------------------
# parent <-> worker


def emit(job: str, **result: Any) -> None:
    """A worker's answer for one job: one line on stdout."""
    print(RESULT_TAG + json.dumps(jsonable({"job": job, **result}), allow_nan=False), flush=True)


def worker_loop(jobs: Sequence[str], run: Callable[[str], dict[str, Any]], device: str) -> int:
    """A worker's main loop: one RESULT per job, errors included. If the device is unusable after a job (a
    sticky CUDA error such as an illegal address), exit with CONTEXT_LOST_RC: the parent starts a fresh worker
    for the remaining jobs."""
    for job in jobs:
        print(f"[{time.strftime('%H:%M:%S')}] {job}", flush=True)
        try:
            emit(job, **run(job))
        except Exception as e:  # noqa: BLE001 - one failing job must not stop the others
            emit(job, **error_record(e))
        try:
            free(device)
        except Exception as e:  # noqa: BLE001
            print(f"device unusable after {job} ({type(e).__name__}: {e}); restarting", file=sys.stderr, flush=True)
            return CONTEXT_LOST_RC
    return 0


def error_record(e: BaseException) -> dict[str, Any]:
    import traceback

    return {"error": f"{type(e).__name__}: {e}"[:2000], "traceback": traceback.format_exc()[-3000:]}


def _pump(stream: Any, tag: str, into: queue.Queue[tuple[str, str | None]]) -> None:
    for line in stream:
        into.put((tag, line))
    into.put((tag, None))


def run_jobs(
    cmd: Sequence[str], jobs: Sequence[str], deadline: float, env: Mapping[str, str] | None = None,
    log: Callable[[str], None] = print, min_left: float = 3.0,
) -> dict[str, dict[str, Any]]:
    """Run ``cmd + ["--jobs", "j1,j2,..."]`` until every job has a RESULT or the deadline (time.time()) passes.

    A worker that exits or is killed (at the deadline) before answering a job gets that job recorded as an
    error with the tail of its stderr; a new worker is started for the jobs after it while time is left.
    Worker stdout lines that are not results, and its stderr, are passed to ``log``.
    """
    results: dict[str, dict[str, Any]] = {}
    pending = list(jobs)
    while pending:
        if deadline - time.time() < min_left:
            for j in pending:
                results[j] = {"job": j, "error": "not run: time budget spent"}
            break
        t0, answered_before = time.time(), len(results)
        p = subprocess.Popen([*cmd, "--jobs", ",".join(pending)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=None if env is None else dict(env), bufsize=1, start_new_session=True)
        lines: queue.Queue[tuple[str, str | None]] = queue.Queue()
        tail: deque[str] = deque(maxlen=40)

        for stream, tag in ((p.stdout, "out"), (p.stderr, "err")):
            threading.Thread(target=_pump, args=(stream, tag, lines), daemon=True).start()
        open_streams, timed_out = 2, False
        while open_streams:
            try:
                tag, line = lines.get(timeout=max(0.05, deadline - time.time()))
            except queue.Empty:
                timed_out = True
                try:  # our own worker and what it started (compile pools): its own session, by its id
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                break
            if line is None:
                open_streams -= 1
            elif tag == "out" and line.startswith(RESULT_TAG):
                r = json.loads(line[len(RESULT_TAG):])
                if r.get("job") in pending:
                    pending.remove(r["job"])
                    results[r["job"]] = r
            else:
                if tag == "err":
                    tail.append(line.rstrip())
                log(("  | " if tag == "out" else "  ! ") + line.rstrip())
        rc = p.wait()
        if pending and rc == CONTEXT_LOST_RC and not timed_out and len(results) > answered_before:
            continue  # the job that broke the device has its answer: a fresh worker takes the rest
        if pending:
            j = pending.pop(0)
            why = (f"timed out (deadline) after {time.time() - t0:.0f} s in this worker" if timed_out
                   else f"worker exited with code {rc}" + (f" (signal {-rc})" if rc < 0 else ""))
            results[j] = {"job": j, "error": f"worker died: {why}", "stderr_tail": "\n".join(tail)[-3000:]}
    return results


LAST_DIR = Path.home() / ".cache" / "dplr-gen-bench"  # a copy of each script's latest JSON, for --resume last


# what an earlier run must share with this one for its results to stand beside this run's (--resume); where only
# dplr-gen's source differs, the peers' results stand and dplr-gen's jobs run again
RESUME_MATCH = ("gpu", "driver", "torch", "triton", "fla_core", "dplr_gen_source_sha")


def dplr_job(job: str) -> bool:
    """Whether a job (kind:system:...) times or checks dplr-gen, not a peer."""
    return any(part.startswith("dplr") for part in job.split(":")[1:])


def load_resume(path: str | None, script: str = "", machine: Mapping[str, Any] | None = None,
                ) -> dict[str, dict[str, Any]]:
    """Job results without an error from an earlier run's JSON ("results" key): they are not run again.
    ``path`` "last" means this machine's copy of the script's previous JSON (kept while the machine is). With
    ``machine`` (this run's machine_info), an earlier run on another GPU, driver or library release (RESUME_MATCH)
    resumes nothing: its numbers would not compare with this run's; one of another dplr-gen source resumes the
    peers' jobs only."""
    if not path:
        return {}
    if path == "last":
        last = LAST_DIR / f"{script}_last.json"
        if not last.exists():
            print(f"--resume last: no {last}; starting afresh", flush=True)
            return {}
        path = str(last)
    data = json.loads(Path(path).read_text())
    keep: Callable[[str], bool] = lambda job: True  # noqa: E731
    if machine is not None:
        then = data.get("machine", {})
        differ = [k for k in RESUME_MATCH if then.get(k) != machine.get(k)]
        why = "; ".join(f"{k} {then.get(k)!r} -> {machine.get(k)!r}" for k in differ)
        if differ == ["dplr_gen_source_sha"]:
            print(f"--resume {path}: the peers' results only (dplr-gen's source differs: {why})", flush=True)
            keep = lambda job: not dplr_job(job)  # noqa: E731
        elif differ:
            print(f"--resume {path}: not resumed, the earlier run differs ({why})", flush=True)
            return {}
    return {j: {**r, "resumed_from": r.get("resumed_from", path)} for j, r in data.get("results", {}).items()
            if "error" not in r and keep(j)}


def worker_cmd(script: Path, config: Mapping[str, Any]) -> list[str]:
    return [sys.executable, str(script), "--worker", json.dumps(jsonable(config))]


def worker_env(device: str, extra: Mapping[str, str] | None = None, allow_jit: bool = False) -> dict[str, str]:
    """The workers' environment: the repo importable, and DPLR_GEN_NO_JIT=1 unless allow_jit, so that every
    dplr-gen number comes from the prebuilt kernels (a missing build is an error, not a silent compile)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if not allow_jit:
        env["DPLR_GEN_NO_JIT"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    env.update(extra or {})
    return env


def worker_setup(device: str) -> None:
    """In a worker, before kernels run: CPU dry runs use Triton's interpreter, with the runtime's numpy shim."""
    if device != "cpu":
        return
    os.environ["TRITON_INTERPRET"] = "1"
    from dplr_gen.runtime.loader import interpreter_numpy_compat

    interpreter_numpy_compat()


def dry_run_package(spec: str = "specs/hopper.yaml") -> str:
    """Render (no compile) a spec into a temporary folder: the interpreter runs its sources on CPU."""
    import tempfile

    from dplr_gen.toolchain import build

    p = build.plan(REPO / spec, Path(tempfile.mkdtemp(prefix="dplr-dry-")))
    build.write_package(p)
    return str(p.out_dir)


def deadline_from(args: Any) -> float:
    return float(args.deadline) if getattr(args, "deadline", None) else time.time() + float(args.budget)


# ----------------------------------------------------------------------------------------------------------
# output


def fmt(x: Any, spec: str = ".3g") -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, (int, float)):
        return format(x, spec)
    return str(x)


def format_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], title: str = "") -> str:
    """A plain fixed-width table (logs and terminals alike); cells are formatted with fmt."""
    body = [[fmt(c) for c in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in body]) for i, h in enumerate(headers)]
    line = "  ".join("-" * w for w in widths)
    out = [title] if title else []
    out += ["  ".join(h.ljust(w) for h, w in zip(headers, widths)), line]
    out += ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in body]
    return "\n".join(out)


@dataclass
class Report:
    """The JSON document a script writes (again after every step, so a killed run still leaves one)."""

    path: Path
    data: dict[str, Any] = field(default_factory=dict)
    script: str = ""  # also keep LAST_DIR/<script>_last.json, for --resume last

    def save(self) -> None:
        write_json(self.path, self.data)
        if self.script:
            try:
                LAST_DIR.mkdir(parents=True, exist_ok=True)
                write_json(LAST_DIR / f"{self.script}_last.json", self.data)
            except OSError:
                pass


if __name__ == "__main__":
    print(source_digest())
