"""Where a ``fusec.generate`` call's time goes, on the GPU.

Llama-3.2-1B at its published widths, bf16, random weights made to repeat their text
(``benchmarks/batch.py`` ``echo_weights``), a 32-token prompt, 128 new tokens: the eager
prefill's parts timed alone (a new StaticCache, ``reset()``, the prefill), then for greedy and
prompt lookup N = 3 and 7 the median call and a ``torch.profiler`` trace of one call (GPU busy
time, kernels by name, the host's top ATen ops; ``$OUT/trace_lookup*.json`` for a timeline
viewer); without ``quick``, also the GPU operations per step of a plain loop of
``torch.compile(model, backend="fusec")`` steps and the compiles over five prompt lengths in one
process for ``fusec.generate`` and HF ``generate()`` through fusec. Writes ``$OUT/prof.txt``.

Usage (GPU machine, repository root): ``python3 tools/generate_profile.py [quick]``
"""
import logging, os, statistics, sys, time
sys.path[:0] = [os.getcwd(), os.path.join(os.getcwd(), "benchmarks")]
import torch
import families, batch as bbatch
import fusec
import fusec.fallbacks
from fusec.fallbacks import FallbackWatch
from transformers import StaticCache
logging.basicConfig(level=logging.WARNING)
OUT = os.environ.get("OUT", "/tmp")
rep = open(os.path.join(OUT, "prof.txt"), "w")
def say(*a):
    s = " ".join(str(x) for x in a); print(s, flush=True); rep.write(s + "\n"); rep.flush()
dev = "cuda"
model, label = families.build("llama", "published", dev)
say(torch.cuda.get_device_name(), label)
bbatch.echo_weights(model, bbatch.ECHO_SCALE)
gen = torch.Generator(device=dev).manual_seed(1)
prompt = torch.randint(1, model.config.vocab_size, (1, 32), device=dev, generator=gen)
def timed(fn, n=5):
    ts = []
    for _ in range(n):
        torch.cuda.synchronize(); t0 = time.perf_counter(); fn(); torch.cuda.synchronize(); ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3
# pieces
with torch.no_grad():
    say("StaticCache(256) ms", "%.2f" % timed(lambda: StaticCache(config=model.config, max_cache_len=256)))
    c = StaticCache(config=model.config, max_cache_len=256)
    model(input_ids=prompt, past_key_values=c)
    say("cache.reset ms", "%.2f" % timed(lambda: c.reset()))
    def pre():
        c.reset()
        model(input_ids=prompt, past_key_values=c, use_cache=True, logits_to_keep=1)
    say("prefill 32 (eager, kept cache) ms", "%.2f" % timed(pre))
    def pre2():
        cc = StaticCache(config=model.config, max_cache_len=256)
        model(input_ids=prompt, past_key_values=cc, use_cache=True, logits_to_keep=1)
    say("prefill 32 (eager, new cache) ms", "%.2f" % timed(pre2))
from torch.profiler import profile, ProfilerActivity
for lookup in (None, 3, 7):
    kw = {"eos_token_id": []} | ({} if lookup is None else {"prompt_lookup_num_tokens": lookup})
    torch._dynamo.reset()
    with FallbackWatch() as w:
        fusec.generate(model, prompt, 128, **kw)
        ms = timed(lambda: fusec.generate(model, prompt, 128, **kw))
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fusec.generate(model, prompt, 128, **kw)
            torch.cuda.synchronize()
    say(f"\n=== lookup={lookup}: call {ms:.1f} ms, 128 new tokens -> {128 / ms * 1e3:.0f} tok/s; fallbacks {w.fallbacks[:1]}")
    if lookup:
        from fusec import prompt_lookup; say("stats", dict(prompt_lookup.last_stats))
    ev = [e for e in prof.events() if e.device_type.name == "CUDA"]
    say("GPU events", len(ev), "GPU busy ms %.2f" % (sum(e.device_time for e in ev) / 1e3))
    ks = {}
    for e in ev:
        ks.setdefault(e.name[:60], [0, 0.0]); ks[e.name[:60]][0] += 1; ks[e.name[:60]][1] += e.device_time
    for n, (cnt, t) in sorted(ks.items(), key=lambda x: -x[1][1])[:12]:
        say(f"  {cnt:5d} {t/1e3:8.2f} ms  {n}")
    say(prof.key_averages().table(sort_by="cpu_time_total", row_limit=22, max_name_column_width=60))
    prof.export_chrome_trace(os.path.join(OUT, f"trace_lookup{lookup}.json"))
# kernels per step of a plain loop, and compiles over prompt lengths
if 'quick' in sys.argv:
    rep.close(); sys.exit(0)
torch._dynamo.reset()
compiled = torch.compile(model, backend="fusec")
with torch.no_grad():
    c = StaticCache(config=model.config, max_cache_len=1024)
    model(input_ids=prompt, past_key_values=c)
    tok = prompt[:, -1:]
    with FallbackWatch() as w:
        for _ in range(4):
            tok = compiled(input_ids=tok, past_key_values=c).logits[:, -1].argmax(-1, keepdim=True)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                tok = compiled(input_ids=tok, past_key_values=c).logits[:, -1].argmax(-1, keepdim=True)
            torch.cuda.synchronize()
    ev = [e for e in prof.events() if e.device_type.name == "CUDA"]
    names = {}
    for e in ev: names[e.name[:50]] = names.get(e.name[:50], 0) + 1
    say(f"\nplain loop: {len(ev)} GPU events in 10 steps; fallbacks {w.fallbacks[:1]}; by name {names}")
torch._dynamo.reset()
for path in ("fusec.generate", "HF generate"):
    with FallbackWatch() as w:
        for plen in (40, 350, 1200, 90, 700):
            p = torch.randint(1, model.config.vocab_size, (1, plen), device=dev, generator=gen)
            before = fusec.fallbacks.COMPILED[0]
            torch.cuda.synchronize(); t0 = time.perf_counter()
            if path == "fusec.generate":
                fusec.generate(model, p, 64, eos_token_id=[])
            else:
                from transformers.generation import CompileConfig
                model.generate(p, max_new_tokens=64, do_sample=False, cache_implementation="static",
                               compile_config=CompileConfig(backend="fusec"), pad_token_id=0, eos_token_id=None)
            torch.cuda.synchronize()
            say(f"{path} prompt {plen}: {time.perf_counter() - t0:.2f} s, compiled {fusec.fallbacks.COMPILED[0] - before}, fallbacks {len(w.fallbacks)}")
rep.close()
