"""The bench harness behind `offline-paged bench` (one engine or data parallel)."""
