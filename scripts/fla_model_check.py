"""fla's RWKV7ForCausalLM with fla's own kernels and routed to dplr-gen (dplr_gen.integrations.fla): loss curves of
the same training run, greedy decoding with fla's cache, and the speed of both.

    python scripts/fla_model_check.py [--steps 200 | --quick] [--budget 450 | --deadline EPOCH]

Needs a CUDA GPU with fla-core 0.6.0, flash-linear-attention 0.6.0 and transformers installed, and a built package
for the GPU (`dplr-gen build specs/hopper.yaml`: otherwise dplr-gen compiles its variants on first use, in the
first steps). One model (hidden 512, 4 layers, head dim 64, vocab 1024, bf16 weights) is initialised once from
--seed; each mode starts from that state dict: AdamW for --steps steps on 4 fixed batches of random tokens (one
seed, cycled: the loss falls as the model learns them), then greedy decoding of --new-tokens tokens from a prompt
of --prompt-len tokens (>= 64: fla's layer prefills it with chunk_rwkv7, then decodes with
fused_mul_recurrent_rwkv7), through the model's forward with fla's cache (past_key_values), and once more through
model.generate. Both modes decode with the weights fla's training ended with (the same weights; trained, so the
next token is not a near tie). The dplr-gen mode counts the calls that reach dplr-gen, per op.

Writes $OUT/fla_model_check.json (./out/ without $OUT) after every phase: machine (GPU, torch, Triton, fla,
transformers), the config, per mode the loss curve, training tokens/s (steps after the first --warmup, timed
between device syncs), the decoded tokens, decode tokens/s (a warm-up decode first) and the calls routed; the
losses' max/mean |difference| and whether the tokens match. A phase that fails records its error and the rest
still runs. Every phase gets a share of the deadline and stops early (recording how far it got) when its share is
spent; the default budget (450 s) ends the run within 8 minutes on an H100. Prints a short table last.
--device cpu --dtype float32 runs the same harness on CPU tensors (TRITON_INTERPRET=1; a model that fla's kernels
cannot run there only gets as far as the errors: tests/test_fla_model_check.py runs it with a stand-in fla).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MODES = ("fla", "dplr-gen")
N_BATCHES = 4  # distinct batches, cycled


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=200, help="training steps per mode (default 200)")
    ap.add_argument("--quick", action="store_true", help="20 steps, batch 2 x 256 tokens, 8 new tokens")
    ap.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    ap.add_argument("--seq-len", type=int, default=512, help="tokens per sequence (default 512)")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=10, help="steps left out of the training speed (autotune, JIT)")
    ap.add_argument("--prompt-len", type=int, default=96, help="prompt tokens (>= 64: prefilled by the chunk op)")
    ap.add_argument("--new-tokens", type=int, default=32, help="greedy tokens decoded")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                    help="the model's weights and activations (default bfloat16)")
    ap.add_argument("--budget", type=float, default=450.0, help="seconds for the whole run (default 450)")
    ap.add_argument("--deadline", type=float, help="absolute time.time() to finish by (overrides --budget)")
    ap.add_argument("--fla-max-configs", type=int, default=0,
                    help="fla's Triton autotuners keep N of their configs (bounds fla's first-call autotune; fla's\n"
                         "speed is then not its best: recorded, and marked in the table); 0: all (default)")
    ap.add_argument("--out", type=Path, help="the JSON file (default $OUT/fla_model_check.json, else ./out/)")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.batch, args.seq_len, args.new_tokens = min(args.steps, 20), 2, 256, 8
        args.warmup = min(args.warmup, 5)
    for name in ("steps", "batch", "seq_len", "hidden", "layers", "head_dim", "vocab", "new_tokens", "prompt_len"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.hidden % args.head_dim:
        ap.error(f"--hidden ({args.hidden}) must be a multiple of --head-dim ({args.head_dim})")
    if args.prompt_len > args.seq_len:
        ap.error(f"--prompt-len ({args.prompt_len}) must be at most --seq-len ({args.seq_len}): the prompt is "
                 "the start of a training sequence")
    return args


# ----------------------------------------------------------------------------------------------------------------
# recording


def out_path(args: argparse.Namespace) -> Path:
    if args.out is not None:
        return args.out
    return Path(os.environ.get("OUT") or REPO / "out") / "fla_model_check.json"


def jsonable(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return x if isinstance(x, (str, int, float, bool)) or x is None else str(x)


def write(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(jsonable(record), indent=1) + "\n")
    os.replace(tmp, path)


def version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _git_head() -> str | None:
    import subprocess

    try:
        out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def machine(device: str) -> dict[str, Any]:
    import triton

    info: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
        "fla_core": version("fla-core"), "flash_linear_attention": version("flash-linear-attention"),
        "transformers": version("transformers"), "device": device,
        "dplr_gen_commit": os.environ.get("DPLR_GEN_COMMIT") or _git_head(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if device == "cuda" and torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=torch.cuda.get_device_name(0), capability=f"sm_{p.major}{p.minor}", cuda=torch.version.cuda)
    return info


class Phase:
    """One phase's record: status "ok", "partial" (stopped by its deadline), "error" (with the trace) or
    "skipped"; seconds taken."""

    def __init__(self, record: dict[str, Any], name: str, path: Path) -> None:
        self.rec: dict[str, Any] = {"status": "running"}
        record["phases"][name] = self.rec
        self.record, self.path, self.t0 = record, path, time.time()

    def __enter__(self) -> dict[str, Any]:
        return self.rec

    def __exit__(self, kind: Any, err: Any, tb: Any) -> bool:
        if err is not None:
            self.rec.update(status="error", error=f"{type(err).__name__}: {err}",
                            trace=traceback.format_exc()[-4000:])
            print(f"   error: {type(err).__name__}: {err}", flush=True)
        elif self.rec["status"] == "running":
            self.rec["status"] = "ok"
        self.rec["seconds"] = round(time.time() - self.t0, 2)
        write(self.path, self.record)
        return kind is not None and issubclass(kind, Exception)  # errors are recorded; Ctrl-C still stops


# ----------------------------------------------------------------------------------------------------------------
# the model, the switch


def model_config(args: argparse.Namespace) -> dict[str, Any]:
    return {"hidden_size": args.hidden, "num_hidden_layers": args.layers, "head_dim": args.head_dim,
            "vocab_size": args.vocab, "attn_mode": "chunk"}


def new_model(args: argparse.Namespace) -> Any:
    from fla.models import RWKV7Config, RWKV7ForCausalLM

    torch.manual_seed(args.seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fla's layer warns on every construction
        model = RWKV7ForCausalLM(RWKV7Config(**model_config(args)))
    return model.to(device=args.device, dtype=getattr(torch, args.dtype))


class Routed:
    """For the dplr-gen mode: fla's layer routed to dplr-gen's ops (the switch), counting the calls per op."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()

    def _counted(self, name: str) -> Callable[..., Any]:
        import dplr_gen

        op = getattr(dplr_gen, name)

        def call(*a: Any, **k: Any) -> Any:
            self.calls[name] += 1
            return op(*a, **k)

        return call

    def __enter__(self) -> "Routed":
        from dplr_gen.integrations import fla as switch

        switch.enable(chunk_rwkv7=self._counted("chunk_rwkv7"),
                      fused_mul_recurrent_rwkv7=self._counted("fused_mul_recurrent_rwkv7"))
        return self

    def __exit__(self, *exc: Any) -> None:
        from dplr_gen.integrations import fla as switch

        switch.disable()


def mode_context(mode: str) -> Any:
    import contextlib

    return Routed() if mode == "dplr-gen" else contextlib.nullcontext()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------------------------------------------
# training


def batches(args: argparse.Namespace) -> torch.Tensor:
    """[N_BATCHES, batch, seq_len] random tokens from one seed."""
    g = torch.Generator().manual_seed(args.seed + 1)
    return torch.randint(0, args.vocab, (N_BATCHES, args.batch, args.seq_len), generator=g)


def train(model: Any, args: argparse.Namespace, data: torch.Tensor, until: float, rec: dict[str, Any]) -> None:
    """AdamW steps on the batches in turn; the loss of every step into rec["losses"] (read back every few steps,
    so the host does not wait for the device each step); stops at ``until`` (status "partial")."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    data = data.to(args.device)
    losses: list[torch.Tensor] = []
    rec["losses"] = []
    t_start = None
    timed_from = min(args.warmup, args.steps - 1)
    for step in range(args.steps):
        if step == timed_from:
            sync(args.device)
            t_start = time.perf_counter()
        ids = data[step % N_BATCHES]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().float())
        if step % 10 == 9 or step == args.steps - 1:
            rec["losses"] = torch.stack(losses).tolist()  # a sync: the deadline check below sees real progress
            if time.time() > until and step < args.steps - 1:
                rec["status"] = "partial"
                break
    sync(args.device)
    rec["losses"] = torch.stack(losses).tolist()
    rec["steps"] = len(losses)
    if t_start is not None and len(losses) > timed_from:
        seconds = time.perf_counter() - t_start
        n = len(losses) - timed_from
        rec.update(timed_steps=n, ms_per_step=1e3 * seconds / n,
                   tokens_per_s=n * args.batch * args.seq_len / seconds)


# ----------------------------------------------------------------------------------------------------------------
# decoding


def _greedy(model: Any, prompt: torch.Tensor, n: int) -> tuple[list[int], float, list[torch.Tensor]]:
    """Greedy tokens after ``prompt`` [1, P] through the forward with fla's cache; (tokens, seconds of the n
    decode steps after the prefill, the logits of each step)."""
    out = model(input_ids=prompt, use_cache=True)
    cache, logits = out.past_key_values, [out.logits[:, -1].float()]
    tok = logits[-1].argmax(-1, keepdim=True)
    tokens = [tok]
    sync(str(prompt.device.type))
    t0 = time.perf_counter()
    for _ in range(n - 1):
        out = model(input_ids=tok, past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        logits.append(out.logits[:, -1].float())
        tok = logits[-1].argmax(-1, keepdim=True)
        tokens.append(tok)
    sync(str(prompt.device.type))
    seconds = time.perf_counter() - t0
    return torch.cat(tokens, 1)[0].tolist(), seconds, logits


def decode(model: Any, args: argparse.Namespace, prompt: torch.Tensor, continuation: torch.Tensor | None,
           until: float, rec: dict[str, Any]) -> list[torch.Tensor]:
    """A warm-up decode, then the timed one (and model.generate's tokens, for the record); the timed run's logits."""
    model.eval()
    prompt = prompt.to(args.device)
    with torch.no_grad():
        _greedy(model, prompt, min(4, args.new_tokens))  # autotune, JIT, launch stubs
        tokens, seconds, logits = _greedy(model, prompt, args.new_tokens)
        rec.update(tokens=tokens, decode_steps=args.new_tokens - 1)
        if continuation is not None:  # how much of the trained sequence the model reproduces
            rec["tokens_as_trained"] = sum(int(t == c) for t, c in zip(tokens, continuation.tolist()))
        if args.new_tokens > 1:
            rec["decode_tokens_per_s"] = (args.new_tokens - 1) / seconds
        if time.time() < until:
            try:
                gen = model.generate(prompt, max_new_tokens=args.new_tokens, do_sample=False, use_cache=True)
                rec["generate_tokens"] = gen[0, prompt.shape[1]:].tolist()
            except Exception as e:  # noqa: BLE001 - recorded: the forward loop above is the check
                rec["generate_error"] = f"{type(e).__name__}: {e}"
    return logits


# ----------------------------------------------------------------------------------------------------------------
# the run


def _shares(deadline: float, weights: dict[str, float]) -> Iterator[tuple[str, float]]:
    """Each phase's end time: its share of what is left when it starts (a phase that ends early leaves its time
    to the ones after it)."""
    names = list(weights)
    for i, name in enumerate(names):
        left = deadline - time.time()
        rest = sum(weights[n] for n in names[i:])
        yield name, time.time() + max(left, 0.0) * weights[name] / rest


def compare(record: dict[str, Any]) -> dict[str, Any]:
    ph = record["phases"]
    out: dict[str, Any] = {}
    la, lb = ph.get("train fla", {}).get("losses") or [], ph.get("train dplr-gen", {}).get("losses") or []
    n = min(len(la), len(lb))
    if n:
        d = [abs(x - y) for x, y in zip(la[:n], lb[:n])]
        out.update(loss_steps_compared=n, loss_max_abs_diff=max(d), loss_mean_abs_diff=sum(d) / n,
                   loss_last=(la[n - 1], lb[n - 1]))
    ta, tb = ph.get("decode fla", {}).get("tokens"), ph.get("decode dplr-gen", {}).get("tokens")
    if ta is not None and tb is not None:
        first = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
        out.update(tokens_match=ta == tb, first_token_mismatch=first)
    ga, gb = ph.get("decode fla", {}).get("generate_tokens"), ph.get("decode dplr-gen", {}).get("generate_tokens")
    if ga is not None and gb is not None:
        out["generate_tokens_match"] = ga == gb
    for what in ("tokens_per_s", "decode_tokens_per_s"):
        phase = "train" if what == "tokens_per_s" else "decode"
        a, b = ph.get(f"{phase} fla", {}).get(what), ph.get(f"{phase} dplr-gen", {}).get(what)
        if a and b:
            out[f"{phase}_speedup_dplr_over_fla"] = b / a
    return out


def table(record: dict[str, Any]) -> str:
    def f(x: Any, spec: str = ",.0f") -> str:
        return "-" if x is None else format(x, spec)

    rows = ["phase            status    steps  loss first -> last   tokens/s"]
    limited = record["args"].get("fla_max_configs")
    for mode in MODES:
        p = record["phases"].get(f"train {mode}", {})
        ls = p.get("losses") or []
        loss = f"{ls[0]:.3f} -> {ls[-1]:.3f}" if ls else "-"
        note = f"  (fla autotune limited to {limited} configs)" if limited and mode == "fla" else ""
        rows.append(f"train {mode:<10} {p.get('status', 'skipped'):<9} {p.get('steps', 0):>5}  {loss:<19} "
                    f"{f(p.get('tokens_per_s'))}{note}")
    for mode in MODES:
        p = record["phases"].get(f"decode {mode}", {})
        rows.append(f"decode {mode:<9} {p.get('status', 'skipped'):<9} {len(p.get('tokens') or []):>5}  "
                    f"{'':<19} {f(p.get('decode_tokens_per_s'))}")
    c = record.get("comparison", {})
    rows.append(f"loss |fla - dplr-gen| max / mean over {c.get('loss_steps_compared', 0)} steps: "
                f"{f(c.get('loss_max_abs_diff'), '.3g')} / {f(c.get('loss_mean_abs_diff'), '.3g')}; "
                f"tokens match: {c.get('tokens_match', '-')}; model.generate tokens match: "
                f"{c.get('generate_tokens_match', '-')}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    deadline = args.deadline if args.deadline else time.time() + args.budget
    path = out_path(args)
    record: dict[str, Any] = {"script": "scripts/fla_model_check.py", "args": vars(args) | {"out": str(path)},
                              "machine": machine(args.device), "config": model_config(args), "phases": {}}
    print(f"== fla_model_check: {record['machine'].get('gpu', args.device)}; {args.steps} steps of "
          f"{args.batch} x {args.seq_len} tokens; {deadline - time.time():.0f} s; -> {path}", flush=True)
    init_state = None
    with Phase(record, "setup", path) as rec:
        if args.fla_max_configs:  # before fla is imported: its autotuners are made when its modules load
            from benchmarks.common import limit_autotune_configs

            limit_autotune_configs(args.fla_max_configs)
        model = new_model(args)
        init_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        rec["parameters"] = sum(p.numel() for p in model.parameters())
    data = batches(args)
    decode_state = init_state
    record["decode_weights"] = "initial (no training finished)"
    weights = {"train fla": 4.0, "train dplr-gen": 4.0, "decode fla": 1.0, "decode dplr-gen": 1.0}
    logits: dict[str, list[torch.Tensor]] = {}
    for name, until in _shares(deadline, weights):
        phase, mode = name.split(" ", 1)
        print(f"== {name} ({until - time.time():.0f} s)", flush=True)
        if init_state is None:
            record["phases"][name] = {"status": "skipped", "why": "setup failed"}
            continue
        with Phase(record, name, path) as rec:
            model.load_state_dict(init_state if phase == "train" else decode_state)
            torch.manual_seed(args.seed + 2)
            with mode_context(mode) as routed:
                if phase == "train":
                    train(model, args, data, until, rec)
                else:
                    rec["weights"] = record["decode_weights"]
                    seq = data[0, 0]
                    logits[mode] = decode(model, args, seq[None, :args.prompt_len],
                                          seq[args.prompt_len:args.prompt_len + args.new_tokens], until, rec)
            if routed is not None:
                rec["calls_routed"] = dict(routed.calls)
            if phase == "train" and mode == "fla":  # both modes decode with the weights fla trained
                decode_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
                record["decode_weights"] = "after fla's training"
            elif phase == "train" and record["decode_weights"].startswith("initial"):
                decode_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
                record["decode_weights"] = "after dplr-gen's training (fla's failed)"
    if len(logits) == 2:
        n = min(len(logits["fla"]), len(logits["dplr-gen"]))
        record["decode_logits_max_abs_diff"] = [
            (a - b).abs().max().item() for a, b in zip(logits["fla"][:n], logits["dplr-gen"][:n])]
    record["comparison"] = compare(record)
    write(path, record)
    print(table(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
