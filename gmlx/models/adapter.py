"""Target adapter: logits and a hidden state from one forward of an mlx-lm model.

mlx-lm's decoder-only models (llama, mistral, qwen2, qwen3, deepseek_v3, ...) are
`Model(model=Backbone, lm_head | tied embeddings)`, and `Backbone.__call__` ends with its final
norm. So `hidden = model.model(x, cache)` and `logits = lm_head(hidden)` reproduce `model(x)`
exactly, without forking mlx-lm's model files.

Which hidden a drafter gets is the target's `hidden_convention` (see `gmlx.heads.bound`):
- "post_norm" (default): the backbone's output, after the final norm.
- "pre_norm": before it. The backbone applies its norm itself, so the adapter runs a shallow
  copy of the backbone whose `norm` is the identity (the layers, embedding and weights are the
  same objects) and applies the real norm itself: logits = lm_head(norm(h)), the same ops as
  mlx-lm's forward. The mlx-lm model is never modified, so `model(x)` (the plain path, and the
  mlx-lm baselines that run `target.model`) stays exactly mlx-lm's, from any thread — except that
  on the CPU backend its norms and rotary embeddings run fused at load (gmlx/models/cpu_fused.py:
  the same values, fewer operations; `as_mlx_lm()` runs them as mlx-lm does).

`Target.check()` proves logits == `model(x)` on a real forward at load time, for either
convention, so a family whose `__call__` adds something (logit soft-capping, scaling) is
refused, not silently wrong.
"""

from __future__ import annotations

import contextlib
import copy

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from gmlx import model_cache
from gmlx.models import cpu_fused, early_dispatch, gated_delta
from gmlx.errors import ModelLoadError
from gmlx.models import dequantized


# Which hidden a head wants from the target (gmlx/heads/bound.py says what each means).
POST_NORM = "post_norm"
PRE_NORM = "pre_norm"
HIDDEN_CONVENTIONS = (POST_NORM, PRE_NORM)


@contextlib.contextmanager
def one_forward():
    """Around each of the target's forwards: its layers' rotary embeddings share their angles
    (gmlx/models/cpu_fused.py) and its layers start computing as they are built
    (gmlx/models/early_dispatch.py). mlx-lm's own loops over the same model objects have neither."""
    with cpu_fused.one_forward(), early_dispatch.early():
        yield


class Target:
    """A thin view over an mlx-lm model. Graph builder: never syncs."""

    def __init__(self, model: nn.Module, hidden_convention: str = POST_NORM, source: tuple | None = None):
        """`source`: the model's files (gmlx.measured.files_of), under which its load-time
        measurements are kept across processes (None: measured in this process only)."""
        backbone = getattr(model, "model", None)
        if backbone is None or not hasattr(backbone, "embed_tokens") or not hasattr(backbone, "layers"):
            raise ModelLoadError(
                f"{type(model).__module__} has no `model.embed_tokens`/`model.layers` backbone; gmlx supports"
                " mlx-lm decoder-only families such as llama, mistral, qwen2 and qwen3"
            )
        if hidden_convention not in HIDDEN_CONVENTIONS:
            raise ValueError(f"hidden_convention must be one of {HIDDEN_CONVENTIONS}, got {hidden_convention!r}")
        self.model = model
        self.hidden_convention = hidden_convention
        self.source = source
        self.backbone, self._hidden_backbone, self.final_norm, self.lm_head = _parts(model, hidden_convention)
        self.embed_tokens = self.backbone.embed_tokens
        # A QuantizedEmbedding packs its weight (uint32 words): its `dims` is the hidden size.
        self.hidden_size = int(getattr(self.embed_tokens, "dims", self.embed_tokens.weight.shape[1]))
        self.vocab_size = int(self.embed_tokens.weight.shape[0])
        self.num_layers = len(backbone.layers)
        # Hybrid families: recurrent layers capture their state per position in a multi-token
        # forward, so a verify rolls back exactly (gmlx/recurrent.py); why not, when they cannot.
        self.recurrent_blockers = gated_delta.install(model)
        # Its forwards dispatch each layer as it is built (gmlx/models/early_dispatch.py); installed
        # before the twin is made, so that the twin's layers (shallow copies) do too.
        early_dispatch.install(backbone.layers)
        # A quantized model on the CPU runs its multi-token forwards through a dequantized twin
        # (gmlx/models/dequantized.py): a verify of k+1 tokens then costs ~1.3 steps, not k+1.
        # One-token steps too when the twin is the faster there (measured at load).
        self.twin, self.wide, self.decode_model, self.decode_on_twin = None, None, model, False
        if dequantized.wanted(model):
            self.twin = twin = dequantized.materialized(model, source)
            self.wide = _parts(twin, hidden_convention)
            if dequantized.decodes_faster(model, twin, source):
                self.decode_model, self.decode_on_twin = twin, True

    @property
    def figures_key(self) -> "Target":
        """What this model's measured figures (the online control's round times, the load probe's
        costs; `gmlx.policy.figures.owner`) are filed under: the target itself, also when an engine
        sees it through a view (an EAGLE-3 head's AuxTarget delegates its attributes here), so
        every engine on one model shares them."""
        return self

    @property
    def own(self) -> tuple:
        """The model's own backbone, hidden backbone, final norm and LM head (never the twin)."""
        return self.backbone, self._hidden_backbone, self.final_norm, self.lm_head

    def _for(self, n: int) -> tuple:
        """The backbone, hidden backbone, final norm and LM head for a forward of n tokens."""
        if self.wide is not None and (n > 1 or self.decode_on_twin):
            return self.wide
        return self.own

    def __call__(self, tokens: mx.array, cache: list, *, parts: tuple | None = None) -> tuple[mx.array, mx.array]:
        """tokens [B, L] -> (logits [B, L, V], hidden [B, L, D] in this target's convention).
        `parts`: run these (`own`, or the twin's `wide`) instead of the ones chosen for speed."""
        _, hidden_backbone, final_norm, lm_head = parts or self._for(tokens.shape[1])
        with one_forward():
            hidden = hidden_backbone(tokens, cache=cache)
        if self.hidden_convention == PRE_NORM:
            return lm_head(final_norm(hidden)), hidden
        return lm_head(hidden), hidden

    def run_backbone(self, tokens: mx.array, cache: list) -> mx.array:
        """The backbone alone (prefill without hidden capture)."""
        with one_forward():
            return self._for(tokens.shape[1])[0](tokens, cache=cache)

    def logits(self, tokens: mx.array, cache: list) -> mx.array:
        """The plain path: exactly mlx-lm's forward (of the dequantized twin where that decodes faster)."""
        with one_forward():
            return self.decode_model(tokens, cache=cache)

    def make_cache(self) -> list:
        caches = make_prompt_cache(self.model)
        return caches if self.recurrent_blockers else model_cache.wrap_caches(caches)

    def check(self) -> None:
        """Load-time checks, each comparing like with like:
        1. the family: lm_head(backbone(x)) on the model's own weights == mlx-lm's `model(x)`
           (1e-3: the same kernels), else it post-processes logits and is refused;
        2. the twin, when there is one: its split forward == its own `model(x)` (1e-3, the family
           check again on the twin's weights), and its logits == the quantized model's within a
           tolerance fit for other kernels over the same weights (their dot products round
           differently: SmolLM2 at 4 bits differs by up to 0.08 on logits of magnitude 31, i.e.
           0.25 %; refused above 1 % of the logits' magnitude: a dequantization gone wrong)."""
        x = mx.array([[1, 2, 3, 40, 50, 600]], dtype=mx.int32) % self.vocab_size
        ref = self.model(x).astype(mx.float32)
        ours, _ = self(x, cache=None, parts=self.own)  # the same weights as mlx-lm's forward
        if _max_diff(ref, ours) > 1e-3:  # sync: once, at load time
            raise ModelLoadError(
                f"{type(self.model).__module__}: logits are not lm_head(model.model(x)); this family post-processes"
                " logits and gmlx cannot speculate on it yet (mlx_lm.generate runs it)")
        if self.wide is None:
            return
        split, _ = self(x, cache=None, parts=self.wide)
        scale = mx.abs(ref).max().item()  # sync: once, at load time
        tol, off = 1e-2 * max(scale, 1.0), _max_diff(ref, split)
        if _max_diff(self.twin(x), split) > 1e-3 or off > tol:
            raise ModelLoadError(
                f"{type(self.model).__module__}: the float32 twin of this quantized model disagrees with it (logits"
                f" differ by {off:.3g}, allowed {tol:.3g}); set GMLX_DEQUANTIZED_VERIFY=0 to run the quantized"
                " kernels throughout")


def _max_diff(a: mx.array, b: mx.array) -> float:
    return mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item()  # sync: at load time, the checks only


def _parts(model: nn.Module, hidden_convention: str) -> tuple:
    """(backbone, the backbone returning this convention's hidden, final norm, LM head)."""
    backbone = model.model
    hidden_backbone = backbone if hidden_convention == POST_NORM else _without_final_norm(backbone)
    # Wrapped families (qwen3_5: Model.language_model.{model, lm_head}) keep the head one level down.
    owner = getattr(model, "language_model", model)
    args = getattr(owner, "args", None)
    tied = getattr(args, "tie_word_embeddings", not hasattr(owner, "lm_head"))
    lm_head = backbone.embed_tokens.as_linear if tied or not hasattr(owner, "lm_head") else owner.lm_head
    return backbone, hidden_backbone, backbone.norm, lm_head


def _without_final_norm(backbone: nn.Module) -> nn.Module:
    """A shallow copy of the backbone that returns the residual stream before its final norm.

    nn.Module is a dict of its children: the copy holds the same layer and embedding objects
    (no weight is duplicated), and replacing `norm` on the copy leaves the original untouched."""
    twin = copy.copy(backbone)
    twin.norm = nn.Identity()
    return twin
