"""Flax Linen modules only: no I/O, no training state (see ARCHITECTURE.md)."""
