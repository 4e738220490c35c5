"""Policy: what the engine decides and never applies: admission, the width cap, the draft length."""
