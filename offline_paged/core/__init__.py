"""The engine core: blocks, sequences, scheduling and output processing (pure Python)."""
