"""Runtime layer: the package loader, the op dispatch, the public ops, the kernel drivers, on-demand variants."""
