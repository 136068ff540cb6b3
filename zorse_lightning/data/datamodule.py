"""Byte-level language-modelling data as a LightningDataModule."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from zorse_lightning.data.corpus import generate_corpus

VOCAB_SIZE = 256
"""Bytes are the tokens."""


class ByteWindows(Dataset):
    """Non-overlapping windows of ``seq_len + 1`` bytes: input and next-byte target."""

    def __init__(self, data: bytes, seq_len: int) -> None:
        self.tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        self.seq_len = seq_len
        self.count = (len(self.tokens) - 1) // seq_len
        if self.count < 1:
            raise ValueError(f"{len(data)} bytes give no window of seq_len={seq_len}; use more data or a shorter seq_len")

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.seq_len
        window = self.tokens[start : start + self.seq_len + 1]
        return window[:-1], window[1:]


class ByteCorpusDataModule(pl.LightningDataModule):
    """The generated corpus, split into train and validation windows."""

    def __init__(
        self,
        seq_len: int = 64,
        batch_size: int = 8,
        corpus_bytes: int = 400_000,
        val_fraction: float = 0.05,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if not 0 < val_fraction < 1:
            raise ValueError(f"val_fraction={val_fraction} must lie strictly between 0 and 1")
        self.save_hyperparameters()
        self.train_set: ByteWindows | None = None
        self.val_set: ByteWindows | None = None

    def setup(self, stage: str | None = None) -> None:
        data = generate_corpus(self.hparams.corpus_bytes, self.hparams.seed)
        split = int(len(data) * (1 - self.hparams.val_fraction))
        self.train_set = ByteWindows(data[:split], self.hparams.seq_len)
        self.val_set = ByteWindows(data[split:], self.hparams.seq_len)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_set, batch_size=self.hparams.batch_size, shuffle=True, num_workers=self.hparams.num_workers
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size, num_workers=self.hparams.num_workers)
