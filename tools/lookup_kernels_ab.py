"""Usage (GPU machine, repository root): python3 tools/lookup_kernels_ab.py; writes $OUT/lookup_ab.txt.
Prompt lookup's bookkeeping: two CUDA kernels (fusec/runtime/lookup_kernels.py) against the torch
ops, one process, alternating, Llama-3.2-1B published widths bf16 echo weights, 32-token prompt,
128 new tokens, kept session recaptured per mode, median of 7 after one untimed."""
import os, statistics, sys, time
sys.path[:0] = [os.getcwd(), os.path.join(os.getcwd(), "benchmarks")]
import torch
import families, batch as bbatch
import fusec
from fusec import prompt_lookup
from fusec.fallbacks import FallbackWatch
OUT = os.environ.get("OUT", "/tmp")
rep = open(os.path.join(OUT, "lookup_ab.txt"), "w")
def say(*a):
    s = " ".join(str(x) for x in a); print(s, flush=True); rep.write(s + "\n"); rep.flush()
model, label = families.build("llama", "published", "cuda")
bbatch.echo_weights(model, bbatch.ECHO_SCALE)
say(torch.cuda.get_device_name(), label)
prompt = torch.randint(1, model.config.vocab_size, (1, 32), device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
orig = prompt_lookup.LookupDecoder._kernels
def timed(fn, n=7):
    ts = []
    for _ in range(n):
        torch.cuda.synchronize(); t0 = time.perf_counter(); fn(); torch.cuda.synchronize(); ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3, ts
with FallbackWatch() as w:
    ref = fusec.generate(model, prompt, 128, eos_token_id=[])
    for num in (3, 7):
        l = lambda: fusec.generate(model, prompt, 128, eos_token_id=[], prompt_lookup_num_tokens=num)
        for mode in ("kernels", "torch", "kernels", "torch"):
            prompt_lookup.LookupDecoder._kernels = orig if mode == "kernels" else (lambda self: None)
            model._fusec_generate_steps.pop(prompt_lookup.SESSION, None)
            out = l()
            assert torch.equal(out, ref), (num, mode)
            ms, ts = timed(l)
            st = dict(prompt_lookup.last_stats)
            say(f"lookup N={num} {mode:8s}: {ms:7.2f} ms  {128 / ms * 1e3:6.0f} tok/s  "
                f"{(st['accepted'] + st['steps']) / max(st['steps'], 1):.2f} tok/step  {ms / max(st['steps'], 1) * 1e3:6.0f} us/step  {st}")
    prompt_lookup.LookupDecoder._kernels = orig
    # kernels per step under the profiler (kernels mode)
    from torch.profiler import profile, ProfilerActivity
    l = lambda: fusec.generate(model, prompt, 128, eos_token_id=[], prompt_lookup_num_tokens=3)
    model._fusec_generate_steps.pop(prompt_lookup.SESSION, None); l()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        l(); torch.cuda.synchronize()
    names = {}
    for e in p.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            names[e.name[:60]] = names.get(e.name[:60], 0) + 1
    say("steps", prompt_lookup.last_stats, "GPU kernels by name:", sorted(names.items(), key=lambda x: -x[1])[:8])
say("fallbacks", w.fallbacks[:1], "compiled", w.compiled)
