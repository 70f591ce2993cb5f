"""What ``dynabatch bench trainer`` runs (`TrainerBenchConfig`), each option declared once with its
flag (`dynabatch.config_flags`); standard library only, so the command's ``--help`` needs no torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..config_flags import flag_field
from .trainer_names import METHODS, MODELS


@dataclass(frozen=True)
class TrainerBenchConfig:
    """What ``dynabatch bench trainer`` runs (see `dynabatch.bench.trainer`); tokens, steps, seconds."""

    models: tuple[str, ...] = flag_field(MODELS, "--models", "the tiny random models to train", choices=MODELS)
    methods: tuple[str, ...] = flag_field(METHODS, "--methods", "the batching methods to compare", choices=METHODS)
    steps: int = flag_field(12, "--steps", "optimizer steps per method")
    rounds: int = flag_field(3, "--rounds", "interleaved rounds the steps are split into (each round's first step "
                                            "is not timed)")
    global_batch_tokens: int = flag_field(8192, "--global-batch-tokens", "tokens per step over both ranks")
    max_len: int = flag_field(512, "--max-len", "truncate inputs to this many tokens")
    max_target_len: int = flag_field(128, "--max-target-len", "truncate targets to this many tokens")
    samples: int = flag_field(2000, "--samples", "training samples drawn from the data (their mean length sets the HF "
                              "methods' batch; every method of a model trains on the first steps x batch x 2)")
    eval_samples: int = flag_field(64, "--eval-samples", "held-out samples the final loss is measured on")
    data: tuple[str, ...] = flag_field((), "--data", "JSONL (.gz) or Parquet files with inputs/targets; none: "
                                                     "the shared FLAN sample, else generated text", metavar="PATH")
    lr: float = flag_field(1e-3, "--lr", "AdamW learning rate, constant")
    refit_every: int = flag_field(2, "--refit-every", "dp: steps between cost-model refits")
    seed: int = flag_field(0, "--seed", "seed of the data draw, the weights and the shuffles")
    timeout_s: float = flag_field(600.0, "--timeout", "liveness timeout: stop when no rank made progress for this "
                                                      "long (seconds)", metavar="SECONDS")
    max_wall_s: float | None = flag_field(None, "--max-wall", "optional cap on the run's wall time (seconds)",
                                          metavar="SECONDS", kind=float)
    batch_size: dict = field(default_factory=dict)  # per model: the HF methods' samples per rank (set by the run)
    bfd_batch_size: dict = field(default_factory=dict)  # per model: trl_bfd's packed rows per rank (set by the run)
    trl_installed: bool = False  # set by the run

    def __post_init__(self):
        bad = [m for m in self.methods if m not in METHODS] + [m for m in self.models if m not in MODELS]
        if bad:
            raise ValueError(f"unknown model/method {bad}: models {MODELS}, methods {METHODS}")
        if "dp" not in self.methods:
            raise ValueError("the bench compares dp with the other methods: keep dp in --methods")
        if self.rounds < 1 or self.steps % self.rounds or self.steps // self.rounds < 2:
            raise ValueError(f"--steps {self.steps} must be a multiple of --rounds {self.rounds} with at least 2 steps "
                             "per round (the first step of a round is not timed)")

    @property
    def steps_per_round(self) -> int:
        """Optimizer steps per method in one round."""
        return self.steps // self.rounds


__all__ = ["TrainerBenchConfig"]
