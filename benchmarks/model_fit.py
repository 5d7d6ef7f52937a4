"""The cost model against ``bench_model.py``'s measurements, with a held-out check, and its
tables.

A point's value is the best of its rounds (load from other jobs only ever slows a run), the
calibration's compute the median of its rounds' and its collectives the quickest round's.
The machine's free parameters are fitted and checked by :mod:`shoal.plan.fit`: on all
points, and on each of two folds (every other point) to predict the other fold's points,
which they never saw.
"""

from __future__ import annotations

import statistics
from typing import Any

from shoal.plan.fit import Setting, check
from shoal.plan.simulate import SC17_EFFICIENCY, parse_bandwidth, parse_latency, predict, workloads
from shoal.strategies.cost import Calibration, Network

#: The strategies predicted for the clusters that cannot be run here.
PREDICTED = ("sync,local-sgd:tau=4,local-sgd:tau=16,easgd:tau=4,easgd:tau=16,diloco:tau=16,"
             "async-sgd,async-sgd:servers=16,async-easgd:tau=4,async-easgd:tau=4,servers=16,"
             "groups:groups=4,groups:groups=16,servers=16")


def points(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Each point's best round, with all its rounds' samples/s."""
    best: dict[tuple[str, str, int], dict[str, Any]] = {}
    for run in result["runs"]:
        key = (run["network"], run["strategy"], run["workers"])
        if key not in best or run["samples_per_s"] > best[key]["samples_per_s"]:
            best[key] = {**run, "rounds": best.get(key, {}).get("rounds", [])}
        best[key]["rounds"].append(run["samples_per_s"])
    return list(best.values())


def calibration(result: dict[str, Any], emulated: bool = False) -> Calibration:
    """The rounds' calibrations: the median compute (a few steps' timing errs both ways by a
    few percent, and a busy round's far above: the median keeps neither), and the latency
    and bandwidth of the round whose 4-byte all-reduce was quickest (load only slows a
    message down; a round's two timings are taken together, as the bandwidth is their
    difference); ``emulated``:
    those of the emulated cluster's endpoints (``bench_model.emulated_collectives``)."""
    rounds = result["calibrations"]
    alpha, rate = ("emulated_alpha_s", "emulated_bytes_per_s") if emulated else \
        ("alpha_host_s", "host_bytes_per_s")
    quietest = min((c for c in rounds if alpha in c), key=lambda c: c[alpha])
    return Calibration(statistics.median(c["compute_s_per_sample"] for c in rounds), 1,
                       quietest[alpha], quietest[rate], result["cores"],
                       "the rounds' median compute, the quickest round's collectives")


def check_model(result: dict[str, Any]) -> dict[str, Any]:
    """The best round of every point, predicted by the machine fitted on all points and by
    the one fitted on the other fold's (:func:`shoal.plan.fit.check`)."""
    emulated = any(r["network"] != "local" for r in result["runs"])
    setting = Setting(result["batch"], result["params"], result["cores"], calibration(result),
                      calibration(result, emulated=emulated))
    return {"calibration": setting.local.to_dict(), "emulated_calibration":
            setting.emulated.to_dict(), **check(points(result), setting)}


def _summary(rows: list[dict[str, Any]], key: str, what: str) -> str:
    within = sum(abs(r[key]) <= 0.2 for r in rows)
    worst = max(rows, key=lambda r: abs(r[key]))
    return (f"{what}: {within}/{len(rows)} within 20%, the largest error "
            f"{100 * worst[key]:+.1f}% ({worst['network']} {worst['strategy']} "
            f"w{worst['workers']})")


def point_table(check: dict[str, Any]) -> str:
    """The points as a markdown table: measured, predicted by the parameters fitted on all
    points, and held out (predicted by the other fold's)."""
    rows = check["points"]

    def params(values: dict[str, float]) -> str:
        return ", ".join(f"{k} {v:.4g}" for k, v in values.items())

    lines = [f"fitted on all points: {params(check['fitted'])}",
             f"on the folds: {params(check['folds'][0])}; {params(check['folds'][1])}", "",
             "| network | strategy | workers | measured samples/s (rounds) | predicted | error "
             "| held out | error |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        rounds = ", ".join(f"{v:,.0f}" for v in r["rounds"])
        lines.append(f"| {r['network']} | {r['strategy']} | {r['workers']} | "
                     f"{r['samples_per_s']:,.0f} ({rounds}) | {r['predicted']:,.0f} | "
                     f"{100 * r['error']:+.1f}% | {r['held_out']:,.0f} | "
                     f"{100 * r['held_out_error']:+.1f}% |")
    lines += ["", _summary(rows, "error", "fitted on all points"),
              _summary(rows, "held_out_error", "held out (two folds)")]
    return "\n".join(lines)


def cluster_table(result: dict[str, Any], nodes: str, bandwidth: str, latency: str
                  ) -> dict[str, Any]:
    """The predictions for ``nodes`` nodes of this machine's cores on a nominal link; prints
    the table and returns it."""
    node = Calibration.from_dict(result["node_calibration"], "bench_model.json")
    net = Network(parse_bandwidth(bandwidth), parse_latency(latency))
    counts = [int(n) for n in nodes.split(",")]
    by: dict[tuple[str, int], Any] = {}
    for w in workloads(PREDICTED, {}):
        for n in counts:
            by[w.label, n] = predict(w, n, result["batch"], result["params"], node, net)
    names = list(dict.fromkeys(label for label, _ in by))
    print(f"\nPredicted at {bandwidth}, {latency} (nominal), batch {result['batch']} per node, "
          f"{1e6 * node.compute_s_per_sample:.1f} us/sample with {node.threads} threads:\n")
    print("| strategy | " + " | ".join(f"{n} nodes: samples/s | efficiency" for n in counts) + " |")
    print("|---|" + "---:|---:|" * len(counts))
    for name in names:
        print(f"| {name} | " + " | ".join(f"{by[name, n].samples_per_s:,.0f} | "
                                          f"{100 * by[name, n].efficiency:.1f}%" for n in counts) + " |")
    beats = {str(n): [s for s in names if by[s, n].efficiency >= SC17_EFFICIENCY] for n in counts}
    for n, names_n in beats.items():
        print(f"beat SC17's {100 * SC17_EFFICIENCY:.1f}% at {n} nodes: " + (", ".join(names_n) or "none"))
    return {"bandwidth": bandwidth, "latency": latency, "beats_sc17": beats,
            "rows": [{"strategy": s, "nodes": n, **by[s, n].to_dict()} for s, n in by]}
