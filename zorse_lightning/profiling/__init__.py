"""Layer 2: per-block profiles of a model on each GPU type (measured, reference or estimated)."""
