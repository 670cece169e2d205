"""The varlen backward's two stream choices timed against each other, per case, gate mode and call form.

    python benchmarks/varlen_streams.py [--cases ragged8,varlen11] [--systems dplr-fast,dplr-generic]
        [--forms int64,int64-fresh] [--rounds 4] [--budget 300] [--fla auto] [--package generated/hopper] [--dry-run]

A varlen chunk backward may run its states pass on a side stream beside the reverse pass
(``chunk_driver._overlap``) and its token pass as one launch per sequence, alternating between the current stream
and the side one (``chunk_driver.per_sequence_launches``). Where both run, the ragged sequences' forward+backward
has shown two modes from one measurement to the next (docs/design.md, "The ragged backward is bimodal"). This
script times every combination of the two choices, forced with ``chunk_driver.forced``, and the driver's own
rule, for the bounded call (lower_bound=-0.61) and the default one (any gate), with ``cu_seqlens`` int64 reused by
every call and a new tensor each call (a data loader's), in rounds that alternate the choices, so that a mode that
comes and goes shows in every choice's spread. fla-core's best runs once a round beside them (--fla auto: on an
H100 only, whose autotune choices benchmarks/fla_autotune ships; elsewhere it would autotune for minutes).

Per (case, form, system, choice) the summary has the median, min and max of the rounds' forward+backward
(``do_bench`` medians), the median over fla-core's median, and ``slow``: how many rounds took more than SLOW above
the fastest choice's median for that (case, form, system). Writes $OUT/varlen_streams.json (./ without $OUT)
after every round. --dry-run: CPU, Triton's interpreter, tiny fp32 shapes, one round, no fla (the control flow).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import bench as BENCH  # noqa: E402
from benchmarks import common as C  # noqa: E402

# name -> (H, D, sequence lengths): the bench's two varlen call forms
CASES: dict[str, tuple[int, int, tuple[int, ...]]] = {
    "ragged8": (32, 64, BENCH.RAGGED8),
    "varlen11": (32, 64, C.LENGTHS11),
}
DRY_CASES: dict[str, tuple[int, int, tuple[int, ...]]] = {
    "ragged8": (1, 64, (5, 17, 3, 30)),
    "varlen11": (1, 64, (16, 32, 16)),
}
# choice -> the driver options it forces (chunk_driver.DriverOptions); "rule": none
CHOICES: dict[str, dict[str, Any]] = {
    "rule": {},
    "both": {"overlap": True, "per_sequence": True},
    "overlap_only": {"overlap": True, "per_sequence": False},
    "per_sequence_only": {"overlap": False, "per_sequence": True},
    "neither": {"overlap": False, "per_sequence": False},
}
DPLR_SYSTEMS = ("dplr-fast", "dplr-generic")
# form -> whether each call gets a new cu_seqlens tensor (int64 both)
FORMS = {"int64": False, "int64-fresh": True}
SLOW = 0.08  # a round this far above the fastest choice's median counts as slow


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma list of {', '.join(CASES)}")
    ap.add_argument("--systems", default=",".join(DPLR_SYSTEMS), help=f"comma list of {', '.join(DPLR_SYSTEMS)}")
    ap.add_argument("--forms", default=",".join(FORMS), help=f"comma list of {', '.join(FORMS)}")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--budget", type=float, default=300.0, help="seconds; rounds stop when it is spent")
    ap.add_argument("--fla", choices=["auto", "on", "off"], default="auto",
                    help="fla-core's best beside dplr-gen: auto runs it on an H100 only")
    ap.add_argument("--package", default="generated/hopper")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    args.case_names = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in args.case_names if c not in CASES]
    if unknown or not args.case_names:
        ap.error(f"--cases {args.cases!r}: valid are {', '.join(CASES)}")
    for flag, valid in (("systems", DPLR_SYSTEMS), ("forms", FORMS)):
        names = [n.strip() for n in getattr(args, flag).split(",") if n.strip()]
        if not names or any(n not in valid for n in names):
            ap.error(f"--{flag} {getattr(args, flag)!r}: valid are {', '.join(valid)}")
        setattr(args, f"{flag}_list", names)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    if args.dry_run:
        args.rounds = 1
    return args


def want_fla(mode: str, device: str) -> tuple[bool, str | None]:
    """(run fla-core's best, why not where it is left out)."""
    if mode == "off" or device == "cpu":
        return False, "off" if mode == "off" else "CPU dry run"
    if mode == "on":
        return True, None
    import torch

    name = torch.cuda.get_device_name()
    if "H100" not in name:
        return False, f"{name}: the shipped autotune choices are an H100's (--fla on to autotune here)"
    return True, None


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (case, form, system, choice): median, min, max, rounds, the median over fla-core's, slow rounds."""
    groups: dict[tuple[str, str, str, str], list[float]] = {}
    for r in rows:
        groups.setdefault((r["case"], r["form"], r["system"], r["choice"]), []).append(r["fwd_bwd_ms"])
    medians = {k: statistics.median(v) for k, v in groups.items()}
    out = []
    for (case, form, system, choice), times in groups.items():
        fastest = min(m for (c, f, s, _), m in medians.items() if (c, f, s) == (case, form, system))
        fla = medians.get((case, form, "fla-best", "rule"))
        med = medians[(case, form, system, choice)]
        out.append({"case": case, "form": form, "system": system, "choice": choice, "rounds": len(times),
                    "median_ms": med, "min_ms": min(times), "max_ms": max(times),
                    "vs_fla_best": med / fla if fla else None,
                    "slow": sum(t > fastest * (1 + SLOW) for t in times)})
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from dplr_gen.runtime import chunk_driver

    device = "cpu" if args.dry_run else "cuda"
    package = C.dry_run_package() if args.dry_run else args.package
    table = DRY_CASES if args.dry_run else CASES
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    deadline = time.time() + args.budget
    fla, fla_note = want_fla(args.fla, device)
    systems = {name: C.load_op(C.SYSTEMS[name], package)[0] for name in args.systems_list}
    if fla:
        try:
            systems["fla-best"] = C.load_op(C.SYSTEMS["fla-best"], package)[0]
        except ImportError as e:  # the ratios are then left out, the choices still timed
            fla_note = str(e)

    # (case, form, system) -> forward+backward closure; each system differentiates leaves of its own
    steps = {}
    for name in args.case_names:
        H, D, lengths = table[name]
        x = C.rwkv7_case(1, sum(lengths), H, D, dtype=dtype, device=device, seed=0, n_states=len(lengths))
        do, dht = C.grad_outputs(x, seed=1)
        cu, cu_cpu = C.cu_tensors(lengths, "int64", device)
        for system, op in systems.items():
            xl = C.leaves(x)
            for form in args.forms_list:
                steps[(name, form, system)] = C.step_closures(op, xl, do, dht, cu, cu_cpu, fresh_cu=FORMS[form])[1]

    out = C.out_dir() / "varlen_streams.json"
    result: dict[str, Any] = {
        "script": "benchmarks/varlen_streams.py", "machine": C.machine_info(device), "package": str(package),
        "choices": CHOICES, "slow_threshold": SLOW, "fla_left_out": fla_note, "rows": [], "summary": [],
    }
    for rnd in range(args.rounds):
        for (name, form, system), step in steps.items():
            for choice in (CHOICES if system in DPLR_SYSTEMS else ("rule",)):
                with chunk_driver.forced(**CHOICES[choice]):
                    ms = C.bench_ms(step, device)
                result["rows"].append({"round": rnd, "case": name, "form": form, "system": system,
                                       "choice": choice, "fwd_bwd_ms": ms})
                print(f"round {rnd} {name} {form} {system} {choice}: {ms:.3f} ms", flush=True)
        result["summary"] = summarise(result["rows"])
        C.write_json(out, result)
        if time.time() > deadline:
            print(f"budget spent after round {rnd}", flush=True)
            break
    print(C.format_table(
        ["case", "form", "system", "choice", "median ms", "min", "max", "vs fla", "slow"],
        [[s["case"], s["form"], s["system"], s["choice"], s["median_ms"], s["min_ms"], s["max_ms"],
          s["vs_fla_best"], f"{s['slow']}/{s['rounds']}"] for s in result["summary"]]))
    print(f"-> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
