"""Drafter heads: the bound-head interface (bound.py) and the heads gmlx runs (MTP, native MTP,
EAGLE-3, assistant), tied to their target."""
