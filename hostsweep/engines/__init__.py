"""Engines: one module each, chosen by `engine.name` and imported lazily."""
