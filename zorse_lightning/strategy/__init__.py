"""Layer 5: Lightning glue. Thin adapters from Lightning's hooks to the engine."""
