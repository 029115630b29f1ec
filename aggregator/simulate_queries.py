"""``dpfed simulate --job svt|query``: the query jobs end to end on a local federation.

Started like ``dpfed simulate`` (coordinator + N site processes over mTLS, demo data with
nominal and ordinal columns), then as an analyst:

* ``svt``: opens a session with a query set (one count per ward, per severity level, a few
  predicates), continues it with a second batch, closes it, and reports per query how many
  sites answered "above T" -- with precision/recall against the true per-site counts, which
  only a simulation can compute;
* ``query``: all ranges over ``age`` in 32 public bins and the 2-way marginal of ward x
  severity, each with the estimated histogram, its error bars, the true pooled histogram and
  the chosen strategy against identity.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from dpfed.aggregator.local_federation import LocalFederation, SiteSettings
from dpfed.aggregator.query_report import query_report, svt_precision_recall, svt_report
from dpfed.aggregator.query_results import QueryJobResult, SVTJobResult
from dpfed.aggregator.report import Report
from dpfed.common import exit_codes
from dpfed.common.data.data_sources import open_data_source, spec_from_path
from dpfed.common.data.schema import Schema
from dpfed.common.errors import JobFailedError
from dpfed.common.queries.query_language import compile_query_set
from dpfed.common.transport.protocol import JobEvent

#: The demo's first SVT batch (ward and severity exist in the mixed demo schema).
SVT_BATCH_1: list[dict[str, Any]] = [
    {"per": "ward"},
    {"name": "age >= 75", "where": {"column": "age", "op": ">=", "value": 75}},
    {"name": "severe or critical in icu", "where": {"all": [
        {"column": "severity", "in": ["severe", "critical"]},
        {"column": "ward", "in": ["icu"]}]}},
]
SVT_BATCH_2: list[dict[str, Any]] = [
    {"per": "severity"},
    {"name": "not general ward", "where": {"not": {"column": "ward", "in": ["general"]}}},
]


def site_counts(fed: LocalFederation, raw: Any) -> dict[str, np.ndarray]:
    """Return the true (non-private) counts of a query set at every site (simulation only)."""
    schema = Schema.load(fed.schema_path)
    q = compile_query_set(schema, raw)
    out = {}
    for s in fed.site_ids:
        src = open_data_source(spec_from_path(fed.data_paths[s]), schema)
        out[s] = q.counts(t for t, _ in src.iter_chunks())[0]
    return out


def run_query_simulation(opts: Any) -> int:
    """Run ``--job svt`` or ``--job query`` (``opts`` is a SimulationOptions)."""
    from dpfed.aggregator.simulation_output import prepare_output, print_budgets, say

    out = Path(opts.out).resolve()
    prepare_output(out)
    t0 = time.monotonic()
    seed = opts.seed if opts.seed is not None else int.from_bytes(os.urandom(4), "little")
    features = max(opts.features, 6)
    settings = SiteSettings(budget_epsilon=opts.budget_epsilon or max(10.0, 4 * opts.epsilon),
                            budget_delta=opts.budget_delta or min(0.5, 10 * opts.delta),
                            noise_seed=opts.seed)
    fed = LocalFederation.create(out, n_sites=opts.sites, rows=opts.rows, features=features,
                                 seed=seed, fmt=opts.data_format, min_sites=opts.min_sites or None,
                                 task_deadline_s=opts.deadline, settings=settings, mixed=True,
                                 metrics=opts.metrics)
    say("data", f"{opts.sites} x {opts.rows} rows, {features} columns incl. nominal/ordinal "
         f"(seed {seed})")
    rep = Report(f"dpfed simulation: {opts.job} job")
    rep.paragraph(f"A coordinator and {opts.sites} site agents ran as separate processes over "
                  "gRPC with mutual TLS; every value that left a site was noised and charged to "
                  "that site's ledger first. True values are shown only because this is a "
                  "simulation.")

    def progress(event: JobEvent) -> None:
        say(opts.job, f"[{event.progress * 100:5.1f}%] {event.message}")

    try:
        fed.start_coordinator()
        fed.start_sites()
        fed.wait_for_sites()
        with fed.analyst() as coord:
            if opts.job == "svt":
                lines = _run_svt(fed, coord, opts, rep, progress)
            else:
                lines = _run_query(fed, coord, opts, rep, progress, out)
            budgets = coord.budgets()
    except JobFailedError as exc:
        say(opts.job, f"FAILED: {exc}")
        return exit_codes.for_error(exc)
    finally:
        fed.stop_all()
    rep.heading("Budgets")
    rep.table(("site", "epsilon spent", "epsilon cap", "releases"),
              [(s, b.epsilon_spent if b else "?", b.epsilon_cap if b else "?",
                b.events if b else "?") for s, _c, b in budgets])
    (out / "report.html").write_text(rep.render(), encoding="utf-8")
    print()
    for line in lines:
        print(line)
    print_budgets(budgets)
    print(f"  total {time.monotonic() - t0:.1f}s; results in {out}: report.html, *.npz, *.csv")
    return exit_codes.OK


def _run_svt(fed: LocalFederation, coord: Any, opts: Any, rep: Report,
             progress: Any) -> list[str]:
    threshold = float(round(0.15 * opts.rows))
    eps3 = opts.epsilon / 4
    opened: SVTJobResult = coord.svt(SVT_BATCH_1, epsilon=opts.epsilon, threshold=threshold,
                                     cutoff=4, numeric_epsilon=eps3, on_event=progress)
    opened.save(fed.root / "svt-batch1.npz")
    opened.save(fed.root / "svt-batch1.csv")
    nxt: SVTJobResult = coord.svt(SVT_BATCH_2, session=opened.session, on_event=progress)
    nxt.save(fed.root / "svt-batch2.npz")
    nxt.save(fed.root / "svt-batch2.csv")
    coord.svt(session=opened.session, close=True, on_event=progress)
    lines = [f"dpfed simulate --job svt: session {opened.session}, T={threshold:g}, c=4, "
             f"epsilon {opts.epsilon:g} per site (eps3 {eps3:g})"]
    for name, res, raw in (("batch 1", opened, SVT_BATCH_1), ("batch 2", nxt, SVT_BATCH_2)):
        truth = site_counts(fed, raw)
        svt_report(res, truth, rep, threshold)
        prec, rec = svt_precision_recall(res, truth, threshold)
        lines.append(f"  {name}: {len(res.table)} queries, precision {prec:.2f}, recall "
                     f"{rec:.2f} of 'above T' against the true per-site counts")
    return lines


def _run_query(fed: LocalFederation, coord: Any, opts: Any, rep: Report, progress: Any,
               out: Path) -> list[str]:
    lines = [f"dpfed simulate --job query: epsilon {opts.epsilon:g} per site"
             + (f", delta {opts.delta:g}, secure aggregation" if opts.aggregation == "secure"
                else "")]
    jobs: tuple[tuple[str, Any, dict[str, Any], list[Any]], ...] = (
        ("age-ranges", ["age"], {"bins": {"age": 32}, "workload": "all_range"},
         [{"per": "age", "bins": 32}]),
        ("ward-x-severity", ["ward", "severity"], {"workload": "marginals", "k": 2},
         [{"cross": ["ward", "severity"]}]),
    )
    for tag, cols, kw, raw in jobs:
        if opts.aggregation == "secure":  # Skellam (with the delta) or the discrete Laplace
            kw = {**kw, "aggregation": "secure", "delta": opts.delta}
        res: QueryJobResult = coord.query(cols, epsilon=opts.epsilon, on_event=progress, **kw)
        res.save(out / f"query-{tag}.npz")
        res.save(out / f"query-{tag}.csv")
        truth = sum(site_counts(fed, raw).values())
        query_report(res, np.asarray(truth), rep)
        w = res.answers
        true_answers = _true_answers(res, np.asarray(truth))
        rmse = float(np.sqrt(np.mean((w["estimate"].to_numpy() - true_answers) ** 2)))
        lines.append(f"  {tag}: strategy {res.strategy} ({res.noise}), {len(w)} queries, "
                     f"observed RMSE {rmse:.3g} vs expected {res.expected_rmse:.3g} "
                     f"(identity {res.identity_expected_rmse:.3g})")
    return lines


def _true_answers(res: QueryJobResult, truth: np.ndarray) -> np.ndarray:
    from dpfed.common.queries.workload_spec import build_workload

    w = dict(res.metadata["workload"])
    if w["kind"] != "marginals":
        w.pop("k", None)
    return build_workload(res.domain, w).answer(truth)
