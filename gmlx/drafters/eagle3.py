"""The EAGLE-3 drafter: the MTP drafter's state and rollback around an EAGLE-3 head
(gmlx/heads/eagle3_head.py: the head; eagle3_checkpoint.py: its checkpoint layout and loading)."""

from __future__ import annotations

from pathlib import Path

from gmlx.drafters.mtp import MTPDrafter
from gmlx.heads.eagle3_checkpoint import load_eagle3_head
from gmlx.heads.eagle3_head import KIND


class Eagle3Drafter(MTPDrafter):
    """The MTP drafter's state and rollback, with an EAGLE-3 head (its pending hidden states are
    the target's captured streams, [B, P, 3 T])."""

    kind = KIND


def load_eagle3(path: str | Path, lm):
    """(the loaded model as the engine sees it with this head: its target an AuxTarget, its head
    the bound EAGLE-3 head; the drafter). The loaded model `lm` itself is not changed."""
    view = load_eagle3_head(path, lm)
    return view, Eagle3Drafter(view.head, view.target.aux_size)
