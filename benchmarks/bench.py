"""dplr-gen vs fla-core chunk_rwkv7 on one GPU: speed, memory, accuracy, cold start.

    python benchmarks/bench.py [--shapes 4x4096x32x64,varlen] [--systems dplr-fast,fla-best] [--quick] [--cold]

Systems (benchmarks/common.py): dplr-fast (lower_bound=-0.61), dplr-generic (defaults), fla-best (chunk_size=64,
lower_bound=-0.61), fla-default. Each system runs in its own worker process, one shape at a time.
Per (shape, system), bf16, RWKV-7 inputs with a random initial state, output_final_state=True:
  fwd ms       forward with inputs requiring grad (training forward), do_bench median;
  fwd+bwd ms   forward + torch.autograd.grad of <o, do> + <ht, dht> w.r.t. r, w, k, v, a, b, h0 (no .grad
               accumulation, no loss kernel);
  peak GB      max_memory_allocated during one fwd+bwd minus memory_allocated before it (inputs and
               cotangents excluded; outputs, saved tensors, workspace and gradients included);
  x floor      measured / (least bytes moved / 3.0 TB/s), see common.bytes_moved;
  vs fla-best  measured / fla-best's measurement in the same run.
Accuracy: B=1, T=512, H=2, D=64, relative-norm error of o, ht and every gradient vs the float64 reference.
Cold start (--cold): a fresh process (empty TRITON_CACHE_DIR; DPLR_GEN_NO_JIT=1 for dplr-gen) that imports,
builds inputs, runs the first fwd+bwd and exits, wall clock; fla gets --cold-timeout seconds (default 240).
Writes $OUT/bench_<date>.json (again after every worker) and $OUT/bench_<date>.png. fla autotunes its kernels
on first use (5-10 minutes a shape on an H100); scripts/run_gpu.sh restores its choices from an earlier run on
the same machine type (benchmarks/fla_autotune/), recorded in the JSON's config.fla_autotune_seed.
--device cpu (TRITON_INTERPRET=1) or --dry-run runs the same control flow on tiny fp32 shapes.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common as C  # noqa: E402

SCRIPT = Path(__file__).resolve()
VARLEN = C.Shape(1, 32768, 32, 64, C.mixed_lengths(16, 32768, seed=0), name="varlen16x32768x32x64")
DENSE_EQUIV = C.Shape(1, 32768, 32, 64)  # the varlen case's tokens as one dense sequence
DENSE_BATCH = C.Shape(16, 2048, 32, 64)  # ... and as 16 dense sequences of their mean length (as much parallelism)
# the varlen case against each dense twin, same system: key of the ratio in the speed rows -> twin
DENSE_TWINS = {"dense_equiv": DENSE_EQUIV, "dense_batch": DENSE_BATCH}
# the call forms users have: 11 sequences of 512-8192 tokens (multiples of 16, so the CUDA kernel runs too) and 8
# ragged ones (lengths not multiples of 16), with cu_seqlens in int64 (fla-core's type hint) or int32, reused by
# every call (every layer of a model), new each step (a data loader's) with the same values, or new each step
# with new values (the same lengths in another order: a data loader's next batch)
LENGTHS11 = C.LENGTHS11
RAGGED8 = (1000, 2047, 3333, 517, 4099, 1234, 5001, 1873)
CALL_FORMS = tuple(
    C.Shape(1, sum(lens), 32, 64, lens, name=name, cu_dtype=dt, fresh_cu=fresh, reordered_cu=reordered)
    for name, lens in (("varlen11x32768x32x64", LENGTHS11), ("ragged8x19104x32x64", RAGGED8))
    for dt, fresh, reordered in (("int64", False, False), ("int32", False, False), ("int64", True, False),
                                 ("int64", True, True))
)
# shapes whose work is bound by the host: their wall time is compared with their device time (CUDA graph replay)
HOST_BOUND = C.Shape(1, 4096, 2, 128)
# the default run: the dense shapes, the host-bound one and the varlen call forms
SHAPES: dict[str, C.Shape] = {
    s.label: s for s in (
        C.Shape(4, 4096, 32, 64), C.Shape(8, 4096, 64, 64), C.Shape(8, 2048, 16, 128), HOST_BOUND, *CALL_FORMS,
    )
}
# more by name: the varlen case beside its dense twins (--shapes varlen,1x32768x32x64,16x2048x32x64)
PRESETS = {**SHAPES, **{s.label: s for s in (VARLEN, DENSE_EQUIV, DENSE_BATCH)}, "varlen": VARLEN}
# decode steps (T = 1, state in and out, no gradient): the small model's heads at these batch sizes
DECODE_BATCHES = (1, 64, 512)
DECODE_H, DECODE_D = 32, 64
# decode forms: fused_recurrent_rwkv7 (a, b given) and fused_mul_recurrent_rwkv7 (kk, a given: fla's RWKV-7
# layer's decoding call); dplr-gen's also with a state pool (ssm_state_indices, states read and written in place)
DECODE_FORMS = {"dplr": ("fused", "mul", "pool"), "fla": ("fused", "mul")}
DRY_SHAPES = [C.Shape(1, 64, 1, 64), C.Shape(1, 64, 1, 64, (20, 1, 43), name="varlen3x64x1x64"),
              C.Shape(1, 64, 1, 64, (20, 1, 43), name="varlen3x64x1x64", cu_dtype="int64", fresh_cu=True,
                      reordered_cu=True)]
ACC_SHAPE, DRY_ACC_SHAPE = C.Shape(1, 512, 2, 64), C.Shape(1, 32, 1, 64)
SEED = 1234


# ----------------------------------------------------------------------------------------------------------
# worker side

# what a cold-start job reports (besides finite/error); the parent adds wall_s
COLD_FIELDS = ("load_s", "inputs_s", "first_fwd_s", "first_bwd_s", "first_fwd_bwd_s", "sympy_imported")


class Worker:
    def __init__(self, cfg: dict[str, Any]) -> None:
        import torch

        self.cfg, self.device = cfg, cfg["device"]
        self.dtype = getattr(torch, cfg["dtype"])
        self.ops: dict[str, Any] = {}

    def op(self, name: str, shape: C.Shape | None = None) -> tuple[Any, dict[str, Any]]:
        system = C.SYSTEMS[name]
        # the CUDA peer is built per head size and for dense or varlen inputs
        key = (name, shape.D, shape.lengths is not None) if system.impl == "wind" and shape else name
        if key not in self.ops:
            try:
                self.ops[key] = C.load_op(system, self.cfg["package"], shape.D if shape else None,
                                          bool(shape and shape.lengths is not None))
            except Exception as e:  # remembered: every job of this system reports the same error
                self.ops[key] = e
        if isinstance(self.ops[key], Exception):
            raise self.ops[key]
        return self.ops[key]

    def inputs(self, shape: C.Shape, seed: int) -> dict[str, Any]:
        return C.rwkv7_case(shape.B, shape.T, shape.H, shape.D, dtype=self.dtype, device=self.device, seed=seed,
                            n_states=shape.N)

    def first_call(self, system: str, shape: C.Shape, seed: int = SEED, loss_backward: bool = False) -> dict[str, Any]:
        """Inputs, cotangents, and the first fwd+bwd (timed, wall clock); ``loss_backward``: the backward as a
        training loop calls it (see C.fwd_loss_backward), the forward timed apart."""
        t0 = time.perf_counter()
        sysinfo = C.SYSTEMS[system]
        if sysinfo.impl == "wind" and shape.lengths is not None and any(n % 16 for n in shape.lengths):
            raise ValueError("not supported by this system: every sequence length must be a multiple of 16")
        op, info = self.op(system, shape)
        t1 = time.perf_counter()
        x = self.inputs(shape, seed)
        do, dht = C.grad_outputs(x, seed)
        sums = C.checksums(x)  # of the inputs as drawn (a system's own form is derived from them)
        x, do, dht = C.native_inputs(sysinfo, x, do, dht)
        # the call form: cu_seqlens alone, in the shape's dtype (no host copy passed: users' calls)
        cu, cu_cpu = C.cu_tensors(shape.lengths, shape.cu_dtype or sysinfo.cu_dtype, self.device)
        if sysinfo.impl == "dplr":  # which variant ran (e.g. gk read in bf16 or in fp32)
            info = {**info, "variant": C.dplr_variant(sysinfo, self.cfg["package"], x, cu)}
        xl = C.leaves(x)
        C.sync(self.device)
        t2 = time.perf_counter()
        if loss_backward:
            got, t_fwd = C.fwd_loss_backward(op, xl, do, dht, cu, sync=lambda: C.sync(self.device))
        else:
            got, t_fwd = C.fwd_bwd(op, xl, do, dht, cu), None
        C.sync(self.device)
        t3 = time.perf_counter()
        split = {} if t_fwd is None else {
            "first_fwd_s": t_fwd, "first_bwd_s": t3 - t2 - t_fwd, "sympy_imported": "sympy" in sys.modules}
        return {"op": op, "info": info, "x": xl, "do": do, "dht": dht, "cu": cu, "cu_cpu": cu_cpu, "got": got,
                "checksums": sums, "load_s": t1 - t0, "inputs_s": t2 - t1, "first_fwd_bwd_s": t3 - t2, **split}

    def run(self, job: str) -> dict[str, Any]:
        kind, system, *rest = job.split(":")
        if kind == "acc":
            return self.accuracy(system)
        if kind == "decode":
            return self.decode(system, int(rest[0]))
        shape = parse_shape_any(rest[0])
        if kind == "speed":
            return self.speed(system, shape)
        if kind == "cold":
            s = self.first_call(system, shape, loss_backward=True)
            return {k: s[k] for k in COLD_FIELDS if k in s} | {"finite": all(C.all_finite(s["got"]).values())}
        raise ValueError(f"unknown job {job!r}")

    def accuracy(self, system: str) -> dict[str, Any]:
        shape = DRY_ACC_SHAPE if self.cfg["dry_run"] else ACC_SHAPE
        s = self.first_call(system, shape, seed=SEED + 1)
        ref = C.cached(self.cfg.get("cache_dir"), f"acc_ref_{shape.label}_{self.cfg['dtype']}",
                       lambda: C.reference(s["x"], s["do"], s["dht"]), self.device)
        return {"shape": shape.label, "errors": C.errors(s["got"], ref), "checksums": C.checksums(s["x"]),
                "info": s["info"]}

    def speed(self, system: str, shape: C.Shape) -> dict[str, Any]:
        import torch

        s = self.first_call(system, shape)
        op, x, do, dht, cu, cu_cpu = (s[k] for k in ("op", "x", "do", "dht", "cu", "cu_cpu"))
        finite = all(C.all_finite(s["got"]).values())
        del s["got"]
        warmup, rep = self.cfg["warmup"], self.cfg["rep"]
        # the reordered form: every call copies the next of these host tensors (new boundary values each call)
        cycle = [torch.tensor(b, dtype=cu_cpu.dtype) for b in shape.cu_orders()] if shape.reordered_cu else []
        fwd, fwd_bwd = C.step_closures(op, x, do, dht, cu, cu_cpu, fresh_cu=shape.fresh_cu, cu_cycle=cycle)
        fwd_ms = C.bench_ms(fwd, self.device, warmup, rep)
        fb_ms = C.bench_ms(fwd_bwd, self.device, warmup, rep)
        peak = C.peak_bytes(fwd_bwd, self.device)
        out = {"fwd_ms": fwd_ms, "fwd_bwd_ms": fb_ms, "peak_bytes": peak, "first_fwd_bwd_s": s["first_fwd_bwd_s"],
               "finite": finite, "checksums": s["checksums"], "info": s["info"]}
        if shape.label == HOST_BOUND.label and self.device == "cuda":
            out.update(self.host_bound(op, x, do, dht, cu, fwd_bwd))
        return out

    def host_bound(self, op: Any, x: dict[str, Any], do: Any, dht: Any, cu: Any, fwd_bwd: Any) -> dict[str, Any]:
        """Wall time per call of calls back to back (host and device together) against the device's own time
        (the call replayed from a CUDA graph, whose outputs must equal the eager call's), torch's own floor for
        an op of this form, and the call through torch.cuda.make_graphed_callables."""
        out: dict[str, Any] = {"wall_fwd_bwd_ms": C.wall_ms(fwd_bwd, self.device)}
        eager = fwd_bwd()
        try:
            ms, replayed, graph = C.graph_ms(fwd_bwd, self.device)
            for t in replayed:  # what the replay writes, not what the capture's own run left there
                t.fill_(float("nan"))
            graph.replay()
            C.sync(self.device)
            diff = C.max_diff(eager, replayed)
            # not equal (NaN included): e.g. kernels launched outside the captured stream, whose time the replay's
            # is not
            if not diff == 0:
                out["graph_error"] = f"the replay's outputs differ from the eager call's by up to {diff:.3g}"
            else:
                out["graph_fwd_bwd_ms"] = ms
        except Exception as e:  # noqa: BLE001 - recorded: a system whose call cannot be captured
            out["graph_error"] = f"{type(e).__name__}: {e}"[:300]
        floor_fb = C.step_closures(C.floor_op(), x, do, dht)[1]
        out["torch_floor_wall_ms"] = C.wall_ms(floor_fb, self.device)
        try:
            graphed = C.graphed_fwd_bwd(op, x, do, dht, cu)
            out["graphed_max_diff"] = C.max_diff(eager, graphed())
            out["graphed_wall_fwd_bwd_ms"] = C.wall_ms(graphed, self.device)
        except Exception as e:  # noqa: BLE001 - recorded: a system whose call make_graphed_callables refuses
            out["graphed_error"] = f"{type(e).__name__}: {e}"[:300]
        return out

    def decode(self, system: str, B: int) -> dict[str, Any]:
        """One decode step (T = 1, no gradient) of ``system`` = <impl>-<form>: do_bench median, wall time per
        call of calls back to back, the step replayed in a CUDA graph, and the replay's outputs against eager."""
        import torch

        impl, form = system.split("-")
        H, D = (1, 64) if self.cfg["dry_run"] else (DECODE_H, DECODE_D)
        x = C.rwkv7_case(B, 1, H, D, dtype=self.dtype, device=self.device, seed=SEED + B)
        kk, rate = -x["a"], torch.rand_like(x["a"])  # RWKV-7's kk (normalised) and in-context rate
        if impl == "dplr":
            from dplr_gen.runtime import ops
            from dplr_gen.runtime.loader import package_at

            kw: dict[str, Any] = {"package": package_at(self.cfg["package"])}
            fused, mul = ops.fused_recurrent_rwkv7, ops.fused_mul_recurrent_rwkv7
        else:
            try:
                from fla.ops.rwkv7 import fused_mul_recurrent_rwkv7 as mul, fused_recurrent_rwkv7 as fused
            except Exception as e:  # noqa: BLE001
                raise ImportError(f"fla not available: {type(e).__name__}: {e}") from e
            kw = {}
        state = x["h0"]
        if form == "pool":  # B live sequences in a pool of 2 B slots, every other slot
            pool = torch.zeros(2 * B, H, D, D, device=self.device)
            idx = torch.arange(0, 2 * B, 2, device=self.device, dtype=torch.int32)
            pool[idx.long()] = state
            kw = {**kw, "ssm_state_indices": idx}
            state = pool

        def step() -> Any:
            if form == "fused":
                return fused(x["r"], x["w"], x["k"], x["v"], x["a"], x["b"], scale=1.0, initial_state=state,
                             output_final_state=True, **kw)
            return mul(x["r"], x["w"], x["k"], x["v"], kk, rate, scale=1.0, initial_state=state,
                       output_final_state=True, **kw)

        with torch.inference_mode():
            o_eager = step()[0].clone()
            out: dict[str, Any] = {"B": B, "H": H, "D": D}
            if form == "pool":
                pool.copy_(state)  # (the steps above advanced the pool; timing needs no reset)
            out["bench_ms"] = C.bench_ms(step, self.device, self.cfg["warmup"], self.cfg["rep"])
            out["wall_ms"] = C.wall_ms(step, self.device, n=2 if self.cfg["dry_run"] else 200)
            try:
                if self.device != "cuda":
                    raise RuntimeError("no CUDA graphs on this device")
                before = state.clone()
                out["graph_ms"], got, graph = C.graph_ms(step, self.device)
                # a replay from a known state gives what the eager step from that state gives
                state.copy_(before)
                graph.replay()
                replayed = got[0].clone()
                state.copy_(before)
                out["graph_replay_matches"] = bool(torch.equal(replayed, step()[0]))
                state.copy_(before)
            except Exception as e:  # noqa: BLE001 - recorded: a form that cannot be captured
                out["graph_error"] = f"{type(e).__name__}: {e}"[:300]
            out["finite"] = bool(torch.isfinite(o_eager).all())
        return out


def worker_main(cfg: dict[str, Any], jobs: list[str]) -> int:
    C.worker_setup(cfg["device"])
    return C.worker_loop(jobs, Worker(cfg).run, cfg["device"])


def parse_shape_any(label: str) -> C.Shape:
    for s in [*SHAPES.values(), *DRY_SHAPES, ACC_SHAPE, DRY_ACC_SHAPE]:
        if s.label == label:
            return s
    return C.parse_shape(label, PRESETS)


# ----------------------------------------------------------------------------------------------------------
# parent side: plan, run, summarise


def summarise(results: dict[str, dict[str, Any]], shapes: list[C.Shape], systems: list[str], dtype_bytes: int = 2
              ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    """Rows of the speed table (with floors and ratios to fla-best), rows of the cold-start table, accuracy."""
    speed = []
    for sh in shapes:
        b = C.bytes_moved(sh.B, sh.T, sh.H, sh.D, sh.D, sh.N, elt=dtype_bytes)
        floor = {k: C.floor_ms(v) for k, v in b.items()}
        base = results.get(f"speed:{C.BASELINE}:{sh.label}", {})
        for sysname in systems:
            r = results.get(f"speed:{sysname}:{sh.label}", {"error": "not run"})
            row: dict[str, Any] = {"shape": sh.label, "system": sysname, "error": r.get("error"),
                                   "floor_fwd_ms": floor["fwd"], "floor_fwd_bwd_ms": floor["fwd_bwd"],
                                   "bytes_fwd": b["fwd"], "bytes_fwd_bwd": b["fwd_bwd"]}
            for k in ("fwd_ms", "fwd_bwd_ms", "peak_bytes", "first_fwd_bwd_s", "finite", "wall_fwd_bwd_ms",
                      "graph_fwd_bwd_ms", "graph_error", "torch_floor_wall_ms", "graphed_wall_fwd_bwd_ms",
                      "graphed_max_diff", "graphed_error"):
                row[k] = r.get(k)
            g = row["graph_fwd_bwd_ms"]
            for k, w in (("wall_vs_device", row["wall_fwd_bwd_ms"]), ("floor_vs_device", row["torch_floor_wall_ms"]),
                         ("graphed_vs_device", row["graphed_wall_fwd_bwd_ms"])):
                row[k] = w / g if isinstance(w, (int, float)) and isinstance(g, (int, float)) else None
            for k, f in (("fwd_ms", "fwd"), ("fwd_bwd_ms", "fwd_bwd")):
                row[f"x_floor_{f}"] = row[k] / floor[f] if isinstance(row[k], (int, float)) else None
                bv = base.get(k)
                ok = isinstance(row[k], (int, float)) and isinstance(bv, (int, float))
                row[f"vs_fla_best_{f}"] = row[k] / bv if ok else None
            speed.append(row)
    for key, twin in DENSE_TWINS.items():  # varlen vs the same tokens as dense sequences, same system
        dense = {r["system"]: r for r in speed if r["shape"] == twin.label}
        for r in speed:
            d = dense.get(r["system"], {}) if r["shape"] == VARLEN.label else {}
            for f in ("fwd", "fwd_bwd"):
                a, b = r.get(f"{f}_ms"), d.get(f"{f}_ms")
                r[f"vs_{key}_{f}"] = a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) else None
    cold = []
    for key, r in results.items():
        if key.startswith("cold:"):
            _, sysname, label = key.split(":")
            cold.append({"system": sysname, "shape": label, **{k: r.get(k) for k in (
                "wall_s", *COLD_FIELDS, "finite", "error")}})
    acc = {s: results.get(f"acc:{s}", {"error": "not run"}) for s in systems if C.SYSTEMS[s].impl != "wind"}
    return speed, cold, acc


def decode_rows(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows of the decode table, each with its ratio to fla-core's same form at the same batch."""
    rows = []
    for key, r in results.items():
        if key.startswith("decode:"):
            _, system, B = key.split(":")
            rows.append({"system": system, "B": int(B), **{k: r.get(k) for k in (
                "bench_ms", "wall_ms", "graph_ms", "graph_replay_matches", "graph_error", "finite", "error")}})
    fla = {(r["system"].split("-")[1], r["B"]): r for r in rows if r["system"].startswith("fla-")}
    for r in rows:
        base = fla.get(("mul" if r["system"].endswith("pool") else r["system"].split("-")[1], r["B"]), {})
        for k in ("bench_ms", "wall_ms"):
            a, b = r.get(k), base.get(k)
            r[f"{k}_vs_fla"] = a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) else None
    return sorted(rows, key=lambda r: (r["B"], r["system"]))


def tables(speed: list[dict[str, Any]], cold: list[dict[str, Any]], acc: dict[str, Any], dtype: str = "bfloat16",
           decode: list[dict[str, Any]] | None = None) -> str:
    gb = lambda b: None if b is None else b / 1e9  # noqa: E731
    out = [C.format_table(
        ["shape", "system", "fwd ms", "fwd+bwd ms", "peak GB", "fwd/fla-best", "f+b/fla-best", "fwd/floor",
         "f+b/floor", "1st call s", "error"],
        [[r["shape"], r["system"], r["fwd_ms"], r["fwd_bwd_ms"], gb(r["peak_bytes"]), r["vs_fla_best_fwd"],
          r["vs_fla_best_fwd_bwd"], r["x_floor_fwd"], r["x_floor_fwd_bwd"], r["first_fwd_bwd_s"],
          (r["error"] or "")[:60]] for r in speed],
        title=f"speed ({dtype}, medians; floor = least bytes / 3.0 TB/s)")]
    out.append(C.format_table(
        ["system", *C.QUANTITIES, "error"],
        [[s, *[a.get("errors", {}).get(q) for q in C.QUANTITIES], (a.get("error") or "")[:60]] for s, a in acc.items()],
        title="accuracy vs float64 (relative norm error)"))
    for key, twin in DENSE_TWINS.items():
        what = "one dense sequence" if twin.B == 1 else f"{twin.B} dense sequences"
        ve = [f"{r['system']} {r[f'vs_{key}_fwd_bwd']:.2f}" for r in speed if r.get(f"vs_{key}_fwd_bwd")]
        if ve:
            out.append(f"varlen ({VARLEN.N} sequences) / the same tokens as {what}, fwd+bwd: " + ", ".join(ve))
    host = [r for r in speed if r.get("wall_vs_device") is not None or r.get("graph_error")]
    if host:
        out.append(C.format_table(
            ["shape", "system", "fwd+bwd wall ms", "device ms (graph replay)", "wall / device",
             "torch floor / device", "graphed wall / device", "graphed max diff", "error"],
            [[r["shape"], r["system"], r["wall_fwd_bwd_ms"], r["graph_fwd_bwd_ms"], r["wall_vs_device"],
              r["floor_vs_device"], r["graphed_vs_device"], r["graphed_max_diff"],
              (r.get("graph_error") or r.get("graphed_error") or "")[:60]] for r in host],
            title="host-bound shape: wall time of calls back to back against the device's time"))
    if decode:
        out.append(C.format_table(
            ["system", "B", "do_bench ms", "wall ms/call", "graph ms", "replay = eager", "do_bench/fla",
             "wall/fla", "error"],
            [[r["system"], r["B"], r["bench_ms"], r["wall_ms"], r["graph_ms"], r["graph_replay_matches"],
              r["bench_ms_vs_fla"], r["wall_ms_vs_fla"], (r.get("error") or r.get("graph_error") or "")[:50]]
             for r in decode],
            title=f"decode step (T = 1, H = {DECODE_H}, D = {DECODE_D}, state in and out, no gradient)"))
    if cold:
        out.append(C.format_table(
            ["system", "shape", "wall s", "import+load s", "inputs s", "1st fwd s", "1st bwd s", "1st fwd+bwd s",
             "error"],
            [[r["system"], r["shape"], r["wall_s"], r["load_s"], r["inputs_s"], r.get("first_fwd_s"),
              r.get("first_bwd_s"), r["first_fwd_bwd_s"], (r["error"] or "")[:60]] for r in cold],
            title="cold start (fresh process, empty Triton cache)"))
    return "\n\n".join(out)


def plot(speed: list[dict[str, Any]], path: Path, title: str) -> str | None:
    """Grouped bars of fwd+bwd ms (floor marked) and of the ratio to fla-best; returns an error or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"matplotlib not available: {e}"
    shapes = list(dict.fromkeys(r["shape"] for r in speed))
    systems = list(dict.fromkeys(r["system"] for r in speed))
    get = {(r["shape"], r["system"]): r for r in speed}
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 1.8 * len(shapes)), 8))
    width = 0.8 / max(1, len(systems))
    for panel, (ax, key, ylabel) in enumerate(zip(axes, ("fwd_bwd_ms", "vs_fla_best_fwd_bwd"),
                                                   ("fwd+bwd ms (log)", "fwd+bwd / fla-best"))):
        for j, sysname in enumerate(systems):
            xs = [i + (j - (len(systems) - 1) / 2) * width for i in range(len(shapes))]
            ys = [get.get((sh, sysname), {}).get(key) or 0 for sh in shapes]
            ax.bar(xs, ys, width, label=sysname)
        if panel == 0:
            ax.scatter(range(len(shapes)), [get[(sh, systems[0])]["floor_fwd_bwd_ms"] for sh in shapes],
                       marker="_", s=900, color="black", label="floor", zorder=3)
            ax.set_yscale("log")
        else:
            ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks(range(len(shapes)), shapes, rotation=15, fontsize=8)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
    axes[0].set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


# run in this order, fla-core last: its first call of a new form may autotune for minutes (int32 cu_seqlens on a
# machine whose autotune cache holds int64's choices: over 6 minutes on an H200), which must not take the others' time
DEFAULT_SYSTEMS = ("dplr-fast", "dplr-generic", "wind-cuda", "fla-best")


def job_groups(systems: list[str], shapes: list[C.Shape], args: Any, dry: bool) -> dict[str, list[str]]:
    """The jobs, grouped by the worker process that runs them: one per system, the CUDA peer one per head
    size (its extension is built for one), and the decode steps one per library."""
    groups: dict[str, list[str]] = {}
    if not args.no_decode:  # first: short, and host-bound (least disturbed by the compiles still going on)
        impls = {C.SYSTEMS[s].impl for s in systems}
        for impl, forms in DECODE_FORMS.items():
            if impl in impls:
                groups[f"{impl} decode"] = [f"decode:{impl}-{f}:{B}" for B in ((1, 2) if dry else DECODE_BATCHES)
                                            for f in forms]
    for sysname in systems:
        wind = C.SYSTEMS[sysname].impl == "wind"
        if not args.no_accuracy and not wind:
            groups.setdefault(sysname, []).append(f"acc:{sysname}")
        for sh in ([] if args.no_speed else shapes):
            groups.setdefault(f"{sysname} D={sh.D}" if wind else sysname, []).append(f"speed:{sysname}:{sh.label}")
    return groups


def input_group(job: str) -> str | None:
    """speed:<system>:<shape> jobs of one shape, and the acc:<system> jobs, must have seen the same tensors."""
    kind, _, *rest = job.split(":")
    return None if kind in ("cold", "decode") else ":".join([kind, *rest])


def cold_start(system: str, shape: C.Shape, cfg: dict[str, Any], timeout: float, log: Any) -> dict[str, Any]:
    """The first fwd+bwd of a fresh process with an empty Triton cache; dplr-gen may not compile anything."""
    job = f"cold:{system}:{shape.label}"
    extra = {"TRITON_CACHE_DIR": tempfile.mkdtemp(prefix="triton-cold-")}
    if C.SYSTEMS[system].impl == "dplr":
        extra["DPLR_GEN_NO_JIT"] = "1"
    t0 = time.time()
    r = C.run_jobs(C.worker_cmd(SCRIPT, cfg), [job], t0 + timeout, C.worker_env(cfg["device"], extra), log)[job]
    wall = time.time() - t0
    if "timed out" in str(r.get("error", "")):
        r["error"] = f"> {timeout:.0f} s (did not finish)"
    return {**r, "wall_s": wall, "timeout_s": timeout, "env": extra}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", help=f"comma list of BxTxHxD or presets ({', '.join(PRESETS)}); default all")
    ap.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS), help="comma list of " + ", ".join(C.SYSTEMS))
    ap.add_argument("--no-decode", action="store_true", help="skip the decode steps")
    ap.add_argument("--quick", action="store_true", help="first shape only (unless --shapes), do_bench warmup 10 / rep 30")
    ap.add_argument("--no-accuracy", action="store_true")
    ap.add_argument("--no-speed", action="store_true")
    ap.add_argument("--cold", action="store_true", help="also measure cold start (slow for fla)")
    ap.add_argument("--cold-shapes", default="4x4096x32x64")
    ap.add_argument("--cold-timeout", type=float, default=240.0)
    ap.add_argument("--budget", type=float, default=560.0, help="seconds for everything (default 560)")
    ap.add_argument("--deadline", type=float, help="absolute time.time() to finish by (overrides --budget)")
    ap.add_argument("--package", default=str(C.REPO / "generated" / "hopper"))
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--dry-run", action="store_true", help="CPU, interpreter, tiny fp32 shapes, rendered package")
    ap.add_argument("--resume", help="earlier bench JSON, or 'last' (this machine's previous run): "
                                     "its jobs without errors are reused")
    ap.add_argument("--allow-jit", action="store_true", help="let dplr-gen compile at run time (else DPLR_GEN_NO_JIT=1)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--jobs", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker_main(json.loads(args.worker), args.jobs.split(","))

    deadline = C.deadline_from(args)
    dry = args.dry_run or args.device == "cpu"
    device = "cpu" if dry else "cuda"
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in C.SYSTEMS]
    if unknown:
        ap.error(f"unknown systems {unknown}; known: {', '.join(C.SYSTEMS)}")
    if dry:
        shapes = DRY_SHAPES
        cold_shapes = DRY_SHAPES[:1]
    else:
        shapes = [C.parse_shape(s, PRESETS) for s in args.shapes.split(",")] if args.shapes else list(SHAPES.values())
        if args.quick and not args.shapes:
            shapes = shapes[:1]
        cold_shapes = [C.parse_shape(s, PRESETS) for s in args.cold_shapes.split(",")]
    package = C.dry_run_package() if dry else args.package
    cfg = {"device": device, "dtype": "float32" if dry else "bfloat16", "package": package, "dry_run": dry,
           "warmup": 10 if args.quick else 25, "rep": 30 if args.quick else 100,
           "cache_dir": tempfile.mkdtemp(prefix="dplr-bench-"),
           # fla's autotuning choices restored from an earlier run (scripts/run_gpu.sh), or None
           "fla_autotune_seed": C.fla_autotune_seed()}

    day = C.stamp()
    report = C.Report(C.out_dir() / f"bench_{day}.json", script="bench")
    machine = C.machine_info(device)
    results: dict[str, dict[str, Any]] = C.load_resume(args.resume, "bench", machine)
    report.data = {
        "machine": machine, "config": {**cfg, "shapes": [s.label for s in shapes], "systems": systems,
                                                     "varlen_lengths": list(VARLEN.lengths or ()), "argv": sys.argv[1:]},
        "systems": {s: {"label": C.SYSTEMS[s].label, "kwargs": dict(C.SYSTEMS[s].kwargs)} for s in systems},
        "definitions": DEFINITIONS,
        "results": results,
    }
    report.save()

    def log(line: str) -> None:
        print(line, flush=True)

    env = C.worker_env(device, allow_jit=args.allow_jit)
    for group, jobs in job_groups(systems, shapes, args, dry).items():
        jobs = [j for j in jobs if j not in results]
        if jobs:
            print(f"== {group}: {len(jobs)} job(s), {deadline - time.time():.0f} s left", flush=True)
            results.update(C.run_jobs(C.worker_cmd(SCRIPT, cfg), jobs, deadline, env, log))
            report.save()
    if args.cold:
        for sh in cold_shapes:
            for sysname in systems:
                job = f"cold:{sysname}:{sh.label}"
                left = deadline - time.time()
                if job in results:
                    continue
                if left < 10:
                    results[job] = {"job": job, "error": "not run: time budget spent"}
                    continue
                print(f"== cold start {sysname} {sh.label} (timeout {min(args.cold_timeout, left):.0f} s)", flush=True)
                results[job] = cold_start(sysname, sh, cfg, min(args.cold_timeout, left), log)
                report.save()

    speed, cold, acc = summarise(results, shapes, systems, dtype_bytes=4 if dry else 2)
    decode = decode_rows(results)
    report.data.update(speed=speed, cold=cold, accuracy=acc, decode=decode,
                       same_inputs=C.same_inputs(results, input_group))
    png = report.path.with_suffix(".png")
    m = report.data["machine"]
    report.data["png"] = plot(speed, png, f"chunk_rwkv7 {cfg['dtype']} fwd+bwd, {m.get('gpu', device)}, torch {m['torch']}, "
                                          f"Triton {m['triton']}, {m['date']}") or str(png)
    report.save()
    print("\n" + tables(speed, cold, acc, cfg["dtype"], decode))
    print(f"\nsame inputs across systems: {report.data['same_inputs']}")
    print(f"wrote {report.path}" + (f" and {png}" if png.exists() else f" ({report.data['png']})"))
    return 0


DEFINITIONS = {
    "fwd_ms": "forward with inputs requiring grad, output_final_state=True; triton.testing.do_bench median "
              "(CUDA events, L2 flushed), after a first call and do_bench's warm-up",
    "fwd_bwd_ms": "forward + torch.autograd.grad of <o,do> + <ht,dht> w.r.t. r,w,k,v,a,b,h0; do_bench median",
    "peak_bytes": "max_memory_allocated during one fwd+bwd minus memory_allocated just before it: inputs and "
                  "cotangents excluded; outputs, saved tensors, workspace and gradients included",
    "floor": "least bytes moved / 3.0 TB/s: fwd reads r,w,k,v,a,b,h0 and writes o,ht once; bwd reads "
             "r,w,k,v,a,b,h0,do,dht and writes the 7 gradients once",
    "vs_fla_best": "measured / fla-best measured in the same run (a result with resumed_from came from an earlier run)",
    "vs_dense_equiv": "varlen case / the same 32768 tokens as one dense sequence, same system",
    "vs_dense_batch": "varlen case / the same 32768 tokens as 16 dense sequences of 2048 (its mean length), same system",
    "accuracy": "relative norm error ||x - ref|| / ||ref|| vs the float64 step-by-step reference, B=1 T=512 H=2 D=64",
    "cold_start": "wall clock of a fresh process (import, inputs, first fwd+bwd, exit) with an empty TRITON_CACHE_DIR; "
                  "dplr-gen with DPLR_GEN_NO_JIT=1; in it, first_fwd_s and first_bwd_s: the first forward and the "
                  "first loss.backward() of <o,do> + <ht,dht> (the training-loop form; autograd.grad with "
                  "grad_outputs would import sympy, seconds of torch's own)",
    "call_forms": "varlen shapes name how cu_seqlens is passed: -int64 / -int32 its dtype, one tensor reused by "
                  "every call (every layer of a model), -fresh a new tensor copied from the host each call (a data "
                  "loader's), -reordered a new tensor each call holding other boundaries (the same lengths in "
                  "another order, cycling through 64 orders: a data loader's next batch, new values, the same "
                  "work); never cu_seqlens_cpu (fla's layer does not pass it)",
    "wall_fwd_bwd_ms": "host-bound shape: wall time per fwd+bwd of 50 calls back to back (synchronised before and "
                       "after; the median of 5 such runs); graph_fwd_bwd_ms: the same step captured in a CUDA "
                       "graph, median replay (device time; graph_error where the replay's outputs differ from "
                       "the eager call's); torch_floor_wall_ms: the same wall time of an autograd Function with the op's inputs and outputs and one copy "
                       "a direction (torch's own cost of such an op); graphed_wall_fwd_bwd_ms: the call through "
                       "torch.cuda.make_graphed_callables (forward and backward replayed, inputs and gradients "
                       "copied through the graphs' buffers), graphed_max_diff its largest difference from eager",
    "decode": "fused recurrent step, T=1, H=32, D=64, bf16 RWKV-7 inputs, fp32 state in and out, inference mode: "
              "bench_ms do_bench median; wall_ms per call of 200 back to back (median of 5 runs); graph_ms CUDA "
              "graph replay; "
              "graph_replay_matches: a replay from a saved state equals the eager step from it, bit for bit. "
              "Forms: fused (fused_recurrent_rwkv7, a and b given), mul (fused_mul_recurrent_rwkv7, kk and a given: "
              "fla's RWKV-7 layer's decoding call), pool (dplr-gen's mul form with ssm_state_indices into a pool of "
              "2B slots, states read and written in place)",
    "wind-cuda": "the hand-written CUDA kernel takes its own input form, made before timing: w as log(-w), h0 and "
                 "dht transposed to [V, K] and bf16; its accuracy is not measured here",
    "inputs": "RWKV-7: w in (-0.6065,0) log-decay (fla's w), a=-kk, b=kk*iclr, k*K^-0.5, h0=0.5 randn, scale=1; "
              "same seed -> same tensors for every system (checksums recorded); workers run with DPLR_GEN_NO_JIT=1",
}

if __name__ == "__main__":
    sys.exit(main())
