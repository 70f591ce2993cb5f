"""`dynabatch bench loader`: the torch baselines, what a user writes today.

Pre-tokenized samples in a map-style dataset (`setup_baseline`, untimed) batched by a
``torch.utils.data.DataLoader`` with a padding (`pad_collate`) or a packing (`PackCollate`)
collator. Module level, so DataLoader workers can pickle them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

IGNORE_INDEX = -100


class PretokenizedDataset(torch.utils.data.Dataset):
    """Map-style dataset of pre-tokenized samples: ``(sample_id, input_ids, labels)``."""

    def __init__(self, ids: list[int], input_ids: list[torch.Tensor], labels: list[torch.Tensor]):
        self.ids, self.input_ids, self.labels = ids, input_ids, labels

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return self.ids[i], self.input_ids[i], self.labels[i]


def pad_collate(batch, pad_id: int = 0) -> dict:
    """Right-pad to the batch's longest sample, like ``DataCollatorWithPadding`` (+ labels)."""
    n = len(batch)
    L = max(len(x[1]) for x in batch)
    input_ids = torch.full((n, L), pad_id, dtype=torch.long)
    labels = torch.full((n, L), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((n, L), dtype=torch.long)
    for r, (_, ids, lab) in enumerate(batch):
        k = len(ids)
        input_ids[r, :k] = ids
        labels[r, :k] = lab
        attention_mask[r, :k] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels,
            "sample_ids": torch.tensor([x[0] for x in batch], dtype=torch.long)}


class PackCollate:
    """Pack a batch into rows of ``max_len`` tokens (greedy, in order; a sample never straddles
    two rows), ``position_ids`` restarting at 0 per sample, rows right-padded to ``max_len``."""

    def __init__(self, max_len: int, pad_id: int = 0):
        self.max_len, self.pad_id = int(max_len), int(pad_id)

    def __call__(self, batch) -> dict:
        rows, fill = [], self.max_len
        for item in batch:
            k = len(item[1])
            if fill + k > self.max_len:
                rows.append([])
                fill = 0
            rows[-1].append(item)
            fill += k
        n, L = len(rows), self.max_len
        input_ids = torch.full((n, L), self.pad_id, dtype=torch.long)
        labels = torch.full((n, L), IGNORE_INDEX, dtype=torch.long)
        attention_mask = torch.zeros((n, L), dtype=torch.long)
        position_ids = torch.zeros((n, L), dtype=torch.long)
        for r, row in enumerate(rows):
            at = 0
            for _, ids, lab in row:
                k = len(ids)
                input_ids[r, at:at + k] = ids
                labels[r, at:at + k] = lab
                attention_mask[r, at:at + k] = 1
                position_ids[r, at:at + k] = torch.arange(k)
                at += k
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels,
                "position_ids": position_ids,
                "sample_ids": torch.tensor([x[0] for x in batch], dtype=torch.long)}


def jsonl_source(files: list[Path]):
    """The reader every method uses: one ``loaders.JsonlSource`` over ``files``."""
    import loaders

    return loaders.JsonlSource([str(p) for p in files])


def setup_baseline(files: list[Path], fmt, chunk: int = 1024) -> PretokenizedDataset:
    """Read every sample through the same reader and tokenize it with the same formatter."""
    ids, inp, lab = [], [], []
    buf = []

    def flush():
        for e in fmt.encode_batch(buf):
            ids.append(int(e.sample_id))
            inp.append(torch.from_numpy(e.input_ids.astype(np.int64)))
            lab.append(torch.from_numpy(e.labels.astype(np.int64)))
        buf.clear()

    for s in jsonl_source(files):
        buf.append(s)
        if len(buf) >= chunk:
            flush()
    if buf:
        flush()
    return PretokenizedDataset(ids, inp, lab)
