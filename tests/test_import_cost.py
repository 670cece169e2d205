"""Import and first-call cost: nothing in dplr-gen's path loads torch._dynamo unless the user compiles."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CHILD = """
import sys, torch
import dplr_gen
from dplr_gen.runtime import ops
from dplr_gen.runtime.loader import package_at
from dplr_gen.testing import rwkv7_inputs
assert "torch._dynamo" not in sys.modules, "import"
pkg = package_at(sys.argv[1])
x = rwkv7_inputs(1, 5, 1, 16, seed=0)
x = {n: t.requires_grad_(True) for n, t in x.items()}
o, ht = ops.chunk_dplr_delta_rule(**x, output_final_state=True, package=pkg)
(o.sum() + ht.sum()).backward()
assert "torch._dynamo" not in sys.modules, "first fwd+bwd"
print("OK")
"""


def test_eager_use_does_not_import_dynamo(tmp_path: Path) -> None:
    from dplr_gen.toolchain import build as b

    spec = tmp_path / "tiny.yaml"
    spec.write_text("name: tiny\ntargets: [sm_80]\nvariants:\n  - ops: [chunk]\n    dtypes: [fp32]\n"
                    "    head_dims: [16]\n    chunk_sizes: [16]\n    varlen: [false]\n")
    p = b.plan(spec, tmp_path / "gen")
    b.write_package(p)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", CHILD, str(p.out_dir)], env=env, text=True,
                          capture_output=True, timeout=300)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


LOAD_CHILD = """
import sys, warnings, torch
from dplr_gen.runtime import ops
from dplr_gen.toolchain import triton_versions
from dplr_gen.runtime.loader import package_at
pkg = package_at(sys.argv[1])
assert pkg.index["triton_version"] == str(triton_versions.triton_version()), "rendered for another Triton"
name = ops._select(str(pkg.dir), "chunk", torch.bfloat16, 64, 64, False, None, -0.61, torch.bfloat16)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # not built on this machine: the JIT fallback
    pkg.kernel_set(name, "sm_90")
heavy = sorted(m for m in ("pydantic", "yaml", "jinja2", "dplr_gen.spec.quirks", "dplr_gen.spec.models") if m in sys.modules)
assert not heavy, heavy
print("OK", name)
"""


def test_loading_a_package_built_for_this_triton_skips_the_spec_machinery() -> None:
    """A process that loads a shipped variant (rendered for the installed Triton) imports neither pydantic nor
    yaml nor jinja2: the quirk registry is read only for sources rendered for another release (cold start)."""
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(REPO))
    env.pop("DPLR_GEN_NO_JIT", None)
    proc = subprocess.run([sys.executable, "-c", LOAD_CHILD, str(REPO / "generated" / "hopper")], env=env,
                          text=True, capture_output=True, timeout=300)
    assert proc.returncode == 0 and "OK chunk_bf16_k64_v64_c16_dense_gbm0p61_gbf16" in proc.stdout, proc.stderr[-3000:]


def test_package_rendered_for_another_triton_consults_the_registry(monkeypatch) -> None:
    from packaging.version import Version

    from dplr_gen.runtime import loader
    from dplr_gen.toolchain import launch_stubs, triton_versions

    pkg = loader.package_at(REPO / "generated" / "hopper")
    name = pkg.variant_names[0]
    calls: list[str] = []
    # the unit's source imports Gluon, whose import wraps triton.language's functions as they were made: under
    # the tests' interpreter. Imported here, before the switch below, as the rest of the suite would have.
    try:
        import triton.experimental.gluon  # noqa: F401
    except ImportError:  # a Triton without Gluon: the rendered units do not import it either
        pass
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(loader, "_refuse_unavoided_miscompiles", lambda entry, *a: calls.append(entry["unit"]))
    monkeypatch.setattr(pkg, "_load_aot", lambda module, unit, manifest: ({"k": object()}, ""))
    monkeypatch.setattr(launch_stubs, "warm_launchers", lambda ks, **kw: None)
    monkeypatch.setattr(triton_versions, "triton_version", lambda: Version(pkg.index["triton_version"]))
    pkg._load(name, "sm_90")
    assert calls == []
    monkeypatch.setattr(triton_versions, "triton_version", lambda: Version("3.5.1"))
    pkg._load(name, "sm_90")
    assert calls == [pkg.index["variants"][name]["targets"]["sm_90"]["unit"]]
