"""Which Hugging Face decoder families train unchanged on a pipeline, against one process.

    .venv/bin/python tools/hf_families.py                        # every family below, microbatch 1 (about 12 min)
    .venv/bin/python tools/hf_families.py llama bloom --microbatch 2 --planned
    PYTHONPATH=/path/to/transformers4 .venv/bin/python tools/hf_families.py   # another transformers

Each family is built from a small config (``AutoConfig.for_model``, nothing
downloaded) inside the user's kind of module (``self.model(input_ids=x,
labels=x).loss``), trained two steps on ``cpu_sim2`` (two emulated ranks) on a
pinned two-stage pipeline (``--planned``: the plan made at start instead), and
compared with single-process training from the same weights on the same global
batch. Each family runs in its own pair of processes, so one failure does not
end the others. One line per family: the largest parameter difference on each
rank, or the error's last line.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

WORLD, STEPS, PER_RANK_BATCH, VOCAB, SEQ = 2, 2, 4, 64, 8
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=SEQ)
NO_DROPOUT = dict(hidden_dropout=0.0, attention_dropout=0.0)
CONFIGS = {
    "gpt2": dict(vocab_size=VOCAB, n_embd=32, n_layer=4, n_head=2, n_positions=SEQ, resid_pdrop=0.0, embd_pdrop=0.0,
                 attn_pdrop=0.0),
    "gptj": dict(vocab_size=VOCAB, n_embd=32, n_layer=4, n_head=4, n_positions=SEQ, rotary_dim=4, resid_pdrop=0.0,
                 embd_pdrop=0.0, attn_pdrop=0.0),
    "gpt_neox": dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                     max_position_embeddings=SEQ),
    "opt": dict(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=4, num_attention_heads=4,
                max_position_embeddings=SEQ, word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0),
    "bloom": dict(vocab_size=VOCAB, hidden_size=32, n_layer=4, n_head=4, **NO_DROPOUT),
    "falcon": dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, **NO_DROPOUT),
    "phi": dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                max_position_embeddings=SEQ, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0),
    "phi3": dict(COMMON, pad_token_id=0),
    "gemma": dict(COMMON, head_dim=8),
    "gemma2": dict(COMMON, head_dim=8),
    "mixtral": dict(COMMON, num_local_experts=2, num_experts_per_tok=1),
    "ctrl": dict(COMMON, resid_pdrop=0.0, embd_pdrop=0.0),  # scales its embedding's output in place
    "gpt_bigcode": dict(COMMON, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "seed_oss": dict(COMMON, attention_dropout=0.0, residual_dropout=0.0),
    "biogpt": dict(COMMON, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
    "xglm": dict(COMMON, dropout=0.0, attention_dropout=0.0),
    "phimoe": dict(COMMON, router_jitter_noise=0.0),
    "qwen2_moe": dict(COMMON, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16, shared_expert_intermediate_size=16),
    "qwen3_moe": dict(COMMON, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16),
    "falcon_h1": dict(COMMON, mamba_chunk_size=8, mamba_d_state=8, mamba_n_heads=4, mamba_d_head=8, mamba_d_ssm=32),
    "openai-gpt": dict(COMMON, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "trocr": dict(COMMON, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0),
    # encoders as causal language models (each family's *ForCausalLM); RoFormer's layers receive a frozen table
    **{family: dict(COMMON, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0) for family in (
        "bert", "electra", "ernie", "megatron-bert", "bert-generation", "big_bird", "rembert", "roformer",
    )},
    **{family: COMMON for family in (
        "llama", "mistral", "qwen2", "qwen3", "olmo", "starcoder2", "granite", "stablelm", "cohere", "cohere2", "olmo2",
        "olmo3", "mpt", "nemotron", "exaone4", "ernie4_5", "arcee", "gpt_oss", "apertus", "jetmoe", "persimmon",
        "gemma3_text", "llama4_text", "lfm2", "granitemoe", "olmoe", "minimax", "bitnet", "doge", "mamba",
        "recurrent_gemma",  # keeps its recurrent state as attributes of its layers
        "vaultgemma",
    )},
    "nemotron_h": dict(COMMON, ssm_state_size=8, mamba_num_heads=4, mamba_head_dim=8, n_groups=1, chunk_size=8,
                       n_routed_experts=2, moe_intermediate_size=16, moe_shared_expert_intermediate_size=16),
}


def _module(family: str):
    import lightning.pytorch as pl
    import torch
    import transformers

    class CausalLm(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = transformers.AutoModelForCausalLM.from_config(
                transformers.AutoConfig.for_model(family, **CONFIGS[family])
            )

        def training_step(self, batch, batch_idx):
            (tokens,) = batch
            return self.model(input_ids=tokens, labels=tokens).loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    return CausalLm()


def _tokens():
    import torch
    from torch.utils.data import TensorDataset

    generator = torch.Generator().manual_seed(2)
    return TensorDataset(torch.randint(0, VOCAB, (PER_RANK_BATCH * WORLD * STEPS, SEQ), generator=generator))


def _reference(family: str) -> dict:
    module, data, batch = _module(family), _tokens().tensors[0], PER_RANK_BATCH * WORLD
    optimizer = module.configure_optimizers()
    for step in range(STEPS):
        module.training_step((data[step * batch:(step + 1) * batch],), step).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {n: p.detach() for n, p in module.named_parameters()}


def _worker(rank: int, root: Path, family: str, microbatch: int, planned: bool) -> str:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from testing.plans import hand_plan
    from zorse_lightning import ZorseStrategy, load_cluster
    from zorse_lightning.module.materialize import holds_values

    try:
        expected = _reference(family)
        cluster = load_cluster("cpu_sim2")
        per_rank = PER_RANK_BATCH * WORLD // microbatch
        plan = hand_plan([((0,), (per_rank,), (0, 2)), ((1,), (per_rank,), (2, 4))], microbatch, inventory=cluster)
        strategy = ZorseStrategy(cluster=cluster) if planned else ZorseStrategy(cluster=cluster, plan=plan)
        module = _module(family)
        trainer = pl.Trainer(
            strategy=strategy, accelerator="cpu", devices=WORLD, max_steps=STEPS, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            num_sanity_val_steps=0, default_root_dir=root,
        )
        trainer.fit(module, DataLoader(_tokens(), batch_size=PER_RANK_BATCH))
        held = {n: p for n, p in module.named_parameters() if holds_values(p)}
        return f"{max((held[n].detach() - expected[n]).abs().max().item() for n in held):.2e}"
    except Exception as error:  # the report's line, not a crash: the other families still run
        return "error: " + traceback.format_exception_only(error)[-1].strip()[:300]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("families", nargs="*", default=list(CONFIGS), help=f"of {sorted(CONFIGS)}")
    parser.add_argument("--microbatch", type=int, default=1, choices=(1, 2, 4, 8))
    parser.add_argument("--planned", action="store_true", help="the plan made at start, not the pinned pipeline")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.families) - set(CONFIGS))
    if unknown:
        parser.error(f"unknown families {unknown}; known: {sorted(CONFIGS)}")
    import transformers

    from testing.launch import spawn_ranks

    print(f"transformers {transformers.__version__}, microbatch {args.microbatch}, "
          f"{'planned at start' if args.planned else 'pinned two-stage pipeline'}", flush=True)
    failed = 0
    for family in args.families:
        with tempfile.TemporaryDirectory() as root:
            try:
                results = spawn_ranks(_worker, WORLD, Path(root), family, args.microbatch, args.planned)
            except Exception as error:  # a rank that exits (a lost peer) ends the pair
                results = [f"error: {type(error).__name__}: {error}"[:300]]
        failed += any(r.startswith("error") for r in results)
        print(f"{family:12s} {'  '.join(results)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    sys.exit(main())
