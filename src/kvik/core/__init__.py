"""Pure-Python foundations shared by every layer: configs, errors, sampling params, outputs, hashing.

Nothing here imports torch or a web framework, so the gateway can depend on it.
"""
