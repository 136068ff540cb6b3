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

import torch

from zorse_lightning.models.next_token import NextTokenModel


class CausalLm(NextTokenModel):
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
        building_on_meta = torch.empty(0).device.type == "meta"  # init_module(empty_init=True): weights come per stage
        if pretrained is not None and not building_on_meta:
            self.model = AutoModelForCausalLM.from_pretrained(pretrained)
        else:
            built = AutoConfig.from_pretrained(pretrained) if pretrained else AutoConfig.for_model(model_type, **(config or {}))
            self.model = AutoModelForCausalLM.from_config(built)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=tokens).logits

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(
            self.parameters(), lr=self.hparams.learning_rate, weight_decay=self.hparams.weight_decay
        )
