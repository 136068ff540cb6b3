"""Layer 3: the planner. Pure functions over inventories and profiles; no torch, no process groups."""
