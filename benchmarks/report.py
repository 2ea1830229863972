"""The peer table of benchmarks/decode.py: ratios, floor shares and the fastest peer per position
added to the results dict (:func:`summarize`), and the human table on stdout (:func:`print_table`)."""
from __future__ import annotations

from typing import Any

from compile_time import fmt


def summarize(results: dict[str, Any]) -> None:
    """Add ratio to inductor, floor share and the fastest peer per position to ``results``."""
    engines, floor = results["engines"], results["floor_ms"]
    ind = engines.get("inductor", {}).get("positions", {})
    summary = {}
    for pos in map(str, results["config"]["positions"]):
        for name, rec in engines.items():
            v = rec["positions"].get(pos, {})
            if "median_ms" in v:
                v["ratio_to_inductor"] = (ind[pos]["median_ms"] / v["median_ms"]
                                          if "median_ms" in ind.get(pos, {}) else None)
                v["floor_share"] = floor / v["median_ms"]
        peers = {n: r["positions"][pos]["median_ms"] for n, r in engines.items()
                 if not n.startswith("fusec") and "median_ms" in r["positions"].get(pos, {})}
        s: dict[str, Any] = {"fastest_peer": None, "fastest_peer_ms": None, "fusec_ms": None,
                             "fusec_speedup_vs_fastest_peer": None}
        if peers:
            s["fastest_peer"] = min(peers, key=peers.get)
            s["fastest_peer_ms"] = peers[s["fastest_peer"]]
        fus = engines.get("fusec", {}).get("positions", {}).get(pos, {})
        if "median_ms" in fus:
            s["fusec_ms"] = fus["median_ms"]
            if peers:
                s["fusec_speedup_vs_fastest_peer"] = s["fastest_peer_ms"] / fus["median_ms"]
        summary[pos] = s
    results["summary"] = summary


def print_table(results: dict[str, Any]) -> None:
    """The human summary on stdout: one row per engine x position, then the fastest peers."""
    m = results["machine"]
    print(f"\n{results['model']['name']} bf16 decode step, batch 1, static cache {results['model']['max_cache_len']}; "
          f"{m['gpu']}, torch {m['torch']}; read bandwidth {results['read_bandwidth'] / 1e12:.2f} TB/s, "
          f"weights {results['model']['weight_bytes'] / 1e9:.3f} GB, floor {results['floor_ms']:.3f} ms; "
          f"median of {results['config']['steps']} CUDA-graph replays")
    head = (f"{'engine':<12} {'position':>8} {'ms':>8} {'min ms':>8} {'vs inductor':>11} "
            f"{'floor share':>11} {'us/layer':>8} {'cold s':>7} {'warm s':>7} {'rel err':>8}")
    print(head)
    print("-" * len(head))
    for name, rec in results["engines"].items():
        cold, warm = rec.get("compile_cold_s"), rec.get("compile_warm_s")
        for pos in map(str, results["config"]["positions"]):
            v = rec["positions"].get(pos, {})
            if "median_ms" not in v:
                continue
            ratio = v.get("ratio_to_inductor")
            print(f"{name:<12} {pos:>8} {v['median_ms']:>8.3f} {v['min_ms']:>8.3f} "
                  f"{fmt(ratio, '.2f', 10)}{'x' if ratio else ' '} {v['floor_share']:>11.1%} "
                  f"{(v['median_ms'] - results['floor_ms']) * 1e3 / results['model'].get('layers', 1):>8.1f} "
                  f"{fmt(cold, '.1f', 7)} {fmt(warm, '.1f', 7)} {v['rel_err_vs_hf_eager']:>8.1e}")
        if rec.get("error"):
            print(f"{name:<12} {'FAILED':>8}  {rec['error'][:100]}")
    for pos, s in results["summary"].items():
        if s["fastest_peer"] is None:
            line = "no peer measured"
        else:
            line = f"fastest peer {s['fastest_peer']} {s['fastest_peer_ms']:.3f} ms"
        if s["fusec_ms"] is not None:
            sp = s["fusec_speedup_vs_fastest_peer"]
            line += f"; fusec {s['fusec_ms']:.3f} ms" + (f" = {sp:.2f}x its speed" if sp else "")
        else:
            line += "; fusec not measured"
        print(f"position {pos}: {line}")
