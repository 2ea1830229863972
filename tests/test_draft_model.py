"""Speculative decoding with a draft model (issue 32, item 2): ``fusec.generate(...,
assistant_model=draft)`` and HF ``generate(assistant_model=draft, compile_config=fusec)``, on the
CPU simulator. The draft model's steps (2 then 1 query tokens) and the target's K-token
verification step are fusec steps (no fallback), all on the device, and the output equals greedy
decoding's token for token (fusec.prompt_lookup.ModelDrafter)."""
from __future__ import annotations

import pytest
import torch

import fusec
import hf_tiny
from fusec import prompt_lookup
from fusec.errors import FusecError
from fusec.fallbacks import FallbackWatch


def _varied(seed: int, layers: int = 2):
    """A tiny Llama (fp32) whose greedy text varies (its own LM head, not the tied embedding)."""
    m = hf_tiny.llama(seed=seed, layers=layers)
    g = torch.Generator().manual_seed(seed)
    m.lm_head.weight = torch.nn.Parameter(torch.randn(m.lm_head.weight.shape, generator=g) * 0.3)
    m.generation_config.pad_token_id = 0
    return m


def _near(target, noise: float = 0.15, seed: int = 7):
    """A draft that agrees with ``target`` in part: the target's weights, its LM head moved by
    Gaussian noise (some greedy tokens differ, others not)."""
    import copy
    d = copy.deepcopy(target)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        d.lm_head.weight.add_(torch.randn(d.lm_head.weight.shape, generator=g) * noise)
    return d


def _greedy(m, prompt: torch.Tensor, n: int, eos=None) -> torch.Tensor:
    """HF eager greedy search's tokens (``eos`` None: never stop)."""
    with torch.no_grad():
        return m.generate(prompt, max_new_tokens=n, do_sample=False, attention_mask=torch.ones_like(prompt),
                          eos_token_id=eos if eos is not None else [], pad_token_id=0)


def _prompt(seed: int, n: int = 10) -> torch.Tensor:
    return torch.randint(1, 128, (1, n), generator=torch.Generator().manual_seed(seed))


#: options of the tests of the host loop: 8 SMs, no hazard check (the simulator's check of 132
#: SMs each step is the point of the tests at default options, not of these)
FAST = {"num_sms": 8, "check_hazards": False}


@pytest.mark.parametrize("num, options", [(1, FAST), (3, None), (7, FAST)])
def test_a_draft_model_gives_greedys_tokens(num, options, caplog):
    """Target and a draft that agrees with it in part (:func:`_near`): the output equals eager
    greedy search's for 16 new tokens; fusec compiles the K = num + 1
    verification and the draft's 2-token step (its 1-token step too at num > 1, whose drafts
    after the first it makes), no fallback; some drafts are accepted, some rejected. N = 3 with
    the default options (132 SMs, the hazard check every step)."""
    target = _varied(1)
    draft = _near(target)
    prompt = _prompt(3)
    ref = _greedy(target, prompt, 16)
    torch._dynamo.reset()
    with FallbackWatch() as w, caplog.at_level("INFO", logger="fusec"):
        out = fusec.generate(target, prompt, 16, eos_token_id=[], assistant_model=draft, num_assistant_tokens=num,
                             options=options)
    torch._dynamo.reset()
    assert torch.equal(out, ref), (out.tolist(), ref.tolist())
    assert w.compiled == (2 if num == 1 else 3) and not w.fallbacks, (w.compiled, w.fallbacks)
    stats = prompt_lookup.last_stats
    assert any(f"speculative-decoding steps of K = {num + 1}" in r.getMessage() for r in caplog.records)
    assert stats["tokens"] == 16 and 0 < stats["accepted"] < stats["steps"] * num, stats


def test_the_target_as_its_own_draft_accepts_every_draft():
    """The target drafting for itself: every draft is greedy's token, so every step accepts all
    ``num`` of them (up to the output's end), and each step's first draft is the token after a
    second-to-last token fed again (the invariant of ModelDrafter); the output equals greedy's."""
    target = _varied(4)
    prompt = _prompt(5)
    ref = _greedy(target, prompt, 16)
    out = fusec.generate(target, prompt, 16, eos_token_id=[], assistant_model=target, num_assistant_tokens=4,
                         options=FAST)
    assert torch.equal(out, ref)
    stats = prompt_lookup.last_stats
    assert stats == {"steps": 3, "accepted": 12, "tokens": 16}, stats   # 1 + 3 * (4 + 1) tokens


def test_a_draft_model_stops_at_eos_like_greedy():
    """An eos id greedy search meets: the output stops after it, as greedy's does."""
    target = _varied(1)
    prompt = _prompt(3)
    free = _greedy(target, prompt, 30)
    eos = int(free[0, 10 + 11])
    ref = _greedy(target, prompt, 30, eos)
    out = fusec.generate(target, prompt, 30, eos_token_id=eos, assistant_model=_near(target),
                         num_assistant_tokens=3, options=FAST)
    assert torch.equal(out, ref) and out.shape[1] <= 10 + 12


def test_draft_model_argument_errors():
    """Each invalid combination names what is wrong, before any work."""
    target, draft = _varied(1), _varied(2, layers=1)
    prompt = _prompt(3)
    cases = [
        (dict(assistant_model=draft, prompt_lookup_num_tokens=3), "both given"),
        (dict(num_assistant_tokens=3), "num_assistant_tokens without assistant_model"),
        (dict(assistant_model=draft, num_assistant_tokens=8), "num_assistant_tokens=8 must be an int from 1 to 7"),
        (dict(assistant_model=draft, do_sample=True), "assistant_model works with greedy decoding only"),
        (dict(assistant_model=torch.nn.Linear(2, 2)), "assistant_model: Linear has no Hugging Face config"),
        (dict(assistant_model=draft, attention_mask=torch.tensor([[0] + [1] * 9])), "one prompt without padding"),
    ]
    for kw, text in cases:
        with pytest.raises(FusecError, match=text):
            fusec.generate(target, prompt, 8, **kw)


def _cc(options=None):
    from transformers.generation import CompileConfig
    cc = CompileConfig(backend="fusec", options=options)
    cc._compile_all_devices = True   # HF compiles on CUDA only unless told (this machine has no GPU)
    return cc


def _hf_assisted(target, draft, prompt, n: int, caplog, options=None, **kw):
    """(HF generate(assistant_model=draft, compile_config=fusec with ``options``, **kw)'s tokens,
    eager greedy search's, the FallbackWatch of the fusec call), fusec's lines in ``caplog``."""
    ref = target.generate(prompt, max_new_tokens=n, do_sample=False)
    torch._dynamo.reset()
    with FallbackWatch() as w, caplog.at_level("INFO", logger="fusec"):
        out = target.generate(prompt, max_new_tokens=n, do_sample=False, assistant_model=draft,
                              compile_config=_cc(options), **kw)
    return out, ref, w


@pytest.mark.parametrize("cache, options", [("static", None), (None, FAST)])
def test_assistant_model_through_generate_runs_fusecs_speculative_decoding(cache, options, caplog):
    """generate(assistant_model=draft, compile_config=fusec): HF's assisted decoding refuses a
    static cache and runs its plain forward on a dynamic one; through fusec it is
    fusec.generate's speculative decoding (the draft's num_assistant_tokens, as HF reads it:
    its default, 20, taken as 7: steps of 8 query tokens; 3 when set: steps of 4) on either, and
    its tokens equal eager greedy search's. The static cache with the default options, the
    dynamic one with the CompileConfig's options (8 SMs, no hazard check)."""
    target, draft = _varied(1), _varied(2, layers=1)
    prompt = _prompt(7)
    out, ref, w = _hf_assisted(target, draft, prompt, 16, caplog, options, cache_implementation=cache)
    torch._dynamo.reset()
    assert torch.equal(out, ref) and not w.fallbacks and w.compiled == 3, (w.compiled, w.fallbacks)
    assert any("speculative-decoding steps of K = 8" in r.getMessage() for r in caplog.records)
    draft.generation_config.num_assistant_tokens = 3
    caplog.clear()
    with caplog.at_level("INFO", logger="fusec"):
        out = target.generate(prompt, max_new_tokens=16, do_sample=False, assistant_model=draft,
                              cache_implementation=cache, compile_config=_cc(options))
    torch._dynamo.reset()
    assert torch.equal(out, ref)
    assert any("speculative-decoding steps of K = 4" in r.getMessage() for r in caplog.records)


def test_assistant_model_with_sampling_runs_hfs_assisted_decoding(caplog):
    """Sampling with a draft model: HF's own assisted decoding (its dynamic cache, its plain
    forward), one line says why."""
    target, draft = _varied(1), _varied(2, layers=1)
    prompt = _prompt(7)
    with FallbackWatch() as w, caplog.at_level("INFO", logger="fusec"):
        out = target.generate(prompt, max_new_tokens=6, do_sample=True, assistant_model=draft,
                              compile_config=_cc())
    assert out.shape == (1, 16) and not w.compiled
    assert any("assisted decoding runs HF's own, its plain forward (sampling"
               in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_many_steps_in_one_process_each_reach_fusec(monkeypatch):
    """Every (model, K) step compiles on its own code object: with dynamo's graphs per code
    object limited to 2 (its default is 8), three draft sizes are three verification steps and
    the draft's two steps, five graphs; before, they shared ``VerifyStep.forward``'s code and
    the third ran eagerly without a word. Each call compiles what is new, none runs without
    fusec, the tokens are greedy's."""
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 2)
    target = _varied(1)
    draft = _near(target, seed=7)
    prompt = _prompt(3)
    ref = _greedy(target, prompt, 4)
    torch._dynamo.reset()
    for num in (1, 2, 3):
        with FallbackWatch() as w:
            out = fusec.generate(target, prompt, 4, eos_token_id=[], assistant_model=draft, num_assistant_tokens=num,
                                 options=FAST)
        assert torch.equal(out, ref), num
        assert w.compiled == (2 if num == 1 else 2 if num == 2 else 1) and not w.fallbacks, \
            (num, w.compiled, w.fallbacks)
    torch._dynamo.reset()


def test_a_draft_with_a_smaller_vocabulary_is_refused():
    """A draft model whose embedding has fewer rows than the target's vocabulary could not read
    the target's tokens (an index fault mid-generation): refused before any work."""
    target = _varied(1)
    small = hf_tiny.llama(layers=1, vocab=64)
    with pytest.raises(FusecError, match="assistant_model's embedding has 64 rows, fewer than the model's "
                                         "vocabulary of 128"):
        fusec.generate(target, _prompt(3), 8, assistant_model=small)


def test_hfs_own_assisted_decoding_says_nothing_about_the_drafts_generate(caplog):
    """Where HF's own assisted decoding runs (sampling), its draft model's generate() calls, which
    carry the target's compile_config, log no line of their own: one line, for the call made."""
    target, draft = _varied(1), _varied(2, layers=1)
    with caplog.at_level("INFO", logger="fusec"):
        target.generate(_prompt(7), max_new_tokens=4, do_sample=True, assistant_model=draft, compile_config=_cc())
    lines = [r.getMessage() for r in caplog.records if r.name == "fusec"]
    assert len(lines) == 1 and "assisted decoding runs HF's own" in lines[0], lines


def test_prompt_lookup_beside_an_assistant_model_is_prompt_lookup_as_in_hf(caplog):
    """generate(assistant_model=draft, prompt_lookup_num_tokens=2): HF's candidate generator
    takes prompt lookup before a draft model, and so does fusec (steps of K = 3, drafts from the
    text); the tokens are greedy's. After it, a call without drafts leaves no stats of it."""
    target, draft = _varied(1), _varied(2, layers=1)
    prompt = _prompt(7)
    out, ref, w = _hf_assisted(target, draft, prompt, 8, caplog, prompt_lookup_num_tokens=2)
    assert torch.equal(out, ref) and not w.fallbacks and w.compiled == 1, (w.compiled, w.fallbacks)
    lines = [r.getMessage() for r in caplog.records]
    assert any("prompt-lookup steps of K = 3" in m for m in lines), lines
    assert not any("speculative-decoding" in m for m in lines), lines
    assert prompt_lookup.last_stats["tokens"] == 8
    fusec.generate(target, prompt, 2, eos_token_id=[])
    torch._dynamo.reset()
    assert prompt_lookup.last_stats == {}
