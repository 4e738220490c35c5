"""Scripts that train the embedded model and its drafters, and write its model card."""
