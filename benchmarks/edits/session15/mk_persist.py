"""Make edit sets: the K=64 token pass as a persistent loop over G (slot, head) items per program."""
import json, re, sys, textwrap
from pathlib import Path
U = Path(sys.argv[1]); out = Path(sys.argv[2])
src = U.read_text()
start = src.index("def chunk_dplr_bwd_kernel(")
end = src.index("\n\n\nSIGNATURES", start)
kern = src[start:end]
head, body = kern.split("):\n", 1)
sig = head + "):\n"
# straight-line V iteration (V == BV at K = 64)
loop_hdr = "    for i_v in range(tl.cdiv(V, BV)):\n"
pre, rest = body.split(loop_hdr, 1)
# the loop body is the indented block at 8 spaces until a line with 4-space indentation that is not blank
lines = rest.split("\n")
i = 0
while i < len(lines) and (lines[i].startswith("        ") or lines[i].strip() == ""):
    i += 1
loop_body = "\n".join(l[4:] if l.startswith("        ") else l for l in lines[:i])
after = "\n".join(lines[i:])
flat = pre + "    i_v = 0\n" + loop_body + "\n" + after
first = "    i_sh = tl.program_id(0)  # (chunk slot * H + head) * (number of K blocks) + K block\n"
assert first in flat
def persist(order, ns):
    idx = {"contig": "tl.program_id(0) * G + i_rep", "strided": "tl.program_id(0) + i_rep * tl.num_programs(0)"}[order]
    rng = f"tl.range(0, G, num_stages={ns})" if ns else "range(G)"
    b = flat.replace(first, f"    i_sh = {idx}\n")
    b = textwrap.indent(b, "    ")
    return sig.replace("BV: tl.constexpr,\n", "BV: tl.constexpr, G: tl.constexpr,\n") + f"    for i_rep in {rng}:\n" + b
edits = {"flat": {"replace": [[kern, sig + flat]]}}
for G in (4, 8):
    for order in ("contig", "strided"):
        for ns in (None, 2, 3):
            name = f"p{G}_{order}_ns{ns or 0}"
            edits[name] = {"replace": [[kern, persist(order, ns)]], "consts": {"G": G}, "grid_div": G}
# 2 blocks a SM to leave shared memory for the pipeline's buffers
edits["p8_strided_ns2_r232"] = {**edits["p8_strided_ns2"], "launch": {"maxnreg": 232}}
edits["p4_contig_ns2_r232"] = {**edits["p4_contig_ns2"], "launch": {"maxnreg": 232}}
out.write_text(json.dumps(edits, indent=1))
print(len(edits), "edits")
print(persist("strided", 2)[:3000])
