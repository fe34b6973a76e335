"""Structured outputs: constraints (JSON schema, regex, choice, grammar) turned into grammars for
llguidance, checked in the front end (`grammar`, torch-free) and enforced in the core's sampler
(`matcher`: a matcher per sequence, a token bitmask per step)."""
