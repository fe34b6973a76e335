"""Model families. `registry` maps an HF architecture name to its class."""
