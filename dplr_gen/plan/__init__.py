"""Plan layer: one variant and its name; the enumeration of a spec into variants, filters, build units and knobs."""
