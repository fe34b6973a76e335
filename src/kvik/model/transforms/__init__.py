"""Passes over a finished, loaded model (gpt-fast's lesson): the model files know nothing of them."""
