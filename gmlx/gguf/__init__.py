"""GGUF files: the reader, the tokenizer, the conversion to an mlx-lm directory, and SmolLM2's
packaged GGUF."""
