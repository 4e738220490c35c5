"""OpenAI's predicted outputs on the wire: the request's `prediction` field and the usage's
`completion_tokens_details` (gmlx/drafters/prediction.py drafts from it).

Request: `"prediction": {"type": "content", "content": TEXT}`, the content a string or a list of
text parts (`[{"type": "text", "text": ...}, ...]`, joined), on /v1/chat/completions and
/v1/completions alike. Anything else is a 400 naming the field. An empty content is no prediction.

Usage, for a request that had one: `completion_tokens_details.accepted_prediction_tokens` (output
tokens that were the aligned prediction's next token) and `rejected_prediction_tokens` (tokens
drafted from the prediction that the verify rejected), summed over the request's choices. OpenAI
describes them as "prediction tokens that appeared in the completion" and "that did not"; gmlx
counts what its speculation did with them, as stated here.
"""

from __future__ import annotations

FIELD = "prediction"


def parse_prediction(p, bad) -> str | None:
    """The prediction's text (None: none given). `bad(message, param)` makes the 400."""
    if p is None:
        return None
    if not isinstance(p, dict) or p.get("type") != "content" or "content" not in p:
        raise bad('`prediction` must be {"type": "content", "content": "..."}', FIELD)
    unknown = sorted(set(p) - {"type", "content"})
    if unknown:
        raise bad(f"unknown field `prediction.{unknown[0]}` (gmlx implements: type, content)", f"{FIELD}.{unknown[0]}")
    content = p["content"]
    if isinstance(content, str):
        return content or None
    if isinstance(content, list) and content:
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"`prediction.content[{j}]` must be a text part ({{\"type\": \"text\", \"text\": ...}})",
                          f"{FIELD}.content")
            texts.append(part["text"])
        return "".join(texts) or None
    raise bad("`prediction.content` must be a string or a non-empty list of text parts", f"{FIELD}.content")


def completion_details(recs) -> dict | None:
    """OpenAI's `completion_tokens_details` for these choices' records (None: no prediction)."""
    stats = [r.stats for r in recs if r.stats.get("prediction_tokens") is not None]
    if not stats:
        return None
    return {"accepted_prediction_tokens": sum(s["accepted_prediction_tokens"] for s in stats),
            "rejected_prediction_tokens": sum(s["rejected_prediction_tokens"] for s in stats)}
