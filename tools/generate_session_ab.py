"""fusec.generate's kept buffers (fusec/generation/session.py) against new ones per call, on the GPU.

One process, alternating: greedy ``fusec.generate`` with the model's kept session (cache, token
buffer, CUDA graph) against a new cache and a 16-step capture per call (the session dropped
before each call, as before 3d3ccab), then prompt lookup N = 3 and 7 the same way. Llama-3.2-1B
at its published widths, bf16, random weights made to repeat their text
(``benchmarks/batch.py`` ``echo_weights``: drafts get accepted), a 32-token prompt, 128 new
tokens, the median of 7 calls after one untimed. Writes ``$OUT/ab.txt`` (default /tmp).

With ``kernels``: prompt lookup's bookkeeping as two CUDA kernels
(``fusec/runtime/lookup_kernels.py``) against the torch ops, N = 3 and 7, alternating, the kept
session captured again for each (the same model, prompt and timing; tokens checked against
greedy's every call), then the GPU kernels of one N = 3 call by name; writes
``$OUT/lookup_ab.txt``.

Usage (GPU machine, repository root): ``python3 tools/generate_session_ab.py [kernels]``
"""
import os, statistics, sys, time
sys.path[:0] = [os.getcwd(), os.path.join(os.getcwd(), "benchmarks")]
import torch
import families, batch as bbatch
import fusec
from fusec import prompt_lookup
from fusec.generation import session
from fusec.fallbacks import FallbackWatch
OUT = os.environ.get("OUT", "/tmp")
KERNELS = sys.argv[1:] == ["kernels"]
rep = open(os.path.join(OUT, "lookup_ab.txt" if KERNELS else "ab.txt"), "w")
def say(*a):
    s = " ".join(str(x) for x in a); print(s, flush=True); rep.write(s + "\n"); rep.flush()
model, label = families.build("llama", "published", "cuda")
bbatch.echo_weights(model, bbatch.ECHO_SCALE)
say(torch.cuda.get_device_name(), label)
prompt = torch.randint(1, model.config.vocab_size, (1, 32), device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
steps = lambda: model._fusec_generate_steps
def timed(fn, before=lambda: None, n=7):
    ts = []
    for _ in range(n):
        before(); torch.cuda.synchronize(); t0 = time.perf_counter(); fn(); torch.cuda.synchronize(); ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3, ts


def lookup_kernels_ab(ref):
    """Prompt lookup with the two kernels against the torch ops (``LookupDecoder._kernels`` None)."""
    orig = prompt_lookup.LookupDecoder._kernels
    for num in (3, 7):
        l = lambda: fusec.generate(model, prompt, 128, eos_token_id=[], prompt_lookup_num_tokens=num)
        for mode in ("kernels", "torch", "kernels", "torch"):
            prompt_lookup.LookupDecoder._kernels = orig if mode == "kernels" else (lambda self: None)
            steps().pop(prompt_lookup.SESSION, None)
            assert torch.equal(l(), ref), (num, mode)
            ms, _ = timed(l)
            st = dict(prompt_lookup.last_stats)
            say(f"lookup N={num} {mode:8s}: {ms:7.2f} ms  {128 / ms * 1e3:6.0f} tok/s  "
                f"{(st['accepted'] + st['steps']) / max(st['steps'], 1):.2f} tok/step  {st}")
    prompt_lookup.LookupDecoder._kernels = orig
    from torch.profiler import profile, ProfilerActivity
    l = lambda: fusec.generate(model, prompt, 128, eos_token_id=[], prompt_lookup_num_tokens=3)
    steps().pop(prompt_lookup.SESSION, None); l()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        l(); torch.cuda.synchronize()
    names = {}
    for e in p.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            names[e.name[:60]] = names.get(e.name[:60], 0) + 1
    say("steps", prompt_lookup.last_stats, "GPU kernels by name:", sorted(names.items(), key=lambda x: -x[1])[:8])


with FallbackWatch() as w:
    g = lambda: fusec.generate(model, prompt, 128, eos_token_id=[])
    ref = g()
    if KERNELS:
        lookup_kernels_ab(ref)
    else:
        for mode in ("kept", "dropped", "kept", "dropped"):
            before = (lambda: steps().pop(session.DECODE, None)) if mode == "dropped" else (lambda: None)
            before(); g()
            ms, ts = timed(g, before)
            say(f"greedy {mode:8s}: {ms:7.1f} ms  {128 / ms * 1e3:6.0f} tok/s  runs {[round(t * 1e3, 1) for t in ts]}")
        assert torch.equal(g(), ref)
        for num in (3, 7):
            l = lambda: fusec.generate(model, prompt, 128, eos_token_id=[], prompt_lookup_num_tokens=num)
            for mode in ("kept", "dropped", "kept", "dropped"):
                before = (lambda: steps().pop(prompt_lookup.SESSION, None)) if mode == "dropped" else (lambda: None)
                before(); l()
                ms, ts = timed(l, before)
                say(f"lookup N={num} {mode:8s}: {ms:7.1f} ms  {128 / ms * 1e3:6.0f} tok/s  {dict(prompt_lookup.last_stats)}")
say("fallbacks", w.fallbacks[:1], "compiled", w.compiled)
