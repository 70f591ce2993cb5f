"""Names and defaults the parsers show, copied from the modules that define them because those import
numpy or torch and a parser must not (`dynabatch.commands`). tests/test_cli_light.py checks that each
copy equals its original."""

#: `dynabatch.datagen.TEXT_FORMATS`: the text shard formats of ``dynabatch datagen``.
TEXT_FORMATS = ("jsonl", "jsonl.gz", "parquet")
#: `dynabatch.pipeline.models.MODELS`: the tiny models (``dynabatch profile``, ``bench train``).
TINY_MODELS = ("gpt-tiny", "t5-tiny", "vlm-tiny")
#: `dynabatch.bench.train.TRAIN_METHODS` / `VLM_METHODS`: the methods ``bench train`` runs by default.
TRAIN_METHODS = ("dp", "pack", "pad", "token_budget")
VLM_METHODS = ("dp", "dp-blind", "pack", "token_budget")
#: `dynabatch.bench.loader.METHODS`: the loaders ``bench loader`` times.
LOADER_METHODS = ("torch_pad", "torch_pack", "dynabatch_padded", "dynabatch_packed")
#: `dynabatch.bench.multimodel.LR_FACTORS`: the learning-rate factors of ``bench multimodel``'s K models.
LR_FACTORS = (1.0, 0.3, 3.0, 0.1, 0.5, 2.0, 0.2, 5.0)
#: `dynabatch.pipeline.measure.profile.DEFAULT_ROWS` / `DEFAULT_LENGTHS` / `DEFAULT_TILES`: the grid
#: ``dynabatch profile`` measures by default (rows, main-stack tokens, image tiles per micro-batch).
PROFILE_ROWS = (1, 2, 4, 8)
PROFILE_LENGTHS = (16, 32, 64, 128)
PROFILE_TILES = (1, 2, 4)
