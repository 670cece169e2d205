"""Run-time loading: no compiled kernels + DPLR_GEN_NO_JIT=1 is a clear error; a GPU no target covers is a clear
error naming the GPU, the targets and how to add a spec; the JIT fallback warns."""

from __future__ import annotations

import pytest
import torch

from dplr_gen.runtime import dispatch, loader
from dplr_gen.runtime.loader import NotBuiltError, UnsupportedDeviceError

from .helpers import render_package

SPEC = """
name: rt_test
targets: [sm_80, sm_90]
variants:
  - ops: [fused_recurrent]
    dtypes: [fp16]
    head_dims: [32]
    varlen: [false]
"""


@pytest.fixture(scope="module")
def pkg(tmp_path_factory: pytest.TempPathFactory):
    return render_package(tmp_path_factory.mktemp("gen"), SPEC, "rt_test")


def test_no_jit_without_build_is_an_error(pkg, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("DPLR_GEN_NO_JIT", "1")
    with pytest.raises(NotBuiltError) as e:
        pkg._load(pkg.variant_names[0], "sm_90")
    msg = str(e.value)
    assert "DPLR_GEN_NO_JIT=1" in msg and "dplr-gen build" in msg and "no manifest.json" in msg


def test_prebuilt_reads_the_manifest_as_the_loader_does(pkg, monkeypatch: pytest.MonkeyPatch) -> None:
    """prebuilt() and the loader share one check: no manifest, another Triton release, or a unit the last build
    did not produce all mean "not prebuilt", each with its reason."""
    from dplr_gen.toolchain import triton_versions

    variant = pkg.variant_names[0]
    unit = pkg.index["variants"][variant]["targets"]["sm_90"]["unit"]
    installed = str(triton_versions.triton_version())
    cases = {
        "no manifest.json": None,
        "built with Triton 0.0.0": {"triton_version": "0.0.0", "units": {unit: {}}},
        "the last build did not produce it": {"triton_version": installed, "units": {}},
        "": {"triton_version": installed, "units": {unit: {"kernels": []}}},
    }
    for reason, manifest in cases.items():
        monkeypatch.setattr(pkg, "manifest", lambda m=manifest: m)
        assert pkg.prebuilt(variant, "sm_90") == (reason == "")
        why = pkg._not_built(manifest, unit)
        assert (reason in why) if reason else why == ""
        assert pkg._load_aot(None, unit, manifest)[1] == why


def test_jit_fallback_warns(pkg, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.delenv("DPLR_GEN_NO_JIT", raising=False)
    with pytest.warns(UserWarning, match="compiling with Triton's JIT"):
        ks = pkg._load(pkg.variant_names[0], "sm_80")
    assert not ks.aot


def test_uncovered_gpu_is_named(pkg, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loader, "device_target", lambda device: "sm_120")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA GeForce RTX 5090")
    with pytest.raises(UnsupportedDeviceError) as e:
        pkg.target_for(torch.device("cuda", 0))
    msg = str(e.value)
    assert "RTX 5090" in msg and "sm_120" in msg and "sm_80, sm_90" in msg and "specs/" in msg


def test_dispatcher_names_built_specs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loader, "device_target", lambda device: "sm_75")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    with pytest.raises(UnsupportedDeviceError) as e:
        dispatch.default_package().package_for(torch.device("cuda", 0))
    msg = str(e.value)
    assert "Tesla T4" in msg and "ampere -> sm_80, sm_86" in msg and "hopper -> sm_90" in msg


def test_known_miscompile_without_workaround_is_refused(pkg, monkeypatch: pytest.MonkeyPatch) -> None:
    """Source rendered for one Triton, run under a release with a silent miscompile on sm_90: refused."""
    from packaging.version import Version

    from dplr_gen.toolchain import triton_versions

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(triton_versions, "triton_version", lambda: Version("3.5.0"))
    name = pkg.variant_names[0]
    entry = pkg.index["variants"][name]["targets"]["sm_90"]
    monkeypatch.setitem(entry, "quirks", [])  # as if rendered for a Triton without that quirk
    with pytest.raises(loader.KnownMiscompileError) as e:
        pkg._load(name, "sm_90")
    assert "hopper-cast-trans-dot-operand-wrong" in str(e.value) and "dplr-gen build" in str(e.value)
    params = pkg.index["variants"][name]["params"]
    monkeypatch.setitem(entry, "quirks", ["hopper-cast-trans-dot-operand-wrong", "hopper-wy-backward-4-warps-wrong"])
    loader._refuse_unavoided_miscompiles(entry, "sm_90", params)  # rendered with the workarounds: accepted
    # an entry limited to chunk 64 does not concern a chunk-16 variant
    monkeypatch.setitem(entry, "quirks", ["hopper-cast-trans-dot-operand-wrong"])
    loader._refuse_unavoided_miscompiles(entry, "sm_90", {**params, "op": "chunk", "chunk_size": 16})
    with pytest.raises(loader.KnownMiscompileError, match="hopper-wy-backward-4-warps-wrong"):
        loader._refuse_unavoided_miscompiles(entry, "sm_90", {**params, "op": "chunk", "chunk_size": 64})


def test_per_call_lookups_are_memoised(pkg, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ops look the package, the variant and the kernel set up on every call: after the first, none of it
    touches the file system or re-ranks variants (host work that small shapes wait for), and a failed
    selection is not remembered as an answer."""
    import os
    from pathlib import Path

    from dplr_gen.runtime import ops

    d = str(pkg.dir)
    assert os.path.isabs(d) and loader.package_at(d) is pkg
    resolved: list[Path] = []
    real_resolve = Path.resolve
    monkeypatch.setattr(Path, "resolve", lambda self, *a, **k: resolved.append(self) or real_resolve(self, *a, **k))
    assert all(loader.package_at(d) is pkg for _ in range(3)) and resolved == []
    # a relative path depends on the working directory: resolved on every call
    assert loader.package_at(os.path.relpath(d)) is pkg and len(resolved) == 1

    first = ops._select(d, "fused_recurrent", torch.float16, 32, 32, False)
    misses = ops._select_cached.cache_info().misses
    assert ops._select(d, "fused_recurrent", torch.float16, 32, 32, False) == first
    assert ops._select_cached.cache_info().misses == misses, "re-ranked a memoised request"
    monkeypatch.undo()
    monkeypatch.setenv("DPLR_GEN_NO_JIT", "1")
    for _ in range(2):  # no such variant (none generated): the error every time, nothing cached
        with pytest.raises(ValueError, match="no built variant"):
            ops._select(d, "fused_recurrent", torch.float16, 64, 64, False)


def test_dispatcher_answer_is_kept_per_device_and_spec(monkeypatch: pytest.MonkeyPatch) -> None:
    """dplr_gen.<op> finds its package once per (device, DPLR_GEN_SPEC), not on every call; a failed lookup
    is not kept (a later build can mend it)."""
    d = dispatch._Dispatcher()
    listed: list[int] = []
    real = loader.all_packages
    monkeypatch.setattr(loader, "all_packages", lambda: listed.append(1) or real())
    monkeypatch.delenv(loader.SPEC_ENV, raising=False)
    cpu = torch.device("cpu")
    first = d.package_for(cpu)
    assert all(d.package_for(cpu) is first for _ in range(3)) and len(listed) == 1
    monkeypatch.setenv(loader.SPEC_ENV, "hopper")
    assert d.package_for(cpu).name == "hopper" and len(listed) == 2
    monkeypatch.setenv(loader.SPEC_ENV, "no_such_spec")
    for n in (3, 4):
        with pytest.raises(NotBuiltError, match="no_such_spec"):
            d.package_for(cpu)
        assert len(listed) == n


def test_driver_options_are_forced_for_a_block_only() -> None:
    """chunk_driver.forced replaces the named options for its block and restores the ones before; an unknown
    option is refused naming the valid ones."""
    from dplr_gen.runtime import chunk_driver

    before = chunk_driver.OPTIONS
    with chunk_driver.forced(poison=True, segments=4) as opts:
        assert chunk_driver.OPTIONS is opts and (opts.poison, opts.segments, opts.overlap) == (True, 4, None)
        assert torch.isnan(chunk_driver._empty((3,), torch.float32, torch.device("cpu"))).all()
        with chunk_driver.forced(overlap=False):
            assert (chunk_driver.OPTIONS.poison, chunk_driver.OPTIONS.overlap) == (True, False)
        assert chunk_driver.OPTIONS is opts
    assert chunk_driver.OPTIONS is before
    with pytest.raises(TypeError, match=r"unknown \['poisson'\]; valid: \['poison', 'small_grid'"):
        chunk_driver.with_options(poisson=True)
    with pytest.raises(TypeError, match="unknown"), chunk_driver.forced(grid=1):
        pass
    assert chunk_driver.OPTIONS is before


def test_launch_takes_the_declared_arguments_by_name() -> None:
    """chunk_driver._launch passes a kernel the arguments its SIGNATURES entry names, in that order, whatever else
    it is given; a missing one is refused naming the kernel and the argument; where the kernel set declares a
    build of the kernel for T divisible by 16 (OPTIONS "divisible_t"), that build is launched for such a T."""
    from dplr_gen.runtime import chunk_driver

    got = []

    class KS:
        def arguments(self, name):
            return {"chunk_x_kernel": {"q": "*bf16", "T": "i32", "H": "i32"}}[name].keys()

        def option(self, name, default=None):
            return {"divisible_t": {"chunk_x_kernel": "chunk_x_t16_kernel"}}.get(name, default)

        def __getattr__(self, name):
            class _Grid:
                def __getitem__(self, grid):
                    return lambda *args: got.append((name, grid, args))
            return _Grid()

    chunk_driver._launch(KS(), "chunk_x_kernel", (3,), {"H": 2, "extra": 9, "T": 5, "q": "Q"})
    assert got == [("chunk_x_kernel", (3,), ("Q", 5, 2))]
    chunk_driver._launch(KS(), "chunk_x_kernel", (3,), {"H": 2, "T": 48, "q": "Q"})
    assert got[-1] == ("chunk_x_t16_kernel", (3,), ("Q", 48, 2))
    with pytest.raises(TypeError, match="chunk_x_kernel: no value given for its argument 'T'"):
        chunk_driver._launch(KS(), "chunk_x_kernel", (3,), {"q": "Q", "H": 2})


def test_cuda_index_names_the_current_device_where_the_device_has_no_index(monkeypatch: pytest.MonkeyPatch) -> None:
    from dplr_gen.runtime import devices

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 5)
    assert devices.cuda_index(torch.device("cuda")) == 5
    assert devices.cuda_index(torch.device("cuda", 2)) == 2
