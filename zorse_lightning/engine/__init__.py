"""Layer 4: executes a Plan with torch.distributed. Imports no Lightning."""
