"""mlx-lm baselines for `gmlx bench`, behind the same Backend interface as the engine:
BatchGenerator (continuous batching) and stream_generate (one request at a time)."""

from __future__ import annotations

import itertools
from collections import deque

from gmlx.engine.metrics import Event, EventKind
from gmlx.policy.admission import Mode, Round
from gmlx.finish import FinishReason
from gmlx_cli.bench.driver import Backend


class _MlxLmBackend(Backend):
    """Shared bookkeeping; rounds are reported as engine-style Events so one driver and one live
    view serve every arm. mlx-lm samples from MLX's global generator, so its sampled streams are
    not comparable token for token: baselines measure speed, not equality."""

    def __init__(self, lm, ignore_eos: bool):
        from mlx_lm.sample_utils import make_sampler

        self.lm, self.make_sampler = lm, make_sampler
        self.eos = set() if ignore_eos else set(lm.eos_ids)
        self.live: dict[int, list] = {}  # rid -> [tokens, finish reason]
        self.ids = itertools.count()

    def result(self, rid):
        tokens, reason = self.live.pop(rid)
        return tokens, reason, {}

    @property
    def has_work(self):
        return any(v[1] is None for v in self.live.values())

    def _events(self, got: list[tuple[int, int | None, str | None]]) -> list[Event]:
        """(rid, token or None, finish reason) per row -> a ROUND event and FINISH events.
        An EOS token ends the request without being emitted, as in gmlx and stream_generate."""
        rows, fin = [], []
        for rid, tok, reason in got:
            keep = tok is not None and tok not in self.eos
            if keep:
                self.live[rid][0].append(tok)
            rows.append((rid, 0, 0, int(keep)))
            if reason is not None:
                self.live[rid][1] = reason
                fin.append(Event(EventKind.FINISH, Mode.GATED, len(got), rid=rid))
        return [Event(EventKind.ROUND, Mode.GATED, len(got), rows=tuple(rows), round=Round.PLAIN)] + fin  # plain decode


class MlxBatchBackend(_MlxLmBackend):
    def __init__(self, lm, ignore_eos: bool, concurrency: int):
        super().__init__(lm, ignore_eos)
        from mlx_lm.generate import BatchGenerator

        stop = [[e] for e in sorted(self.eos)] or None
        self.gen = BatchGenerator(lm.target.model, stop_tokens=stop, completion_batch_size=concurrency,
                                  prefill_batch_size=min(concurrency, 8))

    def submit(self, prompt_ids, params):
        (uid,) = self.gen.insert([prompt_ids], max_tokens=[params.max_tokens],
                                 samplers=[self.make_sampler(params.temperature)])
        self.live[uid] = [[], None]
        return uid

    def step(self):
        got = self.gen.next_generated()
        if not got:  # it holds nothing we are waiting for: fail loudly rather than spin
            raise RuntimeError("mlx-lm BatchGenerator returned no tokens with requests unfinished")
        return self._events([(r.uid, r.token, r.finish_reason) for r in got])

    def close(self):
        self.gen.close()


class MlxStreamBackend(_MlxLmBackend):
    """stream_generate serves one request at a time; the others wait, as with a single-stream server.
    With --ignore-eos it is generate_step (what stream_generate wraps) without the EOS check."""

    def __init__(self, lm, ignore_eos: bool):
        super().__init__(lm, ignore_eos)
        self.queue: deque = deque()
        self.cur = None

    def submit(self, prompt_ids, params):
        rid = next(self.ids)
        self.live[rid] = [[], None]
        self.queue.append((rid, prompt_ids, params))
        return rid

    def _tokens(self, ids, params):
        import mlx.core as mx
        from mlx_lm.generate import generate_step, stream_generate

        sampler, model, m = self.make_sampler(params.temperature), self.lm.target.model, params.max_tokens
        if not self.eos:
            for n, (tok, _) in enumerate(generate_step(mx.array(ids), model, max_tokens=m, sampler=sampler)):
                yield int(tok), FinishReason.LENGTH if n + 1 == m else None
            return
        for r in stream_generate(model, self.lm.tokenizer, ids, max_tokens=m, sampler=sampler):
            yield int(r.token), r.finish_reason

    def step(self):
        if self.cur is None:
            rid, ids, params = self.queue.popleft()
            self.cur = (rid, self._tokens(ids, params))
        rid, gen = self.cur
        tok, reason = next(gen, (None, FinishReason.LENGTH))
        if reason is not None:
            self.cur = None
        return self._events([(rid, tok, reason)])

    def close(self):
        if self.cur is not None:
            self.cur[1].close()  # leaves stream_generate's wired-limit context
        self.queue.clear()
