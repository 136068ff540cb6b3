"""Models written as users write them: plain LightningModules, no zorse code inside."""
