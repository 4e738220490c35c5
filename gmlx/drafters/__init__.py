"""Drafters behind one protocol (base.Drafter): native MTP heads, draft models, KV-sharing
assistant heads."""

from gmlx.drafters.base import DraftPick, Drafter

__all__ = ["DraftPick", "Drafter"]
