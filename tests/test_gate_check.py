"""The lower_bound promise is checked (a broken one raises, naming lower_bound and the minimum; the switch skips
it), and a lower-precision initial_state is taken on purpose: the state is computed and returned in float32."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dplr_gen.runtime import chunk_driver, gate_check, ops
from dplr_gen.reference import naive_dplr_delta_rule
from dplr_gen.testing import rel_err, rwkv7_inputs

from .helpers import render_package

REPO = Path(__file__).resolve().parent.parent

SPEC = """
name: gate_check_test
targets: [sm_80]
variants:
  - ops: [chunk]
    dtypes: [fp32]
    head_dims: [16]
    chunk_sizes: [16]
    varlen: [false]
    gate_bounds: [-0.61]
"""


@pytest.fixture(scope="module")
def pkg(tmp_path_factory: pytest.TempPathFactory):
    return render_package(tmp_path_factory.mktemp("gen"), SPEC, "gate_check_test")


def _inputs(gate: float | None) -> dict[str, torch.Tensor]:
    x = rwkv7_inputs(1, 20, 2, 16, dtype=torch.float32)
    if gate is not None:  # gates below the promise at a few positions
        x["gk"][0, 3:9, 1, :5] = gate
    return x


@pytest.mark.parametrize("gate, shown", [(-1.0, "min(gk) = -1"), (-5.0, "min(gk) = -5"), (float("nan"), "nan")])
def test_broken_promise_raises(pkg, monkeypatch: pytest.MonkeyPatch, gate: float, shown: str) -> None:
    monkeypatch.delenv(gate_check.CHECK_ENV, raising=False)
    with pytest.raises(ValueError) as e:
        ops.chunk_dplr_delta_rule(**_inputs(gate), lower_bound=-0.61, package=pkg)
    assert "lower_bound=-0.61" in str(e.value) and shown in str(e.value) and gate_check.CHECK_ENV in str(e.value)


def test_kept_promise_passes_and_is_exact(pkg, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(gate_check.CHECK_ENV, raising=False)
    x = _inputs(None)
    o, _ = ops.chunk_dplr_delta_rule(**x, lower_bound=-0.61, package=pkg)
    ref, _ = naive_dplr_delta_rule(**{n: t.double() for n, t in x.items()})
    assert rel_err(o, ref) < 1e-5


def test_switch_skips_the_check(pkg, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the check off the broken promise runs through: finite and wrong, which is why the check is on."""
    monkeypatch.setenv(gate_check.CHECK_ENV, "0")
    x = _inputs(-5.0)
    o, _ = ops.chunk_dplr_delta_rule(**x, lower_bound=-0.61, package=pkg)
    ref, _ = naive_dplr_delta_rule(**{n: t.double() for n, t in x.items()})
    assert torch.isfinite(o).all() and rel_err(o, ref) > 1e-2


def test_check_is_in_the_compiled_graph(pkg, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torch.compile the check is an asynchronous assert node of the graph (no host sync, no graph break)."""
    monkeypatch.delenv(gate_check.CHECK_ENV, raising=False)

    def f(x: dict[str, torch.Tensor]) -> torch.Tensor:
        return ops.chunk_dplr_delta_rule(**x, lower_bound=-0.61, package=pkg)[0] * 2

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    x = _inputs(None)
    assert rel_err(compiled(x), f(x)) < 1e-6
    with pytest.raises(RuntimeError, match=r"gk < lower_bound=-0.61 \(or NaN\)"):
        compiled(_inputs(-1.0))


def test_async_form_carries_the_message(monkeypatch: pytest.MonkeyPatch) -> None:
    """The device form (torch._assert_async) is what a CUDA tensor gets; on CPU it raises at once."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    gate_check.check_lower_bound(torch.full((3,), -0.5), -0.61)
    with pytest.raises(RuntimeError, match="lower_bound=-0.61"):
        gate_check.check_lower_bound(torch.full((3,), -0.7), -0.61)


@pytest.mark.parametrize("both", [False, True], ids=["fwd_prep", "bwd_prep_in_fwd"])
@pytest.mark.parametrize("gate, lower_bound, kept", [
    (None, -0.61, True), (-0.62, -0.61, False), (float("nan"), -0.61, False),
    # the caller's bound is checked, not the variant's (built for -0.61, it clamps there)
    (-0.5, -0.4, False), (-0.5, -0.5, True),
])
def test_prep_flags_a_broken_promise(pkg, both: bool, gate: float | None, lower_bound: float, kept: bool) -> None:
    """The bounded variant's preps (the forward's, and the backward's that a forward keeping the states runs)
    clear the flag where a gate breaks the caller's promise, NaN included, and leave it set otherwise."""
    x = _inputs(None)
    x["gk"] = x["gk"].clamp(min=-0.3)
    if gate is not None:
        x["gk"][0, 13, 1, 7] = gate
    variant = ops.variant_for(pkg, "chunk", x["q"], x["v"], x["gk"], lower_bound=lower_bound)
    ks, var = ops._kernels(str(pkg.dir), variant, x["q"].device)
    assert var.gate_bound == -0.61
    got = chunk_driver.promise_kept(ks, var, *(x[n] for n in ("q", "k", "a", "b", "gk")), lower_bound,
                                    for_fwd_and_bwd=both)
    assert got is kept


@pytest.mark.parametrize("keep", [False, True], ids=["recompute", "keep_states"])
def test_kernel_form_end_to_end(pkg, monkeypatch: pytest.MonkeyPatch, keep: bool) -> None:
    """The GPU's form on CPU tensors: the prep checks, the assert on its flag raises (at once, on CPU) with
    the device message; a kept promise gives the exact result, gradients included; the switch skips it."""
    monkeypatch.setattr(gate_check, "KERNEL_ON_CPU", True)
    monkeypatch.delenv(gate_check.CHECK_ENV, raising=False)
    calls = []
    real = chunk_driver.chunk_prep
    monkeypatch.setattr(chunk_driver, "chunk_prep", lambda *a, **kw: calls.append(kw.get("promise")) or real(*a, **kw))

    def run(x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        xs = {n: t.detach().clone().requires_grad_(True) for n, t in x.items()}
        o, _ = ops.chunk_dplr_delta_rule(**xs, lower_bound=-0.61, disable_recompute=keep, package=pkg)
        o.square().sum().backward()
        return o, {n: t.grad for n, t in xs.items()}

    for gate in (-1.0, float("nan")):
        with pytest.raises(RuntimeError, match=r"gk < lower_bound=-0.61 \(or NaN\)"):
            run(_inputs(gate))
    assert calls and all(p is not None and p.lower_bound == -0.61 for p in calls)
    x = _inputs(None)
    o, grads = run(x)
    x64 = {n: t.double().requires_grad_(True) for n, t in x.items()}
    ref, _ = naive_dplr_delta_rule(**x64)
    ref.square().sum().backward()
    assert rel_err(o, ref) < 1e-5 and all(rel_err(grads[n], x64[n].grad) < 1e-4 for n in grads)
    monkeypatch.setenv(gate_check.CHECK_ENV, "0")
    calls.clear()
    assert torch.isfinite(run(_inputs(-5.0))[0]).all()
    assert calls and all(p is None for p in calls)  # no promise: the bounded prep gets the scratch flag


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_initial_state_is_taken_in_float32(pkg, dtype: torch.dtype) -> None:
    """initial_state in bf16/fp16: the same result as its values in float32; final state float32; its gradient
    in its own dtype."""
    x = _inputs(None)
    h0 = x.pop("initial_state").to(dtype).requires_grad_(True)
    h0_32 = h0.detach().float().requires_grad_(True)
    outs = []
    for h in (h0, h0_32):
        o, ht = ops.chunk_dplr_delta_rule(**x, initial_state=h, output_final_state=True, lower_bound=-0.61,
                                           package=pkg)
        (dh,) = torch.autograd.grad((o.square().sum() + ht.sum()), (h,))
        outs.append((o, ht, dh))
    (o, ht, dh), (o32, ht32, dh32) = outs
    assert ht.dtype == torch.float32 and dh.dtype == dtype
    assert torch.equal(o, o32) and torch.equal(ht, ht32) and torch.equal(dh, dh32.to(dtype))


def test_cost_script_dry_run(tmp_path: Path) -> None:
    """benchmarks/lower_bound_check.py (the GPU measurement of the check's cost) runs end to end on CPU."""
    out = tmp_path / "cost.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "lower_bound_check.py"), str(out), "--dry-run"],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads(out.read_text())["shapes"]
    assert "error" not in row, row
    assert {"fwd_checked_ms", "fwd_unchecked_ms", "fwd_bwd_overhead_pct", "check_alone_ms"} <= set(row)


@pytest.mark.parametrize("bound", [-0.61, -1e-30, -123456789.123456789, -5e-324])
def test_device_assert_message_fits_cuda_limit(bound: float) -> None:
    # torch._assert_async refuses messages of 255 characters or more (RuntimeError on every call)
    from dplr_gen.runtime.gate_check import device_message

    assert len(device_message(bound)) < 255 and "lower_bound" in device_message(bound)
