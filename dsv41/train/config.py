"""TrainConfig: the hyper-parameters of a training run; one field, one `python -m dsv41.train` flag.

Defaults are the nano run (`dsv41/presets/nano.json` on the Austen corpus): 4 x 1024 tokens per step,
backbone then DSpark. Every check names the field it rejects.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

MOE_COMPUTE = ("dense", "grouped")
# Fields that only change what is logged or kept, not the trained weights: they may differ on resume.
_BOOKKEEPING = ("eval_every", "eval_windows", "checkpoint_every", "keep_checkpoints")


def _field(default, help_text: str):
    return dataclasses.field(default=default, metadata={"help": help_text})


@dataclass(frozen=True)
class TrainConfig:
    seed: int = _field(0, "parameters, batches and DSpark anchors all derive from it")
    seq_len: int = _field(1024, "tokens per training window (a BOS is prepended; > sliding_window so top-k cuts)")
    batch_size: int = _field(4, "windows per step")
    backbone_steps: int = _field(450, "LM steps (AdamW, warmup + cosine)")
    dspark_steps: int = _field(100, "drafter steps after the backbone, against the frozen backbone")
    init_from: str = _field("", "start from this checkpoint folder's parameters (decoded to float32) instead of "
                                "random ones: with --backbone-steps 0, train its drafter further")
    learning_rate: float = _field(3e-3, "backbone peak learning rate")
    dspark_learning_rate: float = _field(3e-3, "drafter peak learning rate")
    warmup_steps: int = _field(50, "linear warmup of each phase")
    final_lr_fraction: float = _field(0.1, "cosine decays to this fraction of the peak")
    weight_decay: float = _field(0.1, "AdamW, matrices only")
    grad_clip: float = _field(1.0, "global gradient norm")
    bias_update_rate: float = _field(1e-2, "aux-loss-free router bias step (DeepSeek-V3: 1e-3, over far more steps)")
    balance_loss_weight: float = _field(1e-4, "sequence-wise MoE balance loss (DeepSeek-V3's alpha)")
    indexer_loss_weight: float = _field(1.0, "lightning indexer KL distillation (trains only the indexer)")
    indexer_kl_stride: int = _field(4, "the indexer KL runs on every n-th query")
    confidence_loss_weight: float = _field(0.1, "DSpark confidence head BCE")
    dspark_anchors: int = _field(64, "proposal blocks drafted per training window")
    dspark_data: str = _field("", "a .npy of windows [n, seq_len + 1] the DSpark phase draws its batches from instead "
                                  "of the corpus (tools/target_outputs.py: the target's own greedy continuations)")
    moe_compute: str = _field("dense", "routed experts: 'dense' (every expert, sparse weights) or 'grouped'")
    eval_every: int = _field(100, "held-out evaluation interval in steps")
    eval_windows: int = _field(16, "held-out windows per interim evaluation (the final one uses all; 0: none)")
    checkpoint_every: int = _field(50, "Orbax checkpoint interval in steps")
    keep_checkpoints: int = _field(2, "newest checkpoints kept")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.type == "int" and (isinstance(v, bool) or not isinstance(v, int)):
                raise ValueError(f"{f.name} must be an integer, got {v!r}")
        positive = ("seq_len", "batch_size", "warmup_steps", "dspark_anchors", "eval_every", "indexer_kl_stride",
                    "checkpoint_every", "keep_checkpoints", "learning_rate", "dspark_learning_rate", "grad_clip")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("backbone_steps", "dspark_steps", "eval_windows", "weight_decay", "bias_update_rate",
                     "balance_loss_weight", "indexer_loss_weight", "confidence_loss_weight", "seed"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.final_lr_fraction <= 1:
            raise ValueError(f"final_lr_fraction must be in [0, 1], got {self.final_lr_fraction}")
        if self.backbone_steps + self.dspark_steps == 0:
            raise ValueError("backbone_steps and dspark_steps are both 0: nothing to train")
        if self.moe_compute not in MOE_COMPUTE:
            raise ValueError(f"moe_compute must be one of {MOE_COMPUTE}, got {self.moe_compute!r}")

    @staticmethod
    def math_fields() -> tuple[str, ...]:
        """The fields a resumed run must share with the run it continues."""
        return tuple(f.name for f in dataclasses.fields(TrainConfig) if f.name not in _BOOKKEEPING)

    def math(self) -> TrainConfig:
        """This config with the bookkeeping fields at their defaults (what compiled steps depend on)."""
        return dataclasses.replace(self, **{n: TrainConfig.__dataclass_fields__[n].default for n in _BOOKKEEPING})

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.batch_size


def add_flags(parser: argparse.ArgumentParser) -> None:
    """One --flag per TrainConfig field (dashes for underscores), default and help from the field."""
    group = parser.add_argument_group("training (TrainConfig)")
    for f in dataclasses.fields(TrainConfig):
        kind = {"int": int, "float": float, "str": str}[f.type]
        choices = MOE_COMPUTE if f.name == "moe_compute" else None
        group.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=kind, default=f.default,
                           choices=choices, help=f"{f.metadata['help']} (default {f.default})")


def from_args(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
