"""docs/specs.md is what the models say (regenerate with `python -m dplr_gen.tools.docs_specs`); every field has a
description; an unknown arch points to the reference."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from dplr_gen.tools import docs_specs
from dplr_gen.spec.arch import ArchProfile, KnobDefaults
from dplr_gen.cli import app
from dplr_gen.spec.quirks import Avoid, Quirk
from dplr_gen.spec.models import Knobs, Spec, TuningRule, VariantAxes

MODELS = (Spec, VariantAxes, Knobs, TuningRule, ArchProfile, KnobDefaults, Quirk, Avoid)


def test_docs_specs_md_matches_the_models() -> None:
    assert docs_specs.DOC.read_text() == docs_specs.render(), "docs/specs.md drifted: run python -m dplr_gen.tools.docs_specs"


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
def test_every_field_is_described_and_listed(model) -> None:
    text = docs_specs.render()
    for name, field in model.model_fields.items():
        assert field.description, f"{model.__name__}.{name} has no description"
        assert f"| `{name}` |" in text


def test_check_mode_fails_on_drift(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    doc = tmp_path / "specs.md"
    monkeypatch.setattr(docs_specs, "DOC", doc)
    assert docs_specs.main(["--check"]) == 1
    assert docs_specs.main([]) == 0 and docs_specs.main(["--check"]) == 0
    doc.write_text(doc.read_text().replace("head_dims", "head_dim"))
    assert docs_specs.main(["--check"]) == 1


def test_unknown_arch_points_to_the_reference(tmp_path: Path) -> None:
    spec = tmp_path / "orin.yaml"
    spec.write_text("targets: [sm_87]\nvariants: [{dtypes: [bf16], head_dims: [64]}]\n")
    res = CliRunner().invoke(app, ["build", str(spec)], env={"COLUMNS": "300"})
    assert res.exit_code == 2 and "sm_87" in res.output and "docs/specs.md" in res.output, res.output
