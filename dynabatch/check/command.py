"""The work of ``dynabatch check MODEL_DIR DATA``: the folder report, one step of the data on each route,
printed (or one JSON object); exit 1 on any problem or disagreement."""

from __future__ import annotations

import json
import sys

from .folder import Problem, folder_report


def _first_step(args, report):
    from .. import Costing, DataLoader, PlanOptions, Tokenization

    tokenizer = report.tokenizer_spec  # the one the report checked against the vocabulary
    loader = DataLoader(args.data, options=PlanOptions(global_batch_tokens=args.batch_tokens, max_len=args.max_len,
                                                       num_stages=max(args.stages, 1), shuffle=False),
                        tokenization=Tokenization(tokenizer=tokenizer, model=args.model_dir),
                        costing=Costing(cost_model="gpt", device="cpu", collate=args.collate))
    try:
        return next(iter(loader.steps()), None)
    finally:
        loader.close()


def check_command(args) -> int:
    """``dynabatch check``: 0 when the folder loads, splits and every route agrees, else 1."""
    import torch

    report = folder_report(args.model_dir, stages=args.stages, tokenizer=args.tokenizer)
    routes = []
    if not report.problems:
        step = _first_step(args, report)
        if step is None or step.target_tokens == 0:
            report.problems.append(Problem(f"{args.data} gives no step with target tokens",
                                           "check the path and the records' fields (inputs/targets, messages)"))
        else:
            from .agreement import route_agreement

            dtype = getattr(torch, args.dtype)
            routes = route_agreement(args.model_dir, step, bounds=report.bounds, dtype=dtype)
            for r in routes:
                if not r.ok:
                    report.problems.append(Problem(
                        f"route {r.route} disagrees with the Hugging Face model ({r.line()})",
                        "report it with this output; train on a route that agrees meanwhile"))
    if args.json:
        print(json.dumps({"model": report.folder, "family": report.family, "layers": report.num_layers,
                          "bounds": list(report.bounds), "stage_bytes": list(report.stage_bytes),
                          "tokenizer_ids": report.tokenizer_ids, "vocab_size": report.vocab_size,
                          "decoder_start_token_id": report.decoder_start_token_id, "vision": report.vision,
                          "routes": [{"route": r.route, "loss": r.loss, "ref_loss": r.ref_loss,
                                      "grad_gap": r.grad_gap, "ok": r.ok} for r in routes],
                          "problems": [str(p) for p in report.problems]}))
    else:
        for line in report.lines():
            print(line)
        for r in routes:
            print(r.line())
        for p in report.problems:
            print(f"PROBLEM: {p}", file=sys.stderr)
        print("check: " + ("everything agrees" if not report.problems else f"{len(report.problems)} problem(s)"))
    return 1 if report.problems else 0
