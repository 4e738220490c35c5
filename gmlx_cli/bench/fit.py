"""Fit a whole bench / sweep workload into the model's context before anything runs.

Why not leave it to the engine's own check (`gmlx.engine.intake.make_row`): that check sees one prompt
at a time, so its "at most N" fits that prompt only, and it names `max_tokens`, not the flag the
value came from. A user changes a flag, so the advice here names the flag and holds for every
prompt the flag applies to. A budget the user did not choose (join-late's default long budget,
4 x --max-tokens) is lowered to fit, with a notice, instead of failing.
"""

from __future__ import annotations

from dataclasses import replace

from gmlx.errors import InvalidRequest
from gmlx_cli.bench.workload import DEFAULT_LONG, Request


def _snippet(text: str, n: int = 24) -> str:
    one = " ".join(text.split())
    return repr(one if len(one) <= n else one[: n - 1] + "…")


def check_prompts(context: int | None, prompts: list[tuple[str, list[int]]]) -> None:
    """Every (label, ids) prompt leaves room for at least one generated token."""
    if context is None:
        return
    for label, ids in prompts:
        if len(ids) >= context:
            raise InvalidRequest(f"{label} has {len(ids)} tokens; the model's context is {context} tokens, so it"
                                 " cannot generate any: shorten it or remove it from --prompts")


def max_tokens_error(flag: str, value: str, context: int, prompts: list[tuple[str, list[int]]]) -> InvalidRequest:
    """`flag` (e.g. --max-tokens) is too large for the longest of `prompts`: the bound that fits all."""
    label, longest = max(prompts, key=lambda p: len(p[1]))
    room = context - len(longest)
    fix = f"a range up to {room}" if "-" in value else f"{room} or less"
    return InvalidRequest(f"{flag} {value} does not fit the model's context of {context} tokens: the longest prompt"
                          f" it applies to ({label}, {len(longest)} tokens) leaves room for {room} tokens;"
                          f" use {flag} {fix}")


def fit_requests(context: int | None, reqs: list[Request], ids: dict[int, list[int]], max_tokens: tuple[int, int],
                 max_tokens_text: str, long_tokens: int | None = None) -> tuple[list[Request], list[str]]:
    """The requests with join-late's default long budget lowered to fit (and the notices saying
    so); an InvalidRequest naming the flag when a budget the user set cannot fit."""
    if context is None:
        return reqs, []

    def label(r: Request) -> str:
        return f"request {r.request_id}, prompt {_snippet(r.prompt)}"

    check_prompts(context, [(label(r), ids[r.request_id]) for r in reqs])
    out, notices = [], []
    for r in reqs:
        room = context - len(ids[r.request_id])
        if r.budget_from == DEFAULT_LONG and r.params.max_tokens > room:
            notices.append(f"join-late: the long request's default budget (4 x --max-tokens = {r.params.max_tokens})"
                           f" does not fit the model's context of {context} tokens after its"
                           f" {len(ids[r.request_id])}-token prompt; it gets {room} (--long-tokens sets it)")
            r = replace(r, params=replace(r.params, max_tokens=room))
        out.append(r)
    # --max-tokens: its upper bound must fit every prompt it applies to (a range draws up to it).
    by_flag = [r for r in out if r.budget_from == "--max-tokens"]
    if any(len(ids[r.request_id]) + max_tokens[1] > context for r in by_flag):
        raise max_tokens_error("--max-tokens", max_tokens_text, context,
                               [(label(r), ids[r.request_id]) for r in by_flag])
    for r in out:
        n = len(ids[r.request_id])
        if n + r.params.max_tokens <= context:
            continue
        if r.budget_from == "--long-tokens":
            raise max_tokens_error("--long-tokens", str(long_tokens), context, [(label(r), ids[r.request_id])])
        raise InvalidRequest(f"prompts file: {label(r)} has {n} tokens and max_tokens {r.params.max_tokens}, more"
                             f" than the model's context of {context} tokens; set its max_tokens to at most"
                             f" {context - n}")
    return out, notices
