"""`dynabatch.config_flags`: a config dataclass's flags built from its own fields, parsed back into it."""

import argparse
from dataclasses import dataclass

import pytest

from dynabatch.bench.trainer_config import TrainerBenchConfig
from dynabatch.config_flags import add_config_flags, config_from_args, flag_field


@dataclass(frozen=True)
class _Config:
    names: tuple[str, ...] = flag_field(("a", "b"), "--names", "which ones", choices=("a", "b", "c"))
    steps: int = flag_field(3, "--steps", "steps to run")
    rate: float = flag_field(0.5, "--rate", "a rate")
    cap: float | None = flag_field(None, "--cap", "an optional cap (seconds)", kind=float, metavar="SECONDS")
    unflagged: int = 7


def _parse(cls, argv):
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_config_flags(parser, cls)
    return parser, config_from_args(cls, parser.parse_args(argv))


def test_defaults_come_from_the_fields_and_values_parse_back_typed():
    _, cfg = _parse(_Config, [])
    assert cfg == _Config()
    _, cfg = _parse(_Config, ["--names", "c", "a", "--steps", "9", "--rate", "2e-3", "--cap", "12"])
    assert cfg == _Config(names=("c", "a"), steps=9, rate=2e-3, cap=12.0, unflagged=7)
    assert isinstance(cfg.steps, int) and isinstance(cfg.cap, float) and isinstance(cfg.names, tuple)


def test_help_shows_each_default_and_choices_are_enforced():
    parser, _ = _parse(_Config, [])
    text = " ".join(parser.format_help().split())
    assert "steps to run (default 3)" in text and "which ones (default a b)" in text
    assert "an optional cap (seconds)" in text and "--unflagged" not in text
    with pytest.raises(argparse.ArgumentError):
        parser.parse_args(["--names", "z"])


def test_the_trainer_bench_flags_are_its_config_fields():
    """Every flag of ``bench trainer`` sets the TrainerBenchConfig field it is declared on."""
    _, cfg = _parse(TrainerBenchConfig, ["--models", "llama", "--steps", "6", "--rounds", "2", "--timeout", "30",
                                         "--max-wall", "90", "--data", "x.jsonl"])
    assert cfg == TrainerBenchConfig(models=("llama",), steps=6, rounds=2, timeout_s=30.0, max_wall_s=90.0,
                                     data=("x.jsonl",))
    assert _parse(TrainerBenchConfig, [])[1] == TrainerBenchConfig()
