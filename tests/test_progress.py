"""Progress bars on every scan a user waits for: the DataLoader's length index and token cache,
`build_index` (tqdm on stderr, counting samples to the known total; quiet when stderr is not a
terminal unless asked for)."""

from __future__ import annotations

import re

from dynabatch import DataLoader, build_index

from test_dataloader_data import PLAN, records, write_parquet
from dynabatch.loader.settings import records_from_keywords


def _bars(err: str) -> dict[str, str]:
    """Last rendering of each tqdm bar in ``err``, by its description."""
    out = {}
    for piece in re.split(r"[\r\n]", err):
        m = re.match(r"(dynabatch: [^:]+):", piece.strip())
        if m:
            out[m.group(1)] = piece.strip()
    return out


def test_dataloader_index_build_shows_a_bar_of_every_sample(tmp_path, capsys):
    path = write_parquet(tmp_path / "t.parquet", records(300, seed=1))
    dl = DataLoader(path, **records_from_keywords(global_batch_tokens=2000, progress=True, **PLAN))
    assert len(dl) > 1
    bars = _bars(capsys.readouterr().err)
    assert "300/300" in bars["dynabatch: length index"]  # the token ids are kept by the same pass


def test_token_cache_pass_has_a_bar(tmp_path, capsys):
    path = write_parquet(tmp_path / "t.parquet", records(120, seed=2))
    index = build_index(path, max_len=None)  # an index without token columns: the loader tokenizes once more
    capsys.readouterr()
    DataLoader(path,
               **records_from_keywords(index=index, global_batch_tokens=2000, cache_tokens=True, progress=True,
                                       **PLAN))
    assert "120/120" in _bars(capsys.readouterr().err)["dynabatch: tokenize (token cache)"]


def test_build_index_bar_and_quiet_when_not_a_terminal(tmp_path, capsys):
    path = write_parquet(tmp_path / "t.parquet", records(90, seed=3))
    build_index(path, progress=True)
    assert "90/90" in _bars(capsys.readouterr().err)["dynabatch: length index"]
    build_index(path)  # default: a bar only on a terminal; pytest's captured stderr is not one
    DataLoader(path, **records_from_keywords(global_batch_tokens=2000, **PLAN))
    assert "dynabatch:" not in capsys.readouterr().err
