"""dplr_gen.integrations.fla without fla installed: a stand-in ``fla`` package (the modules and names of fla 0.6 that
the switch touches, its layer calling the two ops as fla's RWKV7Attention.forward does) is written to a temp dir
and put first on sys.path. Its own ops return a marker, so a tensor coming back means dplr-gen ran."""

from __future__ import annotations

import sys
import textwrap
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

import dplr_gen
from dplr_gen.integrations import fla as switch
from dplr_gen.testing import rwkv7_inputs

FILES = {
    "fla/__init__.py": "",
    "fla/ops/__init__.py": "from .rwkv7 import chunk_rwkv7, fused_recurrent_rwkv7\n",
    "fla/ops/rwkv7/__init__.py": """
        from .chunk import chunk_rwkv7
        from .fused_recurrent import fused_mul_recurrent_rwkv7, fused_recurrent_rwkv7
        """,
    "fla/ops/rwkv7/chunk.py": """
        def chunk_rwkv7(r, w, k, v, a, b, scale=1.0, initial_state=None, output_final_state=False,
                        cu_seqlens=None, cu_seqlens_cpu=None, safe_gate=False, chunk_size=None,
                        disable_recompute=False, cp_context=None, lower_bound=None):
            return "fla chunk_rwkv7", None
        """,
    "fla/ops/rwkv7/fused_recurrent.py": """
        def fused_recurrent_rwkv7(*args, **kwargs):
            return "fla fused_recurrent_rwkv7", None

        def fused_mul_recurrent_rwkv7(r, w, k, v, kk, a, scale=1.0, initial_state=None, output_final_state=False,
                                      reverse=False, cu_seqlens=None):
            return "fla fused_mul_recurrent_rwkv7", None
        """,
    "fla/layers/__init__.py": "from .rwkv7 import attend\n",
    # the op calls of fla 0.6's RWKV7Attention.forward, argument for argument
    "fla/layers/rwkv7.py": """
        import torch

        from fla.ops.rwkv7 import chunk_rwkv7, fused_mul_recurrent_rwkv7

        def attend(r, w, k, v, kk, a, training=False, recurrent_state=None, use_cache=False, cu_seqlens=None):
            if training or r.shape[1] >= 64 or torch.is_grad_enabled():
                return chunk_rwkv7(r=r, w=w, k=k, v=v, a=-kk, b=kk * a, scale=1., initial_state=recurrent_state,
                                   output_final_state=use_cache, cu_seqlens=cu_seqlens, safe_gate=True,
                                   lower_bound=-0.6065306597126334, chunk_size=64)
            return fused_mul_recurrent_rwkv7(r=r, w=w, k=k, v=v, kk=kk, a=a, scale=1., initial_state=recurrent_state,
                                             output_final_state=use_cache, cu_seqlens=cu_seqlens)
        """,
}
PATCHED = [("fla.layers.rwkv7", "chunk_rwkv7"), ("fla.layers.rwkv7", "fused_mul_recurrent_rwkv7"),
           ("fla.ops.rwkv7", "chunk_rwkv7"), ("fla.ops.rwkv7", "fused_mul_recurrent_rwkv7"), ("fla.ops", "chunk_rwkv7")]
DEFINED = [("fla.ops.rwkv7.chunk", "chunk_rwkv7"), ("fla.ops.rwkv7.fused_recurrent", "fused_mul_recurrent_rwkv7")]


def _drop_fla() -> dict[str, Any]:
    return {n: sys.modules.pop(n) for n in list(sys.modules) if n == "fla" or n.startswith("fla.")}


@pytest.fixture
def fake_fla(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The stand-in fla, imported; fla's modules as they were (none, here) and the switch off afterwards."""
    for rel, text in FILES.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(textwrap.dedent(text))
    saved = _drop_fla()
    monkeypatch.syspath_prepend(str(tmp_path))
    import fla.layers.rwkv7 as layer

    try:
        yield layer
    finally:
        switch.disable()
        _drop_fla()
        sys.modules.update(saved)


def _bound() -> dict[tuple[str, str], Any]:
    return {(m, n): getattr(sys.modules[m], n) for m, n in PATCHED + DEFINED}


def _is_dplr(fn: Any, name: str) -> bool:
    return repr(fn) == f"<dplr-gen op dplr_gen.{name}>"


def test_enable_disable_swap_and_restore_every_binding(fake_fla: Any) -> None:
    before = _bound()
    assert not switch.is_enabled()
    switch.enable()
    assert switch.is_enabled()
    now = _bound()
    for (m, n) in PATCHED:
        assert _is_dplr(now[m, n], n), (m, n, now[m, n])
    for key in DEFINED:  # fla's own definitions stay fla's
        assert now[key] is before[key]
    assert fake_fla.attend.__globals__["chunk_rwkv7"] is now["fla.layers.rwkv7", "chunk_rwkv7"]
    switch.enable()  # idempotent: still on, one disable turns it off
    switch.disable()
    assert not switch.is_enabled() and _bound() == before
    switch.disable()  # idempotent
    assert _bound() == before


def test_context_manager_restores_on_exit_and_on_error(fake_fla: Any) -> None:
    before = _bound()
    with switch.enabled():
        assert _is_dplr(fake_fla.chunk_rwkv7, "chunk_rwkv7")
        with switch.enabled():  # nested: the inner exit keeps the outer block's routing
            pass
        assert _is_dplr(fake_fla.fused_mul_recurrent_rwkv7, "fused_mul_recurrent_rwkv7")
    assert _bound() == before
    with pytest.raises(KeyError):
        with switch.enabled():
            raise KeyError("boom")
    assert _bound() == before and not switch.is_enabled()
    switch.enable()  # enable() holds it on past a block's exit; disable() ends it at once
    with switch.enabled():
        pass
    assert switch.is_enabled()
    with switch.enabled():
        switch.disable()
        assert _bound() == before
    assert _bound() == before and not switch.is_enabled()


def test_a_module_importing_the_op_while_on_gets_it_back_on_disable(fake_fla: Any, tmp_path: Path) -> None:
    """fla code imported while the switch is on binds dplr-gen's op by name; turning off restores fla's there too,
    and a binding another patch made since is left alone."""
    (tmp_path / "fla" / "late.py").write_text("from fla.ops.rwkv7 import chunk_rwkv7\n")
    fla_fn = fake_fla.chunk_rwkv7
    switch.enable()
    import fla.late as late

    assert _is_dplr(late.chunk_rwkv7, "chunk_rwkv7")
    other = lambda *a, **k: None  # noqa: E731 - someone else's patch of the layer
    fake_fla.fused_mul_recurrent_rwkv7 = other
    switch.disable()
    assert late.chunk_rwkv7 is fla_fn and fake_fla.chunk_rwkv7 is fla_fn
    assert fake_fla.fused_mul_recurrent_rwkv7 is other


def test_custom_ops_and_bad_ones(fake_fla: Any) -> None:
    calls: list[str] = []

    def chunk(*a: Any, **k: Any) -> Any:
        calls.append("chunk")
        return "mine", None

    switch.enable(chunk_rwkv7=chunk)
    assert fake_fla.chunk_rwkv7 is chunk and _is_dplr(fake_fla.fused_mul_recurrent_rwkv7, "fused_mul_recurrent_rwkv7")
    x = torch.zeros(1, 1, 1, 16)
    assert fake_fla.attend(x, x, x, x, x, x, training=True)[0] == "mine" and calls == ["chunk"]
    switch.enable()  # back to dplr-gen's
    assert _is_dplr(fake_fla.chunk_rwkv7, "chunk_rwkv7")
    with pytest.raises(TypeError, match="fused_mul_recurrent_rwkv7 must be a callable"):
        switch.enable(fused_mul_recurrent_rwkv7="dplr")  # type: ignore[arg-type]


def _layer_inputs(T: int) -> dict[str, torch.Tensor]:
    x = rwkv7_inputs(1, T, 1, 64, seed=3)
    gen = torch.Generator().manual_seed(4)
    return {"r": x["q"], "w": x["gk"], "k": x["k"], "v": x["v"], "kk": -x["a"],
            "a": torch.sigmoid(torch.randn(x["a"].shape, generator=gen)), "h0": x["initial_state"]}


def test_the_layer_reaches_dplr_gen(fake_fla: Any) -> None:
    """Training (chunk) and decoding (fused_mul form) through the stand-in layer equal dplr-gen called directly."""
    x = _layer_inputs(8)
    args = (x["r"], x["w"], x["k"], x["v"], x["kk"], x["a"])
    assert fake_fla.attend(*args, training=True)[0] == "fla chunk_rwkv7"  # off: fla's
    with switch.enabled():
        o, ht = fake_fla.attend(*args, training=True, recurrent_state=x["h0"], use_cache=True)
    ro, rht = dplr_gen.chunk_rwkv7(x["r"], x["w"], x["k"], x["v"], -x["kk"], x["kk"] * x["a"], 1.0, x["h0"], True,
                                   lower_bound=-0.6065306597126334, chunk_size=64)
    assert torch.equal(o, ro) and torch.equal(ht, rht)

    step = {n: t[:, :1] if t.dim() == 4 and n != "h0" else t for n, t in x.items()}
    sargs = (step["r"], step["w"], step["k"], step["v"], step["kk"], step["a"])
    with torch.no_grad():
        with switch.enabled():
            o1, h1 = fake_fla.attend(*sargs, recurrent_state=ht, use_cache=True)
        r1, rh1 = dplr_gen.fused_mul_recurrent_rwkv7(*sargs, 1.0, ht, True)
        assert fake_fla.attend(*sargs)[0] == "fla fused_mul_recurrent_rwkv7"
    assert torch.equal(o1, r1) and torch.equal(h1, rh1)


def test_blocks_in_threads_route_until_the_last_exits(fake_fla: Any) -> None:
    """Thread A enters first and leaves first while B is still inside: B's layer calls must still be routed."""
    a_in, a_out, b_in = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, bool] = {}

    def a() -> None:
        with switch.enabled():
            a_in.set()
            b_in.wait(10)
        a_out.set()

    def b() -> None:
        a_in.wait(10)
        with switch.enabled():
            b_in.set()
            a_out.wait(10)
            seen["b after a left"] = _is_dplr(fake_fla.chunk_rwkv7, "chunk_rwkv7")

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert seen == {"b after a left": True}
    assert not switch.is_enabled()

    before = _bound()
    errors: list[str] = []

    def churn() -> None:
        for _ in range(50):
            with switch.enabled():
                if not _is_dplr(fake_fla.chunk_rwkv7, "chunk_rwkv7"):
                    errors.append("off inside a block")

    many = [threading.Thread(target=churn) for _ in range(8)]
    for t in many:
        t.start()
    for t in many:
        t.join(60)
    assert errors == [] and _bound() == before


def test_without_fla_the_error_names_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    saved = _drop_fla()
    try:
        monkeypatch.setitem(sys.modules, "fla", None)  # import fla fails as if not installed
        with pytest.raises(ImportError, match="pip install flash-linear-attention"):
            switch.enable()
        with pytest.raises(ImportError, match="pip install flash-linear-attention"):
            with switch.enabled():
                pass
        assert not switch.is_enabled()
    finally:
        monkeypatch.delitem(sys.modules, "fla")
        sys.modules.update(saved)


def test_importing_dplr_gen_does_not_import_fla() -> None:
    import subprocess

    code = ("import sys, dplr_gen, dplr_gen.integrations.fla, dplr_gen.cp; "
            "assert not [m for m in sys.modules if m == 'fla' or m.startswith('fla.')]; print('OK')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-2000:]
