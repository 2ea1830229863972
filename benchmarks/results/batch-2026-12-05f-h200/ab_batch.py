"""One process: benchmarks/batch.py per variant (fusec options), a table of fusec ms per shape last (scratch)."""
import json, sys, time
sys.path.insert(0, "benchmarks")
import batch
VARIANTS = [
    ("new-default", {}, ["--batches", "1", "8", "16", "--tokens", "4", "8"]),
    ("old (HEAD)", {"defines": {"FUSEC_RMS_ROWS_ONE_ROUND": 0, "FUSEC_STAGE_BATCH": 1}}, ["--batches", "1", "8", "16", "--tokens", "4", "8"]),
    ("l2-64k", {"defines": {"FUSEC_SEQS_L2_PREFETCH": 65536}}, ["--batches", "8", "16", "--tokens", "8"]),
    ("lif16", {"defines": {"FUSEC_LOADS_IN_FLIGHT": 16}}, ["--batches", "8", "16", "--tokens", "8"]),
]
out = sys.argv[1]
rows = {}
for name, opts, shapes in VARIANTS:
    t = time.time()
    batch.main(["--peer", "none", "--generate-batch", "0", "--lookup", "--steps", "30", *shapes,
                "--options", json.dumps(opts), "--out", f"{out}/ab-{name.split()[0]}.json"])
    res = json.load(open(f"{out}/ab-{name.split()[0]}.json"))
    rows[name] = {f"{t[0].upper()}={k}": (r.get("fusec_ms"), r.get("fusec_rel_err"), r.get("fusec_fell_back"))
                  for t in (("batch", res["batch"]), ("tokens", res["tokens"])) for k, r in t[1].items()}
    print(f"== {name} took {time.time() - t:.0f} s: " + "  ".join(f"{k} {v[0]:.3f} ({v[1]:.1e}{' FELL BACK' if v[2] else ''})" for k, v in rows[name].items() if v[0]), flush=True)
print("variant         " + "".join(f"{s:>10}" for s in rows["new-default"]))
for name, r in rows.items():
    print(f"{name:16}" + "".join(f"{(r[s][0] if s in r and r[s][0] else float('nan')):10.3f}" for s in rows["new-default"]))
print(json.dumps(rows))
