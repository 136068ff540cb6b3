"""Human-facing views of plans: tables for the terminal and the timeline picture."""
