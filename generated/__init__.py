"""Packages built by dplr-gen, one per spec."""
