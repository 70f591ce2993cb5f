"""Task-tagged data (issue 39, item 5): a `TaskMixture` read by the `DataLoader` tags every sample with its
source's task, the same in every run and after a resume, and names the graph's tasks for an unknown one."""

import json

import loaders
import pytest

from dynabatch.core.multitask import mtmm_tiny_graph
from dynabatch.loader.dataloader import DataLoader
from dynabatch.loader.settings import records_from_keywords
from dynabatch.loader.tasks import TaskMixture, step_samples

TASKS = {"text": "text", "caption": "image_text", "speech": "audio_text"}


def _sources(tmp_path):
    out = {}
    for k, name in enumerate(TASKS):
        path = tmp_path / f"{name}.jsonl"
        with open(path, "w") as f:
            for i in range(30):
                f.write(json.dumps({"inputs": f"{name} {i} " + "w " * ((7 * i + 3 * k) % 37 + 2), "targets": "ok"})
                        + "\n")
        out[name] = loaders.open_source(str(path))
    return out


def _mixture(tmp_path, seed=5):
    return TaskMixture(_sources(tmp_path), {"text": 3, "caption": 2, "speech": 1}, tasks=TASKS,
                       graph=mtmm_tiny_graph(), seed=seed)


def _loader(mix):
    return DataLoader(mix, **records_from_keywords(dict(tokenizer="bytes", global_batch_tokens=600)))


def _tags(steps):
    return [[(tuple(mb["sample_ids"].tolist()), mb["tasks"]) for mb in step] for step in steps]


def test_tags_follow_each_samples_source(tmp_path):
    mix = _mixture(tmp_path)
    # the source of every sample id, read from the mixture's own records ("source" field), not from shards
    truth = {r["sample_id"]: TASKS[r["source"]] for r in _mixture(tmp_path)}
    seen = 0
    for step in _loader(mix):
        for mb in step:
            assert mb["tasks"] == tuple(truth[s] for s in mb["sample_ids"].tolist())
            seen += len(mb["tasks"])
    assert seen == len(truth) == 90
    assert set(truth.values()) == set(TASKS.values())


def test_tags_are_deterministic_and_survive_resume(tmp_path):
    full = _tags(_loader(_mixture(tmp_path)))
    assert full == _tags(_loader(_mixture(tmp_path)))
    assert len(full) >= 3
    first = _loader(_mixture(tmp_path))
    it = iter(first)
    head = _tags([next(it), next(it)])
    state = first.state_dict()
    resumed = _loader(_mixture(tmp_path))
    resumed.load_state_dict(state)
    assert head + _tags(resumed) == full


def test_step_samples_regroup_a_loader_step_by_task(tmp_path):
    mix = _mixture(tmp_path)
    g = mtmm_tiny_graph()
    step = next(iter(_loader(mix)))
    s = step_samples(step, mix, g, microbatch_tokens=256, audio_tokens={"audio_text": 12})
    tags = [t for mb in step for t in mb["tasks"]]
    assert sorted(s.tasks) == sorted(tags)
    assert all((a == 12) == (t == "audio_text") for a, t in zip(s.audio.tolist(), s.tasks))
    assert set(s.microbatch_tasks) <= set(g.task_names)


def test_unknown_task_names_the_source_and_the_graphs_tasks(tmp_path):
    with pytest.raises(ValueError, match=r"source 'speech' is tagged with task 'asr'.*text, image_text, audio_text"):
        TaskMixture(_sources(tmp_path), tasks={**TASKS, "speech": "asr"}, graph=mtmm_tiny_graph())
    with pytest.raises(ValueError, match="not sources of the mixture"):
        TaskMixture(_sources(tmp_path), tasks={"video": "text"})
