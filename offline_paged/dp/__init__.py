"""Data parallelism: N engine processes behind the engine interface."""
