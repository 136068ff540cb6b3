"""A Hugging Face causal language model in a plain LightningModule, as users write one (nothing zorse-specific).

Built from a config (``model_type`` and its fields: ``llama``, ``mistral``,
``qwen2``, ``gpt2``...) or from a model directory the user has on disk
(``pretrained``: its ``config.json``; the weights are read by
``AutoModelForCausalLM.from_pretrained`` on the host, or, for a model no GPU
holds, per stage by ``ZorseStrategy(weights=...)`` into a module built on the
meta device). Batches are ``(tokens, next_tokens)`` pairs, as the byte corpus gives.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F


class CausalLm(pl.LightningModule):
    def __init__(
        self,
        model_type: str = "llama",
        config: dict[str, Any] | None = None,
        pretrained: str | None = None,
        learning_rate: float = 3e-4,
        weight_decay: float = 0.1,
    ) -> None:
        super().__init__()
        from transformers import AutoConfig, AutoModelForCausalLM

        self.save_hyperparameters()
        if pretrained is not None and torch.empty(0).device.type != "meta":
            self.model = AutoModelForCausalLM.from_pretrained(pretrained)
        else:
            built = AutoConfig.from_pretrained(pretrained) if pretrained else AutoConfig.for_model(model_type, **(config or {}))
            self.model = AutoModelForCausalLM.from_config(built)

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        tokens, targets = batch
        logits = self.model(input_ids=tokens).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(
            self.parameters(), lr=self.hparams.learning_rate, weight_decay=self.hparams.weight_decay
        )
