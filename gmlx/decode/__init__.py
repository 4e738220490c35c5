"""The decode lanes and the round pieces they share: prefill, verify, scalar, plain, batch."""
