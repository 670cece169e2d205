"""Ahead-of-time build: rendering is deterministic, compiles run in subprocesses, the cache and manifest are
consistent, a rebuild is free, concurrent builds agree, and compiler failures become clear errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from dplr_gen.toolchain import build as b
from dplr_gen.toolchain import cache, triton_versions
from dplr_gen.toolchain.compile import CompileJob, import_source, run_in_subprocess

REPO = Path(__file__).resolve().parent.parent

SMALL = """
name: small
targets: [sm_80, sm_90]
variants:
  - ops: [fused_recurrent]
    dtypes: [bf16]
    head_dims: [64]
    varlen: [false, true]
"""


@pytest.fixture()
def small_spec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("DPLR_GEN_CACHE_DIR", str(tmp_path / "cache"))
    p = tmp_path / "small.yaml"
    p.write_text(SMALL)
    return p


def test_render_is_deterministic(small_spec: Path, tmp_path: Path) -> None:
    p1 = b.plan(small_spec, tmp_path / "g1")
    p2 = b.plan(small_spec, tmp_path / "g2")
    assert p1.files == p2.files
    assert len(p1.units) == 4  # 2 variants x 2 targets
    for rel, text in p1.files.items():
        if rel.endswith(".py") and "/" in rel:
            assert "Do not edit" in text.splitlines()[0]
            compile(text, rel, "exec")  # valid Python


def test_build_then_noop_rebuild(small_spec: Path, tmp_path: Path) -> None:
    out = tmp_path / "gen"
    report = b.build(small_spec, jobs=2, out_root=out)
    assert not report.failures, [f.error for f in report.failures]
    assert report.kernels == 8  # 4 units x (the loop kernel, the decode step's)
    manifest = json.loads((out / "small" / "manifest.json").read_text())
    assert set(manifest["units"]) == {u.name for u in b.plan(small_spec, out).units}
    for unit in manifest["units"].values():
        for k in unit["kernels"]:
            meta = cache.read_entry(k["key"], manifest["triton_version"])
            assert meta is not None and meta["shared"] == k["shared"]
            files = os.listdir(cache.entry_dir(k["key"], manifest["triton_version"]))
            assert any(f.endswith(".cubin") for f in files) and any(f.endswith(".ttgir") for f in files)
    t0 = time.perf_counter()
    again = b.build(small_spec, jobs=2, out_root=out)
    assert again.up_to_date and not again.outcomes
    assert time.perf_counter() - t0 < 2.0
    assert b.stale_files(b.plan(small_spec, out)) == []


def test_lost_cache_entry_is_rebuilt(small_spec: Path, tmp_path: Path) -> None:
    out = tmp_path / "gen"
    b.build(small_spec, jobs=2, out_root=out)
    manifest = json.loads((out / "small" / "manifest.json").read_text())
    key = next(iter(manifest["units"].values()))["kernels"][0]["key"]
    (cache.entry_dir(key, manifest["triton_version"]) / cache.META).unlink()  # as if killed mid-write
    report = b.build(small_spec, jobs=2, out_root=out)
    assert not report.up_to_date and not report.failures
    assert cache.read_entry(key, manifest["triton_version"]) is not None


def test_two_builds_at_once(small_spec: Path, tmp_path: Path) -> None:
    out = tmp_path / "gen"
    env = dict(os.environ)
    cmd = [sys.executable, "-c", f"from dplr_gen.toolchain import build as b; from pathlib import Path; "
           f"r = b.build({str(small_spec)!r}, jobs=1, out_root=Path({str(out)!r})); "
           "raise SystemExit(1 if r.failures else 0)"]
    procs = [subprocess.Popen(cmd, env=env) for _ in range(2)]
    assert [p.wait(timeout=600) for p in procs] == [0, 0]
    manifest = json.loads((out / "small" / "manifest.json").read_text())
    assert not manifest["failures"] and len(manifest["units"]) == 4
    assert b.build(small_spec, out_root=out).up_to_date


def test_changed_template_context_marks_stale(small_spec: Path, tmp_path: Path) -> None:
    out = tmp_path / "gen"
    p = b.plan(small_spec, out)
    b.write_package(p)
    assert b.stale_files(p) == []
    victim = out / "small" / next(iter(p.unit_files.values()))
    victim.write_text(victim.read_text() + "# edited\n")
    (out / "small" / "leftover.py").write_text("")
    stale = b.stale_files(p)
    assert str(victim.relative_to(out / "small")) in stale and "leftover.py" in stale


PLANTED = '''
import triton
import triton.language as tl


@triton.jit
def chained(q, k, v, w, o, BT: tl.constexpr, D: tl.constexpr):
    # chunk-style: a dot result feeds two more dots and is added to the last one's result
    r = tl.arange(0, BT)
    c = tl.arange(0, D)
    bq = tl.load(q + r[:, None] * D + c[None, :])
    bk = tl.load(k + r[:, None] * D + c[None, :])
    bv = tl.load(v + r[:, None] * D + c[None, :])
    bw = tl.load(w + r[:, None] * D + c[None, :])
    s = tl.dot(bq, tl.trans(bk))
    s = tl.where(r[:, None] >= r[None, :], s, 0.0)
    p = tl.dot(s.to(tl.bfloat16), bv, tl.dot(bw, bv))
    x = tl.dot(p.to(tl.bfloat16), tl.trans(bw)) + s
    tl.store(o + r[:, None] * D + c[None, :], x)


SIGNATURES = {"chained": {"q": "*bf16", "k": "*bf16", "v": "*bf16", "w": "*bf16", "o": "*fp32"}}
CONSTEXPRS = {"chained": {"BT": 64, "D": 64}}
LAUNCH = {"chained": {"num_warps": %d, "num_stages": 2}}
'''


def _planted_job(tmp_path: Path, warps: int, target: str, cc: int) -> CompileJob:
    src = tmp_path / f"planted_{warps}_{cc}.py"
    src.write_text(PLANTED % warps)
    return CompileJob(
        unit=f"planted_w{warps}", source=str(src), source_hash=f"planted{warps}", target=target, cc=cc,
        smem_limit=232448, check_mma=cc >= 90, triton_version=str(b.installed_triton()),
        cache_root=str(tmp_path / "cache"),
    )


def test_planted_mma_conversion_is_flagged(tmp_path: Path) -> None:
    bad = run_in_subprocess(_planted_job(tmp_path, 8, "sm_90", 90))
    assert not bad.ok
    assert "MMA layouts" in bad.error and "chained" in bad.error
    good = run_in_subprocess(_planted_job(tmp_path, 8, "sm_80", 80))
    assert good.ok, good.error


def test_shared_memory_limit_is_enforced(tmp_path: Path) -> None:
    job = _planted_job(tmp_path, 4, "sm_80", 80)
    job.smem_limit = 1024
    res = run_in_subprocess(job)
    assert not res.ok and "shared memory" in res.error and "sm_80" in res.error


def test_compiler_crash_is_reported_not_fatal(tmp_path: Path) -> None:
    src = tmp_path / "crash.py"
    src.write_text("import os\nos.abort()\n")
    job = CompileJob(unit="crashy", source=str(src), source_hash="x", target="sm_90", cc=90, smem_limit=1,
                     check_mma=True, triton_version="3.6.0", cache_root=str(tmp_path / "c"))
    res = run_in_subprocess(job)
    assert not res.ok
    assert "SIGABRT" in res.error and "crashy" in res.error and "sm_90" in res.error and "3.6.0" in res.error


def test_python_compile_error_is_reported(tmp_path: Path) -> None:
    src = tmp_path / "bad.py"
    src.write_text(PLANTED.replace("tl.dot(bq", "tl.dot(bq[:, :, None]") % 4)
    job = _planted_job(tmp_path, 4, "sm_80", 80)
    job.source = str(src)
    res = run_in_subprocess(job)
    assert not res.ok and "failed" in res.error and "sm_80" in res.error
    assert "kernel chained of planted_w4" in res.error


ABORT_IN_COMPILE = """
import os


class _Boom:  # stands in for a kernel whose compile aborts the process (as the compiler's asserts do)
    def __getattr__(self, name):
        os.abort()


fine = None
boom = _Boom()
SIGNATURES = {"boom": {"x": "*fp32"}}
CONSTEXPRS = {"boom": {}}
LAUNCH = {"boom": {"num_warps": 4, "num_stages": 1}}
"""


def test_abort_names_the_kernel_being_compiled(tmp_path: Path) -> None:
    src = tmp_path / "boom.py"
    src.write_text(ABORT_IN_COMPILE)
    job = CompileJob(unit="boomunit", source=str(src), source_hash="boom", target="sm_90", cc=90, smem_limit=1,
                     check_mma=True, triton_version=str(b.installed_triton()), cache_root=str(tmp_path / "c"))
    res = run_in_subprocess(job)
    assert not res.ok
    assert "SIGABRT" in res.error and "kernel boom of boomunit for sm_90" in res.error


def test_build_keeps_launch_stubs_for_every_built_kernel(small_spec: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The stubs of every kernel in the manifest are built into dplr-gen's cache root; without a GPU the
    build says it left them to the first process on one."""
    from dplr_gen.runtime import loader
    from dplr_gen.toolchain import launch_stubs

    out = tmp_path / "gen"
    report = b.build(small_spec, jobs=2, out_root=out, stubs=False)
    assert report.stubs == ""
    monkeypatch.setattr(b, "_cuda_usable", lambda: False)
    assert "no CUDA GPU here" in b.build_launch_stubs(out / "small")
    seen: list[tuple[list[Any], Any]] = []
    monkeypatch.setattr(launch_stubs, "warm_launchers", lambda ks, keep_in=None: seen.append((list(ks), keep_in)))
    n = loader.package_at(out / "small").build_launch_stubs()
    manifest = json.loads((out / "small" / "manifest.json").read_text())
    assert n == sum(len(u["kernels"]) for u in manifest["units"].values()) == 8
    (kernels, keep_in), = seen
    assert {k.compiled.name for k in kernels} == {k["kernel"] for u in manifest["units"].values() for k in u["kernels"]}
    assert keep_in == (Path(manifest["cache_root"]), manifest["triton_version"])
    # the build's own path (where a GPU is usable) finds the same kernels without the runtime's loader
    monkeypatch.setattr(b, "_cuda_usable", lambda: True)
    assert "built or found for 8 kernels" in b.build_launch_stubs(out / "small")
    assert {k.compiled.name for k in seen[-1][0]} == {k.compiled.name for k in kernels}
    (out / "small" / "manifest.json").unlink()
    with pytest.raises(loader.NotBuiltError, match="dplr-gen build"):
        loader.package_at(out / "small").build_launch_stubs()


def test_loaded_from_launch_records_as_from_the_source(small_spec: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A built unit loads from the launch records its build kept (the rendered source not imported): the same
    tables, kernels and Triton sources as loading through the imported module, and the same C launcher Triton's
    CUDA driver would generate for each kernel. A manifest without records (an earlier build) is not current,
    and its units load through the source."""
    import triton.backends.nvidia.driver as nv

    from dplr_gen.runtime import loader
    from dplr_gen.toolchain import launch_stubs, package_kernels

    out = tmp_path / "gen"
    assert not b.build(small_spec, jobs=2, out_root=out, stubs=False).failures
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(launch_stubs, "warm_launchers", lambda ks, keep_in=None: None)
    imported: list[str] = []
    monkeypatch.setattr(package_kernels, "unit_module", lambda *a: imported.append(a) or pytest.fail("imported"))
    pkg = loader.SpecPackage(out / "small")
    manifest = pkg.manifest()
    launchers: dict[str, str] = {}

    def launcher_source(k: Any) -> str:
        monkeypatch.setattr(nv, "library_dirs", lambda: [])
        monkeypatch.setattr(nv, "compile_module_from_src",
                            lambda src, name, **kw: launchers.setdefault("src", src) and type("M", (), {"launch": 0}))
        launchers.clear()
        nv.CudaLauncher(k.compiled.src, k.compiled.metadata)
        return launchers["src"]

    for variant in pkg.variant_names:
        for target in ("sm_80", "sm_90"):
            ks = pkg._load(variant, target)
            entry = pkg.index["variants"][variant]["targets"][target]
            module = import_source(out / "small" / entry["source"], f"records_{entry['unit']}")
            ref, why = package_kernels.aot_kernels(module, entry["unit"], manifest)
            assert ref is not None, why
            assert sorted(ks.aot) == sorted(ref) == sorted(module.SIGNATURES)
            assert ks.module.OPTIONS == getattr(module, "OPTIONS", {})
            for name, k in ks.aot.items():
                assert ks.constexprs(name) == module.CONSTEXPRS[name]
                assert list(ks.arguments(name)) == list(module.SIGNATURES[name])
                assert ks.module.LAUNCH[name] == module.LAUNCH[name]
                src, want = k.compiled.src, ref[name].compiled.src
                assert (src.name, src.signature, src.constants, str(src.attrs)) == \
                    (want.name, want.signature, want.constants, str(want.attrs))
                assert k._order == ref[name]._order and k.compiled.hash == ref[name].compiled.hash
                assert launcher_source(k) == launcher_source(ref[name])
    assert not imported
    # a manifest from before records were kept: not current, and the loader imports the source
    for unit in manifest["units"].values():
        del unit["declared"]
    (out / "small" / "manifest.json").write_text(json.dumps(manifest))
    assert not b.manifest_is_current(b.plan(small_spec, out), manifest, tmp_path / "cache")
    monkeypatch.undo()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("DPLR_GEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(launch_stubs, "warm_launchers", lambda ks, keep_in=None: None)
    ks = loader.SpecPackage(out / "small")._load(pkg.variant_names[0], "sm_90")
    assert hasattr(ks.module, "__file__") and ks.aot


GLUON_SHARED = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from dplr_gen.toolchain.compile import import_source
from dplr_gen.toolchain.triton_source import is_gluon, make_source
m = import_source(sys.argv[1], "gluon_unit")
name = "chunk_dplr_bwd_kernel"
fn = getattr(m, name)
assert is_gluon(fn) and name in m.OPTIONS["persistent"], "not the persistent Gluon token pass"
c = triton.compile(make_source(fn, m.SIGNATURES[name], m.CONSTEXPRS[name]), target=GPUTarget("cuda", 90, 32),
                   options=m.LAUNCH[name])
print(m.LAUNCH[name]["num_warps"], c.metadata.shared)
"""


@pytest.mark.parametrize("unit", ["chunk_bf16_k64_v64_c16_dense_gbm0p61_gbf16_sfp32",
                                  "chunk_bf16_k128_v128_c16_dense_gbm0p61_gbf16_sfp32"])
def test_persistent_gluon_token_passes_keep_two_programs_an_sm(unit: str) -> None:
    """The persistent Gluon token passes of specs/hopper.yaml rest on two programs an SM, one computing while the
    other's copies are in flight (docs/design.md, token pass in Gluon): compiled for sm_90 (no GPU needed; in a process of
    its own, outside the tests' interpreter mode), each leaves room for two by its shared memory at its 4 warps
    (at most 255 registers a thread: two blocks by registers)."""
    from dplr_gen.runtime.loader import blocks_per_sm

    path = Path(__file__).resolve().parents[1] / "generated/hopper" / unit / "sm_90.py"
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    r = subprocess.run([sys.executable, "-c", GLUON_SHARED, str(path)], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    warps, shared = (int(x) for x in r.stdout.split()[-2:])
    smem_sm = 233472  # sm_90: 228 KB a multiprocessor (each block also reserves 1 KB)
    assert warps == 4 and blocks_per_sm(255, shared + 1024, warps, smem_sm=smem_sm) == 2, shared


DIVISIBLE_T = """
name: divt
targets: [sm_90]
variants:
  - ops: [chunk]
    dtypes: [fp16]
    head_dims: [32]
    chunk_sizes: [16]
    varlen: [false]
    gate_bounds: [-0.61]
tuning:
  chunk.fwd_small: {num_warps: 1, block_v: 16, divisible_t: true}
  chunk.bwd_dh_small: {num_warps: 1, block_v: 16, divisible_t: true}
"""


def test_divisible_t_copies_compiled_and_loaded_with_t_divisible(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Knob divisible_t: the build compiles each *_t16_kernel with T promised divisible by 16 (its TTGIR says so,
    its original's does not) from the same function; loaded from the launch records or through the source, the
    copy's Triton source carries that promise, which the original's lacks."""
    from dplr_gen.runtime import loader
    from dplr_gen.toolchain import launch_stubs, package_kernels

    monkeypatch.setenv("DPLR_GEN_CACHE_DIR", str(tmp_path / "cache"))
    spec = tmp_path / "divt.yaml"
    spec.write_text(DIVISIBLE_T)
    out = tmp_path / "gen"
    assert not b.build(spec, jobs=2, out_root=out, stubs=False).failures
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(launch_stubs, "warm_launchers", lambda ks, keep_in=None: None)
    pkg = loader.SpecPackage(out / "divt")
    manifest = pkg.manifest()
    (variant,) = pkg.variant_names
    entry = pkg.index["variants"][variant]["targets"]["sm_90"]
    module = import_source(out / "divt" / entry["source"], f"divt_{entry['unit']}")
    twins = module.OPTIONS["divisible_t"]
    assert set(twins) == {"chunk_dplr_fwd_small_kernel", "chunk_dplr_fwd_h_small_kernel",
                          "chunk_dplr_bwd_dh_small_kernel"}
    recorded = pkg._load(variant, "sm_90")
    from_source, why = package_kernels.aot_kernels(module, entry["unit"], manifest)
    assert from_source is not None, why
    keys = {k["kernel"]: k["key"] for k in manifest["units"][entry["unit"]]["kernels"]}
    for name, twin in twins.items():
        t_index = list(module.SIGNATURES[name]).index("T")
        for kernels in (recorded.aot, from_source):
            attrs, twin_attrs = str(kernels[name].compiled.src.attrs), str(kernels[twin].compiled.src.attrs)
            assert attrs != twin_attrs and f"({t_index},)" in twin_attrs and f"({t_index},)" not in attrs
            assert kernels[twin].compiled.src.name == kernels[name].compiled.src.name == name
        gir = {n: next((tmp_path / "cache").glob(f"triton-*/{keys[n][:2]}/{keys[n]}/*.ttgir")).read_text()
               for n in (name, twin)}
        assert "%T: i32 {tt.divisibility = 16 : i32}" in gir[twin]
        assert "%T: i32 {tt.divisibility" not in gir[name]


DIRECT_CHILD = """
import json, sys
from dplr_gen.runtime.loader import SpecPackage
from pathlib import Path
pkg = SpecPackage(Path(sys.argv[1]))
seen = {}
for variant in pkg.variant_names:
    ks = pkg.kernel_set(variant, "sm_90")
    seen[variant] = {n: [type(k).__name__, k.n_runtime, len(list(ks.arguments(n)))] for n, k in ks.aot.items()}
print("RESULT " + json.dumps({"kernels": seen, "triton": "triton" in sys.modules}))
"""


def test_kernels_with_direct_records_load_without_triton(small_spec: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where this machine keeps a unit's direct records (a first process on a GPU captured them), a fresh
    process loads its kernels from them without importing Triton; one kernel without a record sends the whole
    unit through Triton's path. The records here are what a capture gives for each kernel's argument list (the
    capture itself: tests/test_launch_direct.py)."""
    from dplr_gen.runtime import loader
    from dplr_gen.toolchain import launch_direct, launch_stubs

    out = tmp_path / "gen"
    assert not b.build(small_spec, jobs=2, out_root=out, stubs=False).failures
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(launch_stubs, "warm_launchers", lambda ks, keep_in=None: None)
    (tmp_path / "stub.so").write_bytes(b"stub")
    (tmp_path / "utils.so").write_bytes(b"utils")

    def capture(k: Any) -> dict[str, Any]:
        full = k.launcher_args([launch_direct._Mark(i) for i in range(k.n_runtime)])
        cubin = next(Path(p).name for p in k.compiled.metadata_group.values() if str(p).endswith(".cubin"))
        return {"version": launch_direct.RECORD_VERSION, "name": k.compiled.name, "cubin": cubin, "shared": 0,
                "num_warps": 4, "head": [0, None, {"tuple": [4, 1, 0]}],
                "layout": [f.what if isinstance(f, launch_direct._Mark) else {"const": launch_direct._encode(f)}
                           for f in full],
                "stub_file": str(tmp_path / "stub.so"), "utils_file": str(tmp_path / "utils.so")}

    monkeypatch.setattr(launch_direct, "capture", capture)
    pkg = loader.SpecPackage(out / "small")
    for variant in pkg.variant_names:  # the first process: through Triton, keeping the records
        assert all(type(k).__name__ == "LoadedKernel" for k in pkg._load(variant, "sm_90").aot.values())
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(REPO))

    def child() -> dict[str, Any]:
        proc = subprocess.run([sys.executable, "-c", DIRECT_CHILD, str(out / "small")], env=env, text=True,
                              capture_output=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(next(ln[7:] for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")))

    res = child()
    assert not res["triton"]
    kinds = {tuple(v) for kernels in res["kernels"].values() for v in kernels.values()}
    assert kinds and all(kind == "DirectKernel" and n == args for kind, n, args in kinds), kinds
    # one record gone: that unit's kernels all come through Triton (one launch path per kernel set)
    rec = next(launch_direct.records_dir(tmp_path / "cache", str(triton_versions.triton_version())).glob("*.json"))
    rec.unlink()
    res = child()
    assert res["triton"]
    by_variant = {v: {kind for kind, _, _ in kernels.values()} for v, kernels in res["kernels"].items()}
    assert sorted(map(sorted, by_variant.values())) == sorted([["LoadedKernel"]] + [["DirectKernel"]] * (len(by_variant) - 1))
