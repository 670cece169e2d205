"""Render layer: deterministic Triton (and Gluon) source per build unit from the Jinja templates shipped here."""
