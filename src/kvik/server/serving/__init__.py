"""Serving logic behind the routes: request preprocessing, streaming, tracking."""
