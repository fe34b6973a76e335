"""Building blocks shared by the model families: norms, rotary embeddings, paged attention."""
