"""Data for the recipes: a byte-level text corpus generated deterministically, as a LightningDataModule."""
