"""Write the location-experiment units of session 22 (docs/perf_notes.md 49) into ``forms/`` (or DIR): each is a
base unit kept here (`exp_dense_db570c1.py`, `exp_varlen_db570c1.py`) or another form, under the text edits of
`location_forms.json`, applied by scripts/time_token_edits.apply_edit (each edit's text must occur).

    python mk_location_forms.py [DIR]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2] / "scripts"))
from time_token_edits import apply_edit  # noqa: E402


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "forms"
    out.mkdir(parents=True, exist_ok=True)
    edits = json.loads((HERE / "location_forms.json").read_text())
    texts: dict[str, str] = {}
    for name, e in edits.items():  # a form's base precedes it in the file
        base = texts[e["base"]] if e["base"] in texts else (HERE / f"{e['base']}.py").read_text()
        texts[name] = apply_edit(base, name, e)
        (out / f"{name}.py").write_text(texts[name])
    print(f"{len(texts)} forms -> {out}")


if __name__ == "__main__":
    main()
