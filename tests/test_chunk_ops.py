"""The public chunk ops end to end (argument checks, variant choice, custom ops, autograd) in the interpreter,
against the float64 reference: forward, every gradient, varlen, states, fla keywords, torch.compile."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dplr_gen.runtime import chunk_driver, ops
from dplr_gen.runtime.dispatch import PackageOps
from dplr_gen.testing import rel_err, rwkv7_inputs

from .helpers import reference_with_grads, render_package

SPEC = """
name: chunk_ops_test
targets: [sm_80]
variants:
  - ops: [chunk]
    dtypes: [fp32, fp16]
    head_dims: [32]
    chunk_sizes: [16]
    varlen: [false, true]
    gate_bounds: [null, -0.61]
"""
NAMES = ("q", "k", "v", "a", "b", "gk", "initial_state")


@pytest.fixture(scope="module")
def pkg(tmp_path_factory: pytest.TempPathFactory):
    return render_package(tmp_path_factory.mktemp("gen"), SPEC, "chunk_ops_test")


@pytest.fixture(autouse=True)
def poison(monkeypatch: pytest.MonkeyPatch) -> None:
    # every buffer NaN before the kernels write it
    monkeypatch.setattr(chunk_driver, "OPTIONS", chunk_driver.with_options(poison=True))


def run_op(pkg, x: dict[str, Any], **kw: Any) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    xs = {n: t.detach().clone().requires_grad_(True) for n, t in x.items() if t is not None}
    o, ht = ops.chunk_dplr_delta_rule(**xs, output_final_state=True, package=pkg, **kw)
    return o, ht, xs


@pytest.mark.parametrize("dtype, bound", [(torch.float32, 1e-5), (torch.float16, 3e-3)])
@pytest.mark.parametrize("lower_bound", [None, -0.61])
def test_forward_backward(pkg, dtype: torch.dtype, bound: float, lower_bound: float | None) -> None:
    x = rwkv7_inputs(2, 37, 2, 32, dtype=dtype)  # T not a multiple of the chunk
    o, ht, xs = run_op(pkg, x, lower_bound=lower_bound)
    do, dht = torch.randn_like(o), torch.randn_like(ht)
    torch.autograd.backward((o, ht), (do, dht))
    ro, rht, rg = reference_with_grads(x, None, None, do, dht)
    assert o.dtype == dtype and ht.dtype == torch.float32
    assert rel_err(o, ro) <= bound and rel_err(ht, rht) <= bound
    for n in NAMES:
        assert xs[n].grad.dtype == x[n].dtype
        assert rel_err(xs[n].grad, rg[n]) <= bound, n


def test_varlen_any_lengths(pkg) -> None:
    lens = [1, 15, 16, 17, 33]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    x = rwkv7_inputs(1, sum(lens), 2, 32, dtype=torch.float32, initial_state=False)
    x["initial_state"] = torch.randn(len(lens), 2, 32, 32)
    xs = {n: t.detach().clone().requires_grad_(True) for n, t in x.items()}
    o, ht = ops.chunk_rwkv7(xs["q"], xs["gk"], xs["k"], xs["v"], xs["a"], xs["b"], scale=0.5,
                            initial_state=xs["initial_state"], output_final_state=True, cu_seqlens=cu,
                            cu_seqlens_cpu=cu, package=pkg)
    do, dht = torch.randn_like(o), torch.randn_like(ht)
    torch.autograd.backward((o, ht), (do, dht))
    ro, rht, rg = reference_with_grads(x, 0.5, cu, do, dht)
    assert rel_err(o, ro) <= 1e-5 and rel_err(ht, rht) <= 1e-5
    for n in NAMES:
        assert rel_err(xs[n].grad, rg[n]) <= 1e-5, n


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_varlen_boundaries_read_and_mapped_once_per_value(pkg, monkeypatch: pytest.MonkeyPatch,
                                                         dtype: torch.dtype) -> None:
    """cu_seqlens, int32 or int64: its values are read once per tensor object and its slot map built once per
    value. The forward builds the map, its backward and another layer on the same tensor reuse it without reading
    the tensor again; a new tensor of equal values (a data loader's, either dtype) is read but finds the map; an
    in-place change builds it again, and the gradients follow the new lengths."""
    from dplr_gen.runtime import varlen

    varlen.clear()
    builds: list[int] = []
    reads: list[int] = []
    real_build, real_tolist = varlen.host_chunk_map, torch.Tensor.tolist

    def counted_build(offsets: Any, C: int, n_slots: int) -> torch.Tensor:
        builds.append(C)
        return real_build(offsets, C, n_slots)

    def counted_tolist(t: torch.Tensor) -> Any:
        if t.dtype in (torch.int32, torch.int64) and t.dim() == 1 and t.numel() == 4:
            reads.append(1)
        return real_tolist(t)

    monkeypatch.setattr(varlen, "host_chunk_map", counted_build)
    monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)
    lens = [3, 17, 40]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=dtype)
    x = rwkv7_inputs(1, sum(lens), 2, 32, dtype=torch.float32, initial_state=False)
    do = torch.randn(1, sum(lens), 2, 32)
    dht = torch.randn(len(lens), 2, 32, 32)

    def step(cu: torch.Tensor) -> dict[str, torch.Tensor]:
        xs = {n: t.detach().clone().requires_grad_(True) for n, t in x.items() if t is not None}
        o, ht = ops.chunk_dplr_delta_rule(**xs, output_final_state=True, cu_seqlens=cu, package=pkg)
        torch.autograd.backward((o, ht), (do, dht))
        return {n: t.grad for n, t in xs.items()}

    g = step(cu)
    assert len(builds) == 1 and len(reads) == 1  # forward once; the backward reuses both
    _, _, rg = reference_with_grads(x, None, cu.to(torch.int32), do, dht)
    for n in ("q", "k", "v", "a", "b", "gk"):
        assert rel_err(g[n], rg[n]) <= 1e-5, n
    reads[:] = [1]  # (the reference read the values too)
    step(cu)  # another layer, the same tensor: nothing read, nothing built
    assert len(builds) == 1 and len(reads) == 1
    for other in (cu.clone(), cu.clone().to(torch.int64), cu.clone().to(torch.int32)):  # equal values, new tensors
        step(other)
    assert len(builds) == 1 and len(reads) == 4
    # the same tensor changed in place: read and built again, and the gradients follow the new lengths
    lens2 = [20, 1, 39]
    cu.copy_(torch.tensor([0, *torch.tensor(lens2).cumsum(0).tolist()], dtype=dtype))
    g = step(cu)
    assert len(builds) == 2 and len(reads) == 5
    _, _, rg = reference_with_grads(x, None, cu.to(torch.int32), do, dht)
    for n in ("q", "k", "v", "a", "b", "gk"):
        assert rel_err(g[n], rg[n]) <= 1e-5, n


def test_varlen_boundaries_while_tracing_come_from_the_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    """While a graph is traced or captured nothing is read or kept: the int32 copy and the map are computed
    from the tensor each call, so that a replay reads the values it then holds."""
    from dplr_gen.runtime import varlen

    varlen.clear()
    monkeypatch.setattr(varlen, "tracing", lambda t: True)
    cu = torch.tensor([0, 5, 40], dtype=torch.int64)
    assert varlen.read_offsets(cu, None, 40) is None
    c32 = varlen.int32_boundaries(cu, None)
    assert c32.dtype == torch.int32 and c32.tolist() == [0, 5, 40]
    m = varlen.slot_map(cu, 16, 40 // 16 + 2, (0, 5, 40))
    assert torch.equal(m, varlen.chunk_map_from_cu_seqlens(cu, 16, 40 // 16 + 2))
    assert not varlen._BY_VALUE and not varlen._BY_OBJECT


@pytest.mark.parametrize("keep", [False, True])
def test_varlen_token_pass_per_sequence_equals_the_varlen_kernel(pkg, monkeypatch: pytest.MonkeyPatch,
                                                                   keep: bool) -> None:
    """The varlen token pass as one launch of the dense twin's kernel per sequence (on views of its rows and
    states) gives the varlen kernel's gradients to the bit, on NaN-poisoned buffers, one launch per sequence, in
    the sequences' order."""
    lens = [1, 15, 16, 17, 40]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    x = rwkv7_inputs(1, sum(lens), 2, 32, dtype=torch.float32, initial_state=False)
    x["initial_state"] = torch.randn(len(lens), 2, 32, 32)
    do, dht = torch.randn_like(x["v"]), torch.randn_like(x["initial_state"])
    launched: list[list[int]] = []
    real = chunk_driver._token_pass_per_sequence
    monkeypatch.setattr(chunk_driver, "_token_pass_per_sequence",
                        lambda twin, seqs, *a: launched.append([e - b for b, e, _ in seqs]) or real(twin, seqs, *a))
    grads = {}
    for per_seq in (False, True):
        monkeypatch.setattr(chunk_driver, "OPTIONS",
                            chunk_driver.with_options(per_sequence=per_seq))
        o, ht, xs = run_op(pkg, x, cu_seqlens=cu, cu_seqlens_cpu=cu, lower_bound=-0.61, disable_recompute=keep)
        torch.autograd.backward((o, ht), (do, dht))
        grads[per_seq] = {n: t.grad for n, t in xs.items()}
    assert launched == [lens]
    for n in NAMES:
        assert not grads[True][n].isnan().any() and torch.equal(grads[True][n], grads[False][n]), n
    _, _, rg = reference_with_grads(x, None, cu, do, dht)
    for n in NAMES:
        assert rel_err(grads[True][n], rg[n]) <= 1e-5, n


def test_carved_buffers_are_disjoint_aligned_and_contiguous() -> None:
    """_empty_parts: each part has its shape, is contiguous, starts at a multiple of _PART_ALIGN elements of one
    allocation (the kernels assume 16-byte-aligned pointers) and overlaps no other part."""
    shapes = [(3, 2, 5), (7,), (1, 4096, 2, 128), (2, 3)]
    parts = chunk_driver._empty_parts(shapes, torch.bfloat16, torch.device("cpu"))
    base = parts[0].untyped_storage().data_ptr()
    spans = []
    for part, shape in zip(parts, shapes):
        assert part.shape == shape and part.is_contiguous() and part.untyped_storage().data_ptr() == base
        assert part.storage_offset() % chunk_driver._PART_ALIGN == 0
        spans.append((part.storage_offset(), part.storage_offset() + part.numel()))
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))


def test_per_sequence_rows_as_addresses_are_the_views_addresses() -> None:
    """The per-sequence launches' arguments on CUDA: the address of a sequence's rows (by token for [1, T, H, K]
    tensors, by slot for the states and flags) is the data pointer of the view of them, the one the CPU passes."""
    for t, dim in ((torch.randn(1, 100, 3, 8, dtype=torch.bfloat16), 1), (torch.randn(40, 3, 8, 8), 0),
                   (torch.zeros(40, 3, dtype=torch.int32), 0), (torch.randn(1, 100, 3, 8)[:, 5:], 1)):
        as_address, as_view = chunk_driver._rows_at(t, dim, address=True), chunk_driver._rows_at(t, dim)
        for first, count in ((0, 7), (13, 20), (30, 5)):
            view = as_view(first, count)
            assert torch.equal(view, t.narrow(dim, first, count)) and as_address(first, count) == view.data_ptr()
    assert chunk_driver._rows_at(None, 0)(3, 4) is None


def test_one_side_stream_per_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """The states pass and the per-sequence launches share one side stream per device; off CUDA there is none."""
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: object())
    chunk_driver._side_stream.cache_clear()
    try:
        assert chunk_driver._side_stream(torch.device("cuda", 0)) is chunk_driver._side_stream(torch.device("cuda", 0))
        assert chunk_driver._side_stream(torch.device("cuda", 1)) is not chunk_driver._side_stream(torch.device("cuda", 0))
        assert chunk_driver._side_stream(torch.device("cpu")) is None
    finally:
        chunk_driver._side_stream.cache_clear()


@pytest.mark.parametrize("form", ["int64", "int32", "no host copy"])
def test_the_overlap_rule_sees_the_sequence_starts(pkg, monkeypatch: pytest.MonkeyPatch, form: str) -> None:
    """The backward asks the overlap rule with the sequence starts the op read on the host (whatever the dtype of
    cu_seqlens, with or without cu_seqlens_cpu), so that mixed lengths count at their occupancy; a dense batch
    asks without them."""
    asked: list[Any] = []
    monkeypatch.setattr(chunk_driver, "_overlap",
                        lambda ks, q, N, V, offsets=None: asked.append((N, offsets)) and False)
    lens = [3, 40, 9]
    cu = torch.tensor([0, 3, 43, 52], dtype=torch.int32 if form == "int32" else torch.int64)
    x = rwkv7_inputs(1, sum(lens), 2, 32, dtype=torch.float32, initial_state=False)
    extra = {} if form == "no host copy" else {"cu_seqlens_cpu": cu}
    o, ht, _ = run_op(pkg, x, cu_seqlens=cu, lower_bound=-0.61, **extra)
    torch.autograd.backward((o, ht), (torch.randn_like(o), torch.randn_like(ht)))
    assert [(n, list(offs)) for n, offs in asked] == [(3, [0, 3, 43, 52])], asked
    asked.clear()
    d = rwkv7_inputs(2, 20, 2, 32, dtype=torch.float32, initial_state=False)
    o, _, _ = run_op(pkg, d, lower_bound=-0.61)
    o.sum().backward()
    assert asked == [(2, None)], asked


def test_varlen_without_a_dense_twin_keeps_the_varlen_kernel(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A package whose varlen variant has no dense twin: no launch per sequence even where forced, the varlen
    token pass runs and the gradients are right."""
    spec = SPEC.replace("varlen: [false, true]", "varlen: [true]").replace("chunk_ops_test", "varlen_only")
    vpkg = render_package(tmp_path, spec, "varlen_only")
    variant = next(n for n in vpkg.variants if "fp32" in n and "gbm0p61" in n)
    assert ops._dense_twin(str(vpkg.dir), variant, torch.device("cpu")) is None
    monkeypatch.setattr(chunk_driver, "OPTIONS", chunk_driver.with_options(per_sequence=True))
    launched: list[int] = []
    real = chunk_driver._token_pass_per_sequence
    monkeypatch.setattr(chunk_driver, "_token_pass_per_sequence",
                        lambda twin, seqs, *a: launched.append(len(seqs)) or real(twin, seqs, *a))
    lens = [7, 30]
    cu = torch.tensor([0, 7, 37], dtype=torch.int32)
    x = rwkv7_inputs(1, 37, 2, 32, dtype=torch.float32, initial_state=False)
    o, ht, xs = run_op(vpkg, x, cu_seqlens=cu, cu_seqlens_cpu=cu, lower_bound=-0.61)
    do, dht = torch.randn_like(o), torch.randn_like(ht)
    torch.autograd.backward((o, ht), (do, dht))
    assert launched == []
    _, _, rg = reference_with_grads(x, None, cu, do, dht)
    for n in ("q", "k", "v", "a", "b", "gk"):
        assert rel_err(xs[n].grad, rg[n]) <= 1e-5, n
    assert len(lens) == ht.shape[0]


def test_per_sequence_launch_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """A launch per sequence only with the twin and the host's offsets, for a pass that is one kernel, few
    sequences each with enough waves of work on the device, never while a graph is captured;
    DriverOptions.per_sequence forces it either way (a split pass too)."""
    from types import SimpleNamespace

    monkeypatch.setattr(chunk_driver, "_device_sms", lambda dev: 10)
    capturing = [False]
    monkeypatch.setattr(chunk_driver, "_capturing", lambda: capturing[0])

    def kset(resident: int | None, persistent: bool = True, derive: bool = False, split: bool = False
             ) -> SimpleNamespace:
        opts = {"persistent": [chunk_driver.BWD] if persistent else [], "states_every": 32 if derive else 16,
                "split_token_pass": "second_kernel" if split else None}
        return SimpleNamespace(constexprs=lambda name: {"BC": 16}, option=lambda n, d=None: opts.get(n, d),
                               resident_per_sm=lambda name, dev: resident)

    dev = torch.device("cuda")
    H = 4
    wave = 2 * 10  # resident programs on the device
    need = chunk_driver.PER_SEQUENCE_MIN_WAVES * wave  # items a sequence needs: 16 * need / H tokens

    def saved(lens: list[int], twin: Any, offsets: bool = True) -> dict[str, Any]:
        offs = [0, *torch.tensor(lens).cumsum(0).tolist()]
        return {"twin": twin, "offsets": offs if offsets else None, "cu_seqlens": torch.tensor(offs), "TC": 16,
                "q": torch.empty(1, 1, H, 8)}

    ks, twin = kset(2), kset(2)
    long = 16 * need // H
    got = chunk_driver.per_sequence_launches(ks, saved([long, long + 5], twin), 1, dev)
    assert got == [(0, long, 0), (long, 2 * long + 5, long // 16 + 1)]
    assert chunk_driver.per_sequence_launches(ks, saved([long, long - 16], twin), 1, dev) is None  # too short
    assert chunk_driver.per_sequence_launches(ks, saved([long, long - 16], twin), 2, dev) is not None  # K blocks
    assert chunk_driver.per_sequence_launches(ks, saved([long] * 65, twin), 1, dev) is None  # too many
    assert chunk_driver.per_sequence_launches(ks, saved([long] * 2, None), 1, dev) is None  # no twin
    assert chunk_driver.per_sequence_launches(ks, saved([long] * 2, twin, offsets=False), 1, dev) is None
    assert chunk_driver.per_sequence_launches(ks, saved([long] * 2, kset(None)), 1, dev) is None  # residency
    assert chunk_driver.per_sequence_launches(ks, saved([long] * 2, kset(2, persistent=False)), 1, dev) is None
    assert chunk_driver.per_sequence_launches(ks, saved([long] * 2, kset(2, derive=True)), 1, dev) is None
    assert chunk_driver.per_sequence_launches(kset(2, derive=True), saved([long] * 2, twin), 1, dev) is None
    split = kset(2, split=True)
    assert chunk_driver.per_sequence_launches(split, saved([long] * 2, split), 1, dev) is None  # split pass
    capturing[0] = True
    assert chunk_driver.per_sequence_launches(ks, saved([long] * 2, twin), 1, dev) is None
    monkeypatch.setattr(chunk_driver, "OPTIONS", chunk_driver.with_options(per_sequence=True))
    assert chunk_driver.per_sequence_launches(ks, saved([long] * 2, twin), 1, dev) is None  # not in a capture
    capturing[0] = False
    assert chunk_driver.per_sequence_launches(ks, saved([1, 2], kset(None)), 1, dev) == [(0, 1, 0), (1, 3, 1)]
    assert chunk_driver.per_sequence_launches(split, saved([1, 2], split), 1, dev) == [(0, 1, 0), (1, 3, 1)]
    monkeypatch.setattr(chunk_driver, "OPTIONS", chunk_driver.with_options(per_sequence=False))
    assert chunk_driver.per_sequence_launches(ks, saved([long] * 2, twin), 1, dev) is None


def test_slot_map_from_host_offsets_equals_the_device_build() -> None:
    """The map built on the host from read boundaries is the device build's, laid out sequence by sequence
    (few sequences) or by the same torch ops (many), on fresh random lengths, one- and many-chunk sequences,
    lengths at and around multiples of C, a single sequence, and a sequence longer than any before it."""
    from dplr_gen.runtime import varlen

    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    cases = [[1, 15, 16, 17, 64, 100, 3], [4096], [1] * 5, [33, 32, 31, 1, 2]]
    cases += [torch.randint(1, 300, (n,), generator=gen).tolist() for n in (2, 9, varlen.HOST_MAP_MAX_SEQS,
                                                                             varlen.HOST_MAP_MAX_SEQS + 1, 200)]
    cases += [[5, 50000]]  # more chunks than any sequence so far: the counting run grows
    for lens in cases:
        offs = [0, *torch.tensor(lens).cumsum(0).tolist()]
        cu = torch.tensor(offs, dtype=torch.int32)
        for C in (16, 32, 64):
            n_slots = offs[-1] // C + len(lens)
            want = chunk_driver.chunk_map_from_cu_seqlens(cu, C, n_slots)
            host = varlen.host_chunk_map(tuple(offs), C, n_slots)
            assert host.dtype == torch.int32 and host.shape == (n_slots, 2)
            assert torch.equal(host, want), (lens, C)
            varlen.clear()
            assert torch.equal(chunk_driver.slot_map(cu, C, n_slots, offs), want)


def test_extreme_gates_no_nan(pkg) -> None:
    x = rwkv7_inputs(1, 40, 2, 32, dtype=torch.float32)
    x["gk"][:, 3] = float("-inf")
    x["gk"][:, 20:24] = 0.0
    x["gk"][:, 30] = -50.0
    o, ht, xs = run_op(pkg, x)
    do, dht = torch.randn_like(o), torch.randn_like(ht)
    torch.autograd.backward((o, ht), (do, dht))
    ro, rht, rg = reference_with_grads(x, None, None, do, dht)
    assert rel_err(o, ro) <= 1e-5 and rel_err(ht, rht) <= 1e-5
    for n in NAMES:
        assert torch.isfinite(xs[n].grad).all(), n
        assert rel_err(xs[n].grad, rg[n]) <= 1e-5, n


def delta_rule_inputs(B: int, T: int, H: int, K: int, dtype: torch.dtype, signed: bool) -> dict[str, Any]:
    """Generalized-delta-rule inputs as fla's tests make them: b = -a with a L2-normalised (non-negative or signed),
    slow gates logsigmoid(randn) / 10, random h0. Correlated non-negative a makes every row of |A_ab| sum to ~7:
    the prep inverts (I - A_ab) by forward substitution there, by the product form on RWKV-7 inputs."""
    a = torch.nn.functional.normalize(torch.randn(B, T, H, K) if signed else torch.rand(B, T, H, K), dim=-1)
    x = {"q": torch.randn(B, T, H, K), "k": torch.randn(B, T, H, K), "v": torch.randn(B, T, H, K), "a": a, "b": -a,
         "gk": torch.nn.functional.logsigmoid(torch.randn(B, T, H, K)) / 10}
    return {**{n: t.to(dtype) for n, t in x.items()}, "initial_state": torch.randn(B, H, K, K)}


@pytest.mark.parametrize("dtype, bound", [(torch.float32, 1e-5), (torch.float16, 3e-3)])
@pytest.mark.parametrize("signed", [False, True])
def test_delta_rule_inputs(pkg, dtype: torch.dtype, bound: float, signed: bool) -> None:
    x = delta_rule_inputs(1, 45, 2, 32, dtype, signed)
    o, ht, xs = run_op(pkg, x, scale=32**-0.5)
    do, dht = torch.randn_like(o), torch.randn_like(ht)
    torch.autograd.backward((o, ht), (do, dht))
    ro, rht, rg = reference_with_grads(x, 32**-0.5, None, do, dht)
    assert rel_err(o, ro) <= bound and rel_err(ht, rht) <= bound
    for n in NAMES:
        assert rel_err(xs[n].grad, rg[n]) <= bound, n


def test_t1_and_fla_keywords(pkg) -> None:
    x = rwkv7_inputs(3, 1, 2, 32, dtype=torch.float32)
    o, ht, _ = run_op(pkg, x, chunk_size=64, safe_gate=True, disable_recompute=True)
    ro, rht, _ = reference_with_grads(x, None, None, torch.zeros(3, 1, 2, 32), torch.zeros(3, 2, 32, 32))
    assert rel_err(o, ro) <= 1e-5 and rel_err(ht, rht) <= 1e-5
    with pytest.raises(ValueError, match="chunk_size"):
        run_op(pkg, x, chunk_size=48)
    with pytest.raises(ValueError, match="lower_bound"):
        run_op(pkg, x, lower_bound=0.5)


@pytest.mark.parametrize("varlen", [False, True])
def test_disable_recompute_keeps_the_states_and_changes_nothing(pkg, monkeypatch: pytest.MonkeyPatch,
                                                                 varlen: bool) -> None:
    """fla's disable_recompute=True: the backward uses the forward's chunk-start states and U (no states
    pass) and gives bit-identical gradients, on every backward through the graph. The forward also runs the
    backward's prep, which the first backward takes (no prep of its own) and a second one recomputes."""
    x = rwkv7_inputs(1, 40, 2, 32, dtype=torch.float32)
    kw: dict[str, Any] = {}
    if varlen:
        kw["cu_seqlens"] = torch.tensor([0, 17, 40], dtype=torch.int32)
        x["initial_state"] = torch.randn(2, 2, 32, 32)
    calls, preps = [], []
    real, real_prep = chunk_driver.chunk_states, chunk_driver.chunk_prep
    monkeypatch.setattr(chunk_driver, "chunk_states", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(chunk_driver, "chunk_prep",
                        lambda *a, **k: preps.append(k.get("for_bwd", False)) or real_prep(*a, **k))
    results = {}
    for keep in (False, True):
        calls.clear()
        preps.clear()
        o, ht, xs = run_op(pkg, x, disable_recompute=keep, **kw)
        assert preps == [keep]  # the forward's prep: the backward's where the states are kept
        # twice through one graph: the kept states are read, never written over (the backward writes dq over
        # U only where it recomputed U itself)
        for i in range(2):
            torch.autograd.backward((o, ht), (torch.ones_like(o), torch.ones_like(ht)), retain_graph=True)
            assert preps[1:] == [True] * (i + (not keep))  # kept: the first backward has the forward's prep
        results[keep] = [xs[n].grad / 2 for n in NAMES]
        assert len(calls) == (0 if keep else 2)  # the states-only pass runs only when nothing was kept
        # without grad mode no backward can follow: the forward keeps nothing and runs its own prep
        preps.clear()
        kept = []
        real_fwd = chunk_driver.chunk_dplr_fwd
        monkeypatch.setattr(chunk_driver, "chunk_dplr_fwd", lambda *a: kept.append(a[11]) or real_fwd(*a))
        with torch.no_grad():
            o_ng, ht_ng, _ = run_op(pkg, x, disable_recompute=keep, **kw)
        monkeypatch.setattr(chunk_driver, "chunk_dplr_fwd", real_fwd)
        assert preps == [False] and kept == [False]
        assert torch.equal(o_ng, o) and torch.equal(ht_ng, ht)
    for n, g0, g1 in zip(NAMES, results[False], results[True]):
        assert torch.equal(g0, g1), n


def test_lower_bound_selects_bounded_variant(pkg) -> None:
    loose = ops._select(str(pkg.dir), "chunk", torch.float32, 32, 32, False, None, -0.61)
    assert pkg.variants[loose].gate_bound == -0.61
    # a weaker promise than the built bound cannot use the bounded variant: it falls back to the safe one
    safe = ops._select(str(pkg.dir), "chunk", torch.float32, 32, 32, False, None, -2.0)
    assert pkg.variants[safe].gate_bound is None
    assert pkg.variants[ops._select(str(pkg.dir), "chunk", torch.float32, 32, 32, False)].gate_bound is None


GATE_SPEC = """
name: gate_dtype_test
targets: [sm_80]
variants:
  - ops: [chunk]
    dtypes: [fp16]
    head_dims: [32]
    chunk_sizes: [16]
    varlen: [false]
    gate_bounds: [-0.61]
  - ops: [chunk]
    dtypes: [fp16]
    head_dims: [32]
    chunk_sizes: [16]
    varlen: [false]
    gate_bounds: [-0.61]
    gate_dtype: same
"""


def test_gate_read_in_its_own_dtype_gives_the_same_bits(tmp_path) -> None:
    """gk in the inputs' dtype selects the variant that reads it as it is (no conversion kernels); gk in fp32
    the fp32-gate twin. Both compute from the same gate values and round dgk once to gk's dtype, so every
    output and gradient is bit-identical, and both match the float64 reference."""
    gpkg = render_package(tmp_path, GATE_SPEC, "gate_dtype_test")
    d = str(gpkg.dir)
    pick = {g: gpkg.variants[ops._select(d, "chunk", torch.float16, 32, 32, False, None, -0.61, g)].gate_dtype
            for g in (torch.float16, torch.float32, None)}
    assert pick == {torch.float16: "fp16", torch.float32: "fp32", None: "fp32"}
    x = rwkv7_inputs(1, 37, 2, 32, dtype=torch.float16)
    do = torch.randn(1, 37, 2, 32).half()
    dht = torch.randn(1, 2, 32, 32)
    res = {}
    for wide in (False, True):
        xs = {n: t.detach().clone().requires_grad_(True) for n, t in x.items()}
        gk = xs["gk"].float() if wide else xs["gk"]  # fp32 gk: the fp32-gate variant, grad back through .float()
        o, ht = ops.chunk_dplr_delta_rule(xs["q"], xs["k"], xs["v"], xs["a"], xs["b"], gk,
                                          initial_state=xs["initial_state"], output_final_state=True,
                                          lower_bound=-0.61, package=gpkg)
        torch.autograd.backward((o, ht), (do, dht))
        res[wide] = [o, ht] + [xs[n].grad for n in NAMES]
    assert res[False][2 + NAMES.index("gk")].dtype == torch.float16
    for name, narrow, wide in zip(("o", "ht", *NAMES), res[False], res[True]):
        assert torch.equal(narrow, wide), name
    ro, rht, rg = reference_with_grads(x, None, None, do, dht)
    assert rel_err(res[False][0], ro) <= 3e-3 and rel_err(res[False][1], rht) <= 3e-3
    for n, g in zip(NAMES, res[False][2:]):
        assert rel_err(g, rg[n]) <= 3e-3, n


def test_gate_dtype_that_no_variant_reads_is_named(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A package whose only variants read gk in fp16 does not take an fp32 gk (rounding it would change the
    result): an fp32-gate variant is generated on demand; with DPLR_GEN_NO_JIT=1 the error names the request's
    gate dtype and the spec entry (an fp32-gate group) that ships it."""
    header, _fp32_group, same_group = GATE_SPEC.split("  - ops: [chunk]\n")
    narrow = render_package(tmp_path, header.replace("gate_dtype_test", "gate_narrow") + "  - ops: [chunk]\n"
                            + same_group, "gate_narrow")
    assert {v.gate_dtype for v in narrow.variants.values()} == {"fp16"}
    assert narrow.variants[ops._select(str(narrow.dir), "chunk", torch.float16, 32, 32, False, None, -0.61,
                                       torch.float16)].gate_dtype == "fp16"
    monkeypatch.setenv("DPLR_GEN_NO_JIT", "1")
    with pytest.raises(ValueError, match=r"fp16 K=32 V=32 dense gk fp32 with gates >= -0.61.*gate_bounds: \[-0.61\]\}"):
        ops._select(str(narrow.dir), "chunk", torch.float16, 32, 32, False, None, -0.61, torch.float32)
    monkeypatch.delenv("DPLR_GEN_NO_JIT")
    generated = ops._select(str(narrow.dir), "chunk", torch.float16, 32, 32, False, None, -0.61, torch.float32)
    assert not narrow.built(generated) and narrow.variants[generated].gate_dtype == "fp32"


@pytest.mark.parametrize("keep_states", [False, True])
def test_torch_compile_fullgraph_with_backward(pkg, keep_states: bool) -> None:
    """One compiled graph: the forward custom op (with or without kept states) and the backward one."""
    torch._dynamo.reset()
    x = rwkv7_inputs(1, 20, 1, 32, dtype=torch.float32)

    def loss(q, k, v, a, b, gk, h0):
        # through the package's bound op (what generated/<spec> exports), keyword arguments, as users call it
        o, ht = PackageOps(pkg).chunk_rwkv7(r=q, w=gk, k=k, v=v, a=a, b=b, scale=1.0, initial_state=h0,
                                output_final_state=True, lower_bound=-0.61, disable_recompute=keep_states)
        return (o * o).sum() + ht.sum()

    def grads(f):
        xs = [x[n].detach().clone().requires_grad_(True) for n in NAMES]
        f(*xs).backward()
        return [t.grad for t in xs]

    eager = grads(loss)
    compiled = grads(torch.compile(loss, fullgraph=True, backend="aot_eager"))
    for e, c in zip(eager, compiled):
        assert rel_err(c, e) < 1e-6


def test_shipped_package_and_top_level_dispatch() -> None:
    import dplr_gen
    import generated.ampere as g

    x = rwkv7_inputs(1, 5, 1, 64, dtype=torch.float32)
    o1, h1 = g.chunk_rwkv7(x["q"], x["gk"], x["k"], x["v"], x["a"], x["b"], initial_state=x["initial_state"],
                           output_final_state=True, lower_bound=-0.61)
    o2, h2 = dplr_gen.chunk_rwkv7(x["q"], x["gk"], x["k"], x["v"], x["a"], x["b"],
                                  initial_state=x["initial_state"], output_final_state=True)
    ro, rht, _ = reference_with_grads(x, 1.0, None, torch.zeros_like(o1), torch.zeros_like(h1))
    for o, h in ((o1, h1), (o2, h2)):
        assert rel_err(o, ro) <= 1e-5 and rel_err(h, rht) <= 1e-5
    assert "chunk_bf16_k64_v64_c16_dense_gbm0p61_gfp32_sfp32" in g.variants


NARROW = """
name: chunk_narrow_test
targets: [sm_86]
variants:
  - ops: [chunk]
    dtypes: [fp32]
    head_dims: [[32, 48]]
    chunk_sizes: [16]
    varlen: [false]
    gate_bounds: [null, -0.61]
target_tuning:
  sm_86:
    chunk.bwd: {block_v: 16}
"""


@pytest.mark.parametrize("lower_bound", [None, -0.61])
def test_narrow_v_tiles_in_backward(tmp_path_factory: pytest.TempPathFactory, lower_bound: float | None) -> None:
    """The 99 KB archs run the backward with 16-wide V tiles (specs' target_tuning): several V blocks."""
    pkg = render_package(tmp_path_factory.mktemp("gen"), NARROW, "chunk_narrow_test")
    x = rwkv7_inputs(1, 21, 2, 32, 48, dtype=torch.float32)
    o, ht, xs = run_op(pkg, x, lower_bound=lower_bound)
    do, dht = torch.randn_like(o), torch.randn_like(ht)
    torch.autograd.backward((o, ht), (do, dht))
    ro, rht, rg = reference_with_grads(x, None, None, do, dht)
    assert rel_err(o, ro) <= 1e-5 and rel_err(ht, rht) <= 1e-5
    for n in NAMES:
        assert rel_err(xs[n].grad, rg[n]) <= 1e-5, n


def test_fused_recurrent_backward_through_chunk_kernels(tmp_path_factory: pytest.TempPathFactory) -> None:
    spec = SPEC.replace("chunk_ops_test", "fr_bwd_test") + """  - ops: [fused_recurrent]
    dtypes: [fp32]
    head_dims: [32]
    varlen: [false]
"""
    pkg = render_package(tmp_path_factory.mktemp("gen"), spec, "fr_bwd_test")
    x = rwkv7_inputs(2, 19, 2, 32, dtype=torch.float32)
    xs = {n: t.detach().clone().requires_grad_(True) for n, t in x.items()}
    o, ht = ops.fused_recurrent_dplr_delta_rule(**xs, output_final_state=True, package=pkg)
    do, dht = torch.randn_like(o), torch.randn_like(ht)
    torch.autograd.backward((o, ht), (do, dht))
    ro, rht, rg = reference_with_grads(x, None, None, do, dht)
    assert rel_err(o, ro) <= 1e-5 and rel_err(ht, rht) <= 1e-5
    for n in NAMES:
        assert rel_err(xs[n].grad, rg[n]) <= 1e-5, n


def _peak_tracker() -> tuple[Any, list[int]]:
    """(an on_alloc callback for DriverOptions, [the most bytes of the driver's buffers alive at once so far])."""
    import weakref

    live: dict[int, int] = {}
    peak = [0]

    def tracked(t: torch.Tensor) -> None:
        live[id(t)] = t.numel() * t.element_size()
        weakref.finalize(t, live.pop, id(t), None)
        peak[0] = max(peak[0], sum(live.values()))

    return tracked, peak


@pytest.mark.parametrize("keep_states", [False, True])
def test_backward_peak_memory_is_the_states_and_one_buffer_per_gradient(tmp_path, monkeypatch: pytest.MonkeyPatch,
                                                                       keep_states: bool) -> None:
    """The largest set of dplr-gen buffers alive at once during forward + backward (states recomputed; kept:
    below): o, the final state, the small ones, and the largest of three phases, nothing else. The reverse pass
    runs first, with the whole backward prep (W, M, (B e^..)^T, (K e^..)^T, Y, (Q e^gamma)^T, (A e^gamma')^T,
    P, A_qk^T, A_ak^T, e^gamma_C) and what it writes (dh, dR, dv); then the states pass, with only its own
    operands of the prep (W, M, (B e^..)^T, (K e^..)^T, e^gamma_C) beside dh, dR, dv and what it writes (h, U);
    then the token pass (h, dh, dq written over U, dk over dR, dv, da, db, dgk). With the states pass first the
    reverse pass held h and U beside its operands (docs/design.md, buffers reused).
    States kept by the forward (``disable_recompute``): its prep is the backward's with the forward's operands
    too, beside h and U; it hands the backward that prep without the states pass's operands (W, M,
    (B e^..)^T), so the backward runs no prep and no states pass, and the reverse pass holds the rest beside h
    and U; then the token pass, with dq in a buffer of its own (U is the forward's)."""
    tracked, peak = _peak_tracker()
    gpkg = render_package(tmp_path, GATE_SPEC, "gate_dtype_test")  # gk read in fp16, as RWKV-7's w
    monkeypatch.setattr(chunk_driver, "OPTIONS", chunk_driver.with_options(on_alloc=tracked))
    B, T, H, K = 1, 64, 2, 32
    x = rwkv7_inputs(B, T, H, K, dtype=torch.float16)
    o, ht, xs = run_op(gpkg, x, lower_bound=-0.61, disable_recompute=keep_states)
    torch.autograd.grad((o, ht), [xs[n] for n in NAMES], (torch.randn_like(o), torch.randn_like(ht)))
    C = 16
    token = B * T * H * K * 2  # one [B, T, H, K] fp16 tensor
    cc = token * C // K  # one [chunks, H, C, C] fp16 tensor
    egc = (T // C) * B * H * K * 4  # e^gamma_C, fp32 per chunk
    states = (T // C) * B * H * K * K * 4  # h or dh: fp32 for fp16 variants
    small = B * H * K * K * 4  # the final state, d(initial state)
    reverse_pass = states + token + 7 * token + 4 * cc + egc + 2 * token  # dh, o, the prep, dR, dv
    states_pass = 2 * states + token + 3 * token + cc + egc + 2 * token + token + small  # h, dh, o, ops, dR, dv, U, ht
    token_pass = 2 * states + token + 6 * token  # h, dh, o, dq (= U), dk (= dR), dv, da, db, dgk
    model = 2 * small + max(reverse_pass, states_pass, token_pass)
    if keep_states:
        forward = token + 8 * token + 6 * cc + egc + states + token  # o, the prep with the forward's operands, h, U
        reverse_pass = 2 * states + 2 * token + 4 * token + 3 * cc + egc + 2 * token  # h, dh, U, o, ops, dR, dv
        token_pass = 2 * states + 2 * token + 6 * token  # h, dh, U, o, dq, dk (= dR), dv, da, db, dgk
        model = 2 * small + max(forward, reverse_pass, token_pass)
    assert peak[0] <= model, f"peak {peak[0]} B, model {model} B"
    assert peak[0] >= 2 * states + 5 * token  # the tracker saw the backward


def test_launches_skipped_leave_every_output_unwritten(pkg) -> None:
    """DriverOptions.launch=False (scripts/memory_peak.py): no kernel runs, so the NaN-poisoned outputs and
    gradients stay NaN, and launching again computes as before."""
    x = rwkv7_inputs(1, 37, 2, 32, dtype=torch.float32)
    with chunk_driver.forced(launch=False):
        o, ht, xs = run_op(pkg, x, lower_bound=-0.61)
        grads = torch.autograd.grad((o, ht), [xs[n] for n in NAMES], (torch.randn_like(o), torch.randn_like(ht)))
    assert o.isnan().all() and ht.isnan().all() and all(g.isnan().all() for g in grads)
    o, ht, _ = run_op(pkg, x, lower_bound=-0.61)
    ro, rht, _ = reference_with_grads(x, None, None, torch.randn_like(o), torch.randn_like(ht))
    assert rel_err(o, ro) <= 1e-5 and rel_err(ht, rht) <= 1e-5


@pytest.mark.parametrize("varlen", [False, True])
def test_states_pass_before_the_reverse_pass_changes_no_result(pkg, varlen: bool) -> None:
    """The backward's two passes in the side-by-side order (the states pass first, forced with
    DriverOptions.overlap; on the CPU one after the other on one stream) give the gradients of the one-stream
    order (reverse pass first) bit for bit; it holds more at once: the reverse pass's operands beside h and U."""
    cu = torch.tensor([0, 17, 20, 53], dtype=torch.int64) if varlen else None
    x = rwkv7_inputs(1 if varlen else 2, 53 if varlen else 37, 2, 32, dtype=torch.float32, initial_state=not varlen)
    if varlen:
        x["initial_state"] = torch.randn(3, 2, 32, 32)
    do, dht = None, None
    results, peaks = {}, {}
    for order in (False, True):
        tracked, peak = _peak_tracker()
        with chunk_driver.forced(overlap=order, on_alloc=tracked, poison=True):
            o, ht, xs = run_op(pkg, x, cu_seqlens=cu)
            if do is None:
                do, dht = torch.randn_like(o), torch.randn_like(ht)
            grads = torch.autograd.grad((o, ht), [xs[n] for n in NAMES], (do, dht))
        results[order], peaks[order] = [g.clone() for g in grads], peak[0]
    for n, a, b in zip(NAMES, results[False], results[True]):
        assert torch.equal(a, b), n
    assert not any(g.isnan().any() for g in results[True])
    assert peaks[True] > peaks[False]
