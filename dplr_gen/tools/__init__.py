"""Tools: the compatibility matrix, the spec reference generator, the source viewer (not used at run time)."""
