"""The Triton adapter (dplr_gen.toolchain: versions, sources, compiles, launches, TTGIR, probes) with the installed Triton, on CPU (AOT compiles need no GPU)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from packaging.version import Version

from dplr_gen.toolchain import interpreter_repair, launch, launch_stubs, probes, triton_compile, triton_source, triton_versions, ttgir

INSTALLED = triton_versions.triton_version()
ARCHS = [80, 90, 100, 120]


def _compile(kernel: str, arch: int, num_warps: int = 4, num_stages: int = 2, **kw: Any) -> triton_compile.CompileResult:
    ok, why = triton_versions.can_target(arch)
    if not ok:
        pytest.skip(why)
    sig, consts = probes.PROBES[kernel]
    return triton_compile.compile_kernel(getattr(probes.probe_module(), kernel), sig, consts, arch, num_warps, num_stages, **kw)


# ---------------------------------------------------------------------------------------------- can_target


@pytest.mark.parametrize(
    "arch, version, ok",
    [
        (90, "3.1.0", True),
        (80, "3.1.0", True),
        (100, "3.1.0", False),
        (100, "3.2.0", False),
        (100, "3.3.0", True),
        (100, "3.3.1", True),
        (120, "3.2.0", False),  # ptxas of 3.1/3.2 does not know sm_120
        (120, "3.3.0", True),
        (120, "3.9.0", True),
        (90, "3.0.0", False),  # older than supported
        (100, "3.3.0rc1", True),  # pre-releases count as their release
        (90, "3.6.0+git1234", True),
        (130, "3.9.0", False),  # unknown future arch
        (91, "3.6.0", False),
    ],
)
def test_can_target(arch: int, version: str, ok: bool) -> None:
    got, why = triton_versions.can_target(arch, version)
    assert got is ok
    if not ok:
        assert why  # always says why


def test_can_target_reasons() -> None:
    assert "cannot target sm_100" in triton_versions.can_target(100, "3.2.0")[1]
    assert "not a known target" in triton_versions.can_target(130)[1]
    ok, why = triton_versions.can_target(90, "3.12.0")
    assert ok and "newer" in why
    assert triton_versions.can_target(90, Version("3.6.0")) == (True, "")


def test_triton_version_is_installed_one() -> None:
    import triton

    assert triton_versions.triton_version() == Version(triton.__version__)


def test_compile_refuses_untargetable_arch_without_calling_triton() -> None:
    sig, consts = probes.PROBES["probe_add"]
    with pytest.raises(triton_versions.TargetUnsupported):
        triton_compile.compile_kernel(probes.probe_module().probe_add, sig, consts, 130, 4, 2)


# ---------------------------------------------------------------------------------------------- make_source


def test_make_source_installed_release() -> None:
    sig, consts = probes.PROBES["probe_add"]
    src = triton_source.make_source(probes.probe_module().probe_add, sig, consts)
    if INSTALLED >= Version("3.3"):
        assert src.signature == {**sig, "BLOCK": "constexpr"}
        assert src.constants == {(4,): 1024}
        assert src.attrs == {(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]],
                             (2,): [["tt.divisibility", 16]]}
        assert triton_source.make_source(probes.probe_module().probe_add, sig, consts, pointer_divisibility=False).attrs == {}
        extra = triton_source.make_source(probes.probe_module().probe_add, sig, consts, divisible_args=["n"]).attrs
        assert (3,) in extra
    else:
        assert src.signature == sig and src.constants == {"BLOCK": 1024}


def test_make_source_checks_arguments() -> None:
    fn = probes.probe_module().probe_add
    sig, consts = probes.PROBES["probe_add"]
    with pytest.raises(ValueError, match="missing"):
        triton_source.make_source(fn, {k: v for k, v in sig.items() if k != "n"}, consts)
    with pytest.raises(ValueError, match="unknown"):
        triton_source.make_source(fn, {**sig, "bogus": "i32"}, consts)
    with pytest.raises(ValueError, match="both"):
        triton_source.make_source(fn, sig, {**consts, "n": 3})


# ---------------------------------------------------------------------------------------------- compile


@pytest.mark.parametrize("arch", ARCHS)
def test_compile_simple_kernel(arch: int) -> None:
    res = _compile("probe_add", arch)
    for ext in ("json", "cubin", "ptx", "ttgir", "ttir", "llir"):
        assert f"probe_add.{ext}" in res.files, sorted(res.files)
    assert res.files["probe_add.cubin"][:4] == b"\x7fELF"
    md = res.metadata
    json.dumps(md)  # json-able
    assert md["name"] == "probe_add" and md["arch"] == arch and md["num_warps"] == 4 and md["num_stages"] == 2
    assert md["triton_version"] == str(INSTALLED).split("+")[0] or md["triton_version"].startswith(str(INSTALLED))
    assert md["hash"] == res.hash and len(md["hash"]) >= 32
    assert md["triton_metadata"]["name"] == "probe_add"
    assert res.shared == 0
    assert "ttg" in res.ttgir or "triton_gpu" in res.ttgir
    # the 16-byte pointer specialisation reaches the IR
    assert "tt.divisibility = 16" in res.files["probe_add.ttir"].decode()


def test_compile_without_divisibility() -> None:
    res = _compile("probe_add", 80, pointer_divisibility=False)
    assert "tt.divisibility" not in res.files["probe_add.ttir"].decode()


@pytest.mark.parametrize("arch", ARCHS)
def test_compile_dot_kernel_uses_shared(arch: int) -> None:
    res = _compile("probe_dot", arch)
    assert 16384 <= res.shared <= 32768
    assert res.metadata["shared"] == res.shared


def test_compile_uses_private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    user_cache = tmp_path / "user_cache"
    user_cache.mkdir()
    monkeypatch.setenv("TRITON_CACHE_DIR", str(user_cache))
    _compile("probe_add", 90, num_warps=2)
    assert list(user_cache.iterdir()) == []  # nothing written to the user's cache
    assert os.environ["TRITON_CACHE_DIR"] == str(user_cache)  # and the setting restored


def test_compile_result_write_and_load(tmp_path: Path) -> None:
    res = _compile("probe_add", 90)
    written = res.write(tmp_path / "k")
    assert {p.name for p in written} == set(res.files)
    (tmp_path / "k" / "manifest.json").write_text("{}")  # unrelated json beside it must not confuse loading
    sig, consts = probes.PROBES["probe_add"]
    kern = launch.load_kernel(probes.probe_module().probe_add, sig, consts, tmp_path / "k", res.hash)
    assert kern.metadata.name == "probe_add" and kern.metadata.shared == 0
    assert kern.compiled.hash == res.hash
    assert kern.n_runtime == 4
    # a launch reads the binary alone: the intermediate forms written beside it are not loaded
    assert set(kern.compiled.asm) == {"cubin"} and kern.compiled.kernel == (tmp_path / "k" / "probe_add.cubin").read_bytes()

    # the launcher's argument list: constexpr slots only where the release's signature has them
    calls: list[tuple[tuple[Any, ...], Any]] = []

    class FakeCompiled:
        name = "probe_add"

        def __getitem__(self, grid: tuple[int, int, int]) -> Any:
            assert grid == (7, 1, 1)
            return lambda *args, stream=None: calls.append((args, stream))

    kern.compiled = FakeCompiled()
    kern[7]("x", "y", "o", 100)
    kern[(7,)]("x", "y", "o", 100, stream=5)
    expected = ("x", "y", "o", 100, 1024) if INSTALLED >= Version("3.3") else ("x", "y", "o", 100)
    assert calls == [(expected, None), (expected, 5)]
    with pytest.raises(TypeError, match="4 runtime arguments"):
        kern[7]("x", "y", "o")


def test_load_kernel_missing_files(tmp_path: Path) -> None:
    sig, consts = probes.PROBES["probe_add"]
    with pytest.raises(FileNotFoundError):
        launch.load_kernel(probes.probe_module().probe_add, sig, consts, tmp_path, "0" * 64)


# ---------------------------------------------------------------------------------------------- mma conversions


def test_chained_dots_sm90_8_warps_flagged() -> None:
    if INSTALLED < Version("3.2"):
        # Triton 3.0/3.1 abort on exactly this conversion (the quirk it detects): check in a child process
        res_sub = probes.probe_subprocess("probe_chain", 90, num_warps=8)
        assert res_sub["ok"] is False and "mma -> mma layout conversion" in res_sub["error"], res_sub
        return
    res = _compile("probe_chain", 90, num_warps=8)
    conv = ttgir.mma_conversions(res.ttgir)
    assert len(conv) >= 1, "expected an mma -> different mma convert_layout on sm_90 with 8 warps"
    assert all("convert_layout" in line for line in conv)
    # 3.3+ also convert a dot result to a dot operand of the other mma layout (3.2: only the direct one)
    assert len(ttgir.mma_conversions(res.ttgir, include_dot_operands=True)) >= len(conv)


@pytest.mark.parametrize("arch, num_warps", [(90, 4), (80, 8), (80, 4)])
def test_chained_dots_not_flagged(arch: int, num_warps: int) -> None:
    res = _compile("probe_chain", arch, num_warps=num_warps)
    assert ttgir.mma_conversions(res.ttgir, include_dot_operands=True) == []


def test_chained_dots_sm100_use_tensor_memory() -> None:
    res = _compile("probe_chain", 100, num_warps=8)
    assert "nvidia_mma" not in res.ttgir
    assert ttgir.mma_conversions(res.ttgir, include_dot_operands=True) == []


_TTGIR_36 = """\
#blocked = #ttg.blocked<{sizePerThread = [1, 1], threadsPerWarp = [1, 32], warpsPerCTA = [4, 2], order = [1, 0]}>
#mma = #ttg.nvidia_mma<{versionMajor = 3, versionMinor = 0, warpsPerCTA = [8, 1], instrShape = [16, 32, 16]}>
#mma1 = #ttg.nvidia_mma<{versionMajor = 3, versionMinor = 0, warpsPerCTA = [4, 2], instrShape = [16, 32, 16]}>
#mma2 = #ttg.nvidia_mma<{versionMajor = 3, versionMinor = 0, warpsPerCTA = [8, 1], instrShape = [16, 32, 16]}>
#loc = loc("/x/k.py":11:0)
module attributes {"ttg.num-warps" = 8 : i32} {
  tt.func public @k() {
    %a = ttg.convert_layout %x : tensor<64x64xf32, #mma> -> tensor<64x64xf32, #mma1> loc(#loc72)
    %b = ttg.convert_layout %y : tensor<64x64xbf16, #mma> -> tensor<64x64xbf16, #ttg.dot_op<{opIdx = 0, parent = #mma, kWidth = 2}>> loc(#loc1)
    %c = ttg.convert_layout %z : tensor<64x64xbf16, #mma> -> tensor<64x64xbf16, #ttg.dot_op<{opIdx = 0, parent = #mma1, kWidth = 2}>> loc(#loc2)
    %d = ttg.convert_layout %w : tensor<64x64xbf16, #mma1> -> tensor<64x64xbf16, #blocked> loc(#loc3)
    %e = ttg.convert_layout %v : tensor<64x64xf32, #mma> -> tensor<64x64xf32, #mma2> loc(#loc4)
    %f = ttg.convert_layout %u : tensor<64xf32, #ttg.slice<{dim = 1, parent = #mma}>> -> tensor<64xf32, #ttg.slice<{dim = 1, parent = #mma1}>>
    tt.return
  }
}
"""

# Triton 3.1/3.2 spell the dialect triton_gpu
_TTGIR_31 = """\
#mma = #triton_gpu.nvidia_mma<{versionMajor = 3, versionMinor = 0, warpsPerCTA = [8, 1], instrShape = [16, 32, 16]}>
#mma1 = #triton_gpu.nvidia_mma<{versionMajor = 3, versionMinor = 0, warpsPerCTA = [4, 2], instrShape = [16, 32, 16]}>
    %44 = triton_gpu.convert_layout %40 : tensor<64x64xf32, #mma> -> tensor<64x64xf32, #mma1> loc(#loc72)
    %45 = triton_gpu.convert_layout %40 : tensor<64x64xf32, #mma> -> tensor<64x64xf32, #triton_gpu.nvidia_mma<{versionMajor = 3, versionMinor = 0, warpsPerCTA = [8, 1], instrShape = [16, 32, 16]}>>
"""


def test_mma_conversions_synthetic() -> None:
    conv = ttgir.mma_conversions(_TTGIR_36)
    # %a only: %e converts between two aliases with identical definitions (no real conversion)
    assert [line.split(" =")[0] for line in conv] == ["%a"]
    with_ops = ttgir.mma_conversions(_TTGIR_36, include_dot_operands=True)
    assert [line.split(" =")[0] for line in with_ops] == ["%a", "%c"]


def test_mma_conversions_triton_31_dialect_and_inline_encoding() -> None:
    assert [line.split(" =")[0] for line in ttgir.mma_conversions(_TTGIR_31)] == ["%44"]


def test_ttgir_aliases_resolve_nested() -> None:
    text = "#mma = #ttg.nvidia_mma<{versionMajor = 2}>\n#dot = #ttg.dot_op<{opIdx = 0, parent = #mma, kWidth = 2}>\n"
    al = ttgir.ttgir_aliases(text)
    assert al["#dot"] == "#ttg.dot_op<{opIdx = 0, parent = #ttg.nvidia_mma<{versionMajor = 2}>, kWidth = 2}>"


# ---------------------------------------------------------------------------------------------- probes


def test_probe_subprocess_reports_json() -> None:
    res = probes.probe_subprocess("probe_add", 80)
    assert res["ok"] is True and res["arch"] == 80 and res["shared"] == 0, res
    skipped = probes.probe_subprocess("probe_add", 130)
    assert skipped["ok"] is False and skipped["skipped"] is True


def test_interpreter_kernel_is_refused_with_hint() -> None:
    import triton

    @triton.jit
    def _k(x_ptr):  # defined under TRITON_INTERPRET=1 in the test session (see conftest)
        pass

    if type(_k).__name__ != "InterpretedFunction":
        pytest.skip("TRITON_INTERPRET is not set in this session")
    with pytest.raises(TypeError, match="without_interpreter"):
        triton_compile.compile_kernel(_k, {"x_ptr": "*fp32"}, {}, 80, 4, 2)


def test_compile_after_interpreter_left_language_patched() -> None:
    """Triton's interpreter can leave triton.language patched; compile_kernel must still work."""
    import triton.language as tl

    interpreter_repair.repair_triton_language()  # make sure a clean snapshot exists
    original = tl.program_id
    tl.program_id = lambda *a, **k: None  # what a leaked interpreter patch looks like
    try:
        assert interpreter_repair.repair_triton_language() is True
        assert tl.program_id is original
        res = _compile("probe_add", 80)
        assert res.shared == 0
        assert interpreter_repair.repair_triton_language() is False
    finally:
        tl.program_id = original


def test_warm_launchers_builds_each_stub_once_and_never_raises(monkeypatch) -> None:
    import threading
    import time as _time
    from types import SimpleNamespace

    import triton.runtime

    built, threads = [], set()

    def launcher_cls(src, metadata):
        threads.add(threading.get_ident())
        _time.sleep(0.05)
        if src == "bad":
            raise RuntimeError("no C compiler")
        built.append(src)

    monkeypatch.setattr(triton.runtime, "driver", SimpleNamespace(active=SimpleNamespace(launcher_cls=launcher_cls)))
    ks = [launch.LoadedKernel(SimpleNamespace(src=s, metadata=None), [], {}) for s in ("a", "b", "bad")]
    launch_stubs.warm_launchers(ks)
    assert sorted(built) == ["a", "b"]
    assert len(threads) > 1  # concurrently


_TINY_EXT = """
#include <Python.h>
static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, "%s", NULL, -1, NULL};
PyMODINIT_FUNC PyInit_%s(void) { return PyModule_Create(&def); }
/* %s */
"""


def test_driver_modules_kept_in_dplr_cache_spare_a_fresh_triton_cache_the_compile(tmp_path, monkeypatch) -> None:
    """A launch stub Triton compiled once (real gcc, real Triton cache) is kept in dplr-gen's cache; a process
    with an empty Triton cache then gets it without compiling; other modules pass through untouched."""
    import subprocess

    import triton.backends.nvidia.driver as nv
    import triton.runtime.build as tb

    from dplr_gen.toolchain import cache

    compiles: list[str] = []
    real_check_call = subprocess.check_call

    def counting_check_call(cmd, *a, **k):
        compiles.append(cmd[1])
        return real_check_call(cmd, *a, **k)

    monkeypatch.setattr(tb.subprocess, "check_call", counting_check_call)
    original = nv.compile_module_from_src
    root, version = tmp_path / "dplr", "3.6.0"
    launcher = _TINY_EXT % ("__triton_launcher", "__triton_launcher", "signature A")

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-1"))
    with launch_stubs.driver_modules_kept_in(root, version):
        assert nv.compile_module_from_src is not original
        first = nv.compile_module_from_src(src=launcher, name="__triton_launcher")
        other = nv.compile_module_from_src(src=_TINY_EXT % ("other_mod", "other_mod", ""), name="other_mod")
    assert nv.compile_module_from_src is original
    assert first.__name__ == "__triton_launcher" and other.__name__ == "other_mod"
    assert len(compiles) == 2
    kept = [p for p in root.rglob(cache.META)]
    assert len(kept) == 1 and "__triton_launcher" in kept[0].read_text()  # only the driver's own module
    with cache.locked("f" * 64, version, root):  # a kernel's entry beside it is not counted
        cache.write_entry("f" * 64, version, {"x.cubin": b""}, {"kernel": "x"}, root)
    assert launch_stubs.kept_driver_modules(root, version) == 1 and launch_stubs.kept_driver_modules(root, "3.5.0") == 0

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-2"))  # a fresh node: empty Triton cache
    with launch_stubs.driver_modules_kept_in(root, version):
        again = nv.compile_module_from_src(src=launcher, name="__triton_launcher")
        assert len(compiles) == 2  # found, not compiled
        assert Path(again.__file__).read_bytes() == Path(first.__file__).read_bytes()
        assert str(tmp_path / "triton-2") in again.__file__  # through Triton's own cache, where it looks
        # another signature is not mistaken for the stored one
        nv.compile_module_from_src(src=_TINY_EXT % ("__triton_launcher", "__triton_launcher", "signature B"),
                                   name="__triton_launcher")
        assert len(compiles) == 3
    assert launch_stubs.kept_driver_modules(root, version) == 2

    # a damaged kept copy is never handed to Triton: it is compiled again and the copy replaced
    kept = sorted(root.rglob("__triton_launcher*.so"))
    assert len(kept) == 2
    for so in kept:
        so.write_bytes(b"truncated")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-3"))
    with launch_stubs.driver_modules_kept_in(root, version):
        healed = nv.compile_module_from_src(src=launcher, name="__triton_launcher")
    assert len(compiles) == 4 and healed.__name__ == "__triton_launcher"
    assert Path(healed.__file__).read_bytes() in {so.read_bytes() for so in kept} - {b"truncated"}
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-4"))
    with launch_stubs.driver_modules_kept_in(root, version):
        nv.compile_module_from_src(src=launcher, name="__triton_launcher")
    assert len(compiles) == 4


def test_warm_launchers_builds_one_stub_per_signature(monkeypatch) -> None:
    from types import SimpleNamespace

    import triton.runtime

    built: list[Any] = []
    monkeypatch.setattr(triton.runtime, "driver", SimpleNamespace(active=SimpleNamespace(
        launcher_cls=lambda src, metadata: built.append(src.signature))))

    def kernel(sig: dict[str, str], consts: dict[Any, Any]) -> Any:
        return launch.LoadedKernel(SimpleNamespace(src=SimpleNamespace(signature=sig, constants=consts),
                                               metadata=SimpleNamespace()), [], {})

    ks = [kernel({"x": "*bf16", "n": "i32"}, {}), kernel({"x": "*bf16", "n": "i32"}, {}),
          kernel({"x": "*fp32", "n": "i32"}, {}), kernel({"x": "*bf16", "n": "i32"}, {(1,): 4})]
    launch_stubs.warm_launchers(ks)
    assert len(built) == 3


def test_loaded_kernel_launches_on_each_device_from_its_own_module(monkeypatch) -> None:
    """A loaded kernel launched on a second device uses a copy of Triton's compiled kernel whose module is
    loaded again (Triton keeps the module of the device current at its first launch); each device keeps its
    own from then on, and the first device's is the original."""
    from types import SimpleNamespace

    launched: list[tuple[int, Any]] = []

    class Compiled(SimpleNamespace):
        def __getitem__(self, grid: Any) -> Any:
            if self.module is None:
                self.module, self.function = f"module@{device[0]}", f"function@{device[0]}"
            return lambda *args, stream=None: launched.append((device[0], self.function))

    original = Compiled(module=None, function=None, name="k")
    k = launch.LoadedKernel(original, [("x", False)], {})
    device = [0]
    monkeypatch.setattr(launch, "_current_device", lambda: device[0])
    k[(1,)](1)
    device[0] = 1
    k[(1,)](1)
    k[(1,)](1)
    device[0] = 0
    k[(1,)](1)
    assert launched == [(0, "function@0"), (1, "function@1"), (1, "function@1"), (0, "function@0")]
    assert k.on_device(0) is original and k.on_device(1) is not original and original.function == "function@0"
