"""Outside the runtime package: training the embedded model and its drafters, the SmolLM2 head,
the model cards, and the shipped prompt set (make_prompts.py). `gmlx train` imports it lazily;
the `train` extra has what it needs beyond gmlx."""
