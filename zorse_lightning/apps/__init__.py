"""Entry points: Hydra apps for inspecting clusters, planning and training."""
