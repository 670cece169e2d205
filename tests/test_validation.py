"""Bad arguments: each raises ValueError/TypeError naming the argument, before any kernel is launched."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from dplr_gen.runtime import ops
from dplr_gen.testing import rwkv7_inputs

from .helpers import render_package

SPEC = """
name: val_test
targets: [sm_80]
variants:
  - ops: [fused_recurrent]
    dtypes: [fp32, fp16]
    head_dims: [32]
    varlen: [false, true]
"""


@pytest.fixture(scope="module")
def pkg(tmp_path_factory: pytest.TempPathFactory):
    return render_package(tmp_path_factory.mktemp("gen"), SPEC, "val_test")


@pytest.fixture(autouse=True)
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*a: Any, **k: Any) -> None:
        raise AssertionError("a kernel was launched with bad arguments")

    monkeypatch.setattr(ops.fused_recurrent_driver, "fused_recurrent_dplr_fwd", boom)


def call(pkg, **over: Any) -> None:
    x: dict[str, Any] = rwkv7_inputs(1, 8, 2, 32, dtype=torch.float32)
    x.update(over)
    ops.fused_recurrent_dplr_delta_rule(**x, package=pkg)


def shifted(name: str, fn: Callable[[torch.Tensor], Any]) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def f(x: dict[str, Any]) -> dict[str, Any]:
        return {name: fn(x[name])}

    return f


CASES = [
    ("k", lambda x: {"k": x["k"][:, :, :1]}, ValueError),
    ("v", lambda x: {"v": x["v"][:, :4]}, ValueError),
    ("q", lambda x: {"q": x["q"][0]}, ValueError),
    ("gk", lambda x: {"gk": x["gk"].double()}, TypeError),
    ("a", lambda x: {"a": x["a"].half()}, TypeError),
    ("q", lambda x: {"q": x["q"].to(torch.int32)}, TypeError),
    ("b", lambda x: {"b": "not a tensor"}, TypeError),
    ("initial_state", lambda x: {"initial_state": x["initial_state"][:, :1]}, ValueError),
    ("initial_state", lambda x: {"initial_state": x["initial_state"].to(torch.int64)}, TypeError),
    ("scale", lambda x: {"scale": "big"}, TypeError),
    ("scale", lambda x: {"scale": float("nan")}, TypeError),
    ("cu_seqlens", lambda x: {"cu_seqlens": torch.tensor([0.0, 8.0])}, TypeError),
    ("cu_seqlens", lambda x: {"cu_seqlens": [0, 8]}, TypeError),
    ("cu_seqlens", lambda x: {"cu_seqlens": torch.tensor([1, 8])}, ValueError),
    ("cu_seqlens", lambda x: {"cu_seqlens": torch.tensor([0, 5, 3, 8])}, ValueError),
    ("cu_seqlens", lambda x: {"cu_seqlens": torch.tensor([0, 7])}, ValueError),
    ("cu_seqlens", lambda x: {"cu_seqlens": torch.tensor([[0, 8]])}, ValueError),
    ("initial_state", lambda x: {"cu_seqlens": torch.tensor([0, 3, 8])}, ValueError),  # 2 seqs, 1 state
    ("T = 0", lambda x: {n: (t[:, :0] if n != "initial_state" else t) for n, t in x.items()}, ValueError),
    ("unexpected keyword", lambda x: {"chunk_sise": 64}, TypeError),
]


@pytest.mark.parametrize("needle, change, exc", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_bad_argument_is_named(pkg, needle: str, change: Callable[[dict[str, Any]], dict[str, Any]], exc: type) -> None:
    x: dict[str, Any] = rwkv7_inputs(1, 8, 2, 32, dtype=torch.float32)
    x.update(change(x))
    with pytest.raises(exc) as e:
        ops.fused_recurrent_dplr_delta_rule(**x, package=pkg)
    assert needle in str(e.value)


def test_batch_with_cu_seqlens(pkg) -> None:
    x = rwkv7_inputs(2, 8, 2, 32, dtype=torch.float32)
    with pytest.raises(ValueError, match="batch size must be 1"):
        ops.fused_recurrent_dplr_delta_rule(**x, cu_seqlens=torch.tensor([0, 8]), package=pkg)


def test_devices_must_agree(pkg) -> None:
    x = rwkv7_inputs(1, 8, 2, 32, dtype=torch.float32)
    x["v"] = x["v"].to("meta")
    with pytest.raises(ValueError, match="v is on meta"):
        ops.fused_recurrent_dplr_delta_rule(**x, package=pkg)


def test_head_dim_not_built_with_no_jit_names_the_entry(pkg, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DPLR_GEN_NO_JIT", "1")
    x = rwkv7_inputs(1, 8, 2, 48, dtype=torch.float32)
    with pytest.raises(ValueError) as e:
        ops.fused_recurrent_dplr_delta_rule(**x, package=pkg)
    msg = str(e.value)
    assert "K=48" in msg and "k32" in msg and "head_dims: [48]" in msg and "dplr-gen build" in msg


def test_bf16_not_built_with_no_jit(pkg, monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 on CPU runs on the fp32 variants (tests/test_ondemand.py); on a GPU target the bf16 request is
    its own, and with DPLR_GEN_NO_JIT=1 refused naming bf16."""
    monkeypatch.setenv("DPLR_GEN_NO_JIT", "1")
    with pytest.raises(ValueError, match="bf16"):
        ops._select(str(pkg.dir), "fused_recurrent", torch.bfloat16, 32, 32, False)


def test_cpu_without_interpreter_is_refused(pkg, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = rwkv7_inputs(1, 8, 2, 32, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        pkg.target_for(x["q"].device)


def test_fast_check_accepts_exactly_what_the_named_checks_accept(monkeypatch: pytest.MonkeyPatch) -> None:
    """The one-pass check of CUDA inputs (ops._tensors_agree) passes only inputs that the per-argument checks pass
    too: every case the named checks refuse, it refuses (and the call then takes the named checks). CPU tensors
    posing as CUDA ones: the property it reads of the device is get_device()."""
    monkeypatch.setattr(torch.Tensor, "get_device", lambda t: 0 if not getattr(t, "_elsewhere", False) else 1)
    names = ("q", "k", "v", "a", "b", "gk")

    def case(**edit: Any) -> tuple[Any, ...]:
        x = rwkv7_inputs(1, 8, 2, 32, dtype=torch.float16)
        x.pop("initial_state")
        x["gk"] = x["gk"].float()  # a float32 gate is allowed
        x.update(edit)
        return tuple(x[n] for n in names)

    good = case()
    assert ops._tensors_agree(good)
    ops._check_tensors(names, good)
    elsewhere = torch.zeros(1, 8, 2, 32, dtype=torch.float16)
    elsewhere._elsewhere = True  # type: ignore[attr-defined]
    bad = [
        case(k=torch.zeros(1, 8, 2, 16, dtype=torch.float16)),  # shape
        case(v=torch.zeros(1, 7, 2, 32, dtype=torch.float16)),  # v's B, T, H
        case(v=torch.zeros(1, 8, 2, 300, dtype=torch.float16)),  # V out of range
        case(q=torch.zeros(1, 8, 2, 8, dtype=torch.float16), k=torch.zeros(1, 8, 2, 8, dtype=torch.float16),
             a=torch.zeros(1, 8, 2, 8, dtype=torch.float16), b=torch.zeros(1, 8, 2, 8, dtype=torch.float16),
             gk=torch.zeros(1, 8, 2, 8)),  # K out of range
        case(a=torch.zeros(1, 8, 2, 32, dtype=torch.bfloat16)),  # dtype
        case(gk=torch.zeros(1, 8, 2, 32, dtype=torch.bfloat16)),  # gate dtype
        case(q=torch.zeros(1, 8, 2, 32, dtype=torch.float64), k=torch.zeros(1, 8, 2, 32, dtype=torch.float64)),
        case(b=elsewhere),  # another device
        case(v=[0.0]),  # not a tensor
    ]
    for i, t in enumerate(bad):
        assert not ops._tensors_agree(t), i
    # the named checks refuse them too (each with the argument's name); the device case needs real devices
    for i, t in enumerate(bad[:-2]):
        with pytest.raises((ValueError, TypeError)):
            ops._check_tensors(names, t)
    x0 = case()
    empty = tuple(torch.zeros(1, 0, *t.shape[2:], dtype=t.dtype) for t in x0)
    assert not ops._tensors_agree(empty)
    with pytest.raises(ValueError, match="T = 0"):
        ops._check_tensors(names, empty)
