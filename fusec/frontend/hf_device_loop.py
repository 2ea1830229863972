"""HF ``generate()``'s greedy search through fusec as :func:`fusec.generate`'s device loop.

With ``compile_config=CompileConfig(backend="fusec")`` transformers runs generate()'s decode loop
in Python: per new token ``prepare_inputs_for_generation``, the compiled decode call, the logits
processors, the argmax, the stopping criteria and a ``torch.cat`` of the tokens so far. That host
work took 2.8 ms per token on the H200 machine against a 0.87 ms step (docs/measurements.md: HF
generate() through fusec 359 tokens/s, :func:`fusec.generate` 1013), so the GPU waited on Python.

:func:`install` wraps ``GenerationMixin._sample``, the decoding method transformers picks for
greedy search and sampling (transformers 5.x ``GENERATION_MODES_MAPPING``). A call that
:func:`refusal` accepts runs :func:`fusec.generate` instead of the loop: the prefill, then every
token a fusec step that selects the next token on the device, the steps replayed from a CUDA
graph in chunks, the host told the tokens one chunk behind (no sync per token). Its tokens are
greedy search's, with HF's end-of-sequence handling (``tests/test_generate_batch.py`` and this
module's tests compare them with eager generate() token for token). What it takes is what
fusec.generate does the same as HF's loop for: greedy search (sampling keeps HF's loop, whose
``torch.multinomial`` draws the same tokens as eager generate() for the same seed; fusec.generate
samples by Gumbel-max), no logits processor, stopping at ``max_length`` and the eos ids only, the
tokens returned as a tensor, 1 to 16 prompts with generate()'s own mask and positions, a cache
generate() made itself (one the caller passed must be filled: HF's loop does that), a model
class without its own ``prepare_inputs_for_generation`` (Phi-3's re-prefills at LongRoPE's
switch, BLOOM's pads the mask for ALiBi: fusec.generate calls neither), no
``prefill_chunk_size``, and arguments fusec.generate's own checks take (checked before any work;
an error after that, such as a step's ``IndexFaultError``, is the call's). Anything else, or the
option ``generate_loop="hf"``, runs HF's loop, which calls the compiled step per token
(:class:`fusec.frontend.hf_generate.HFDecodeCall`); why is logged once per model and reason.
Unlike HF's loop, a streamer gets the new tokens in chunks (16 steps), not one by one. HF has
made its own static cache by the time ``_sample`` runs; fusec.generate makes another (HF keeps
its own for the next call).

Prompt lookup (``generate(prompt_lookup_num_tokens=N)``) takes ``_assisted_decoding``, which
refuses a static cache and calls the plain forward on a dynamic one: with a fusec
``compile_config`` it runs as :func:`fusec.generate`'s prompt lookup (steps of N + 1 query tokens,
drafts accepted on the device) for one prompt without padding, greedy, transformers' default
2-gram matching; its tokens are greedy search's. With an ``assistant_model`` (and no
``assistant_tokenizer``) it runs as :func:`fusec.generate`'s speculative decoding with that
draft model (the draft's ``num_assistant_tokens`` drafts per step, at most 7), its tokens greedy search's too.
"""
from __future__ import annotations

import functools
import logging
from typing import Any

import torch

log = logging.getLogger("fusec")

#: generate()'s model keyword arguments the device loop takes (the values generate() makes:
#: checked in :func:`refusal`); any other (``inputs_embeds``, ``token_type_ids``, a vision
#: model's pixels, ...) keeps HF's loop
MODEL_KWARGS = frozenset({"attention_mask", "position_ids", "logits_to_keep", "past_key_values", "use_cache",
                          "cache_position", "output_attentions", "output_hidden_states", "return_dict"})


class _AfterPrompt:
    """A streamer that forwards everything but the first ``put`` (generate() put the prompt
    before its decoding method; :func:`fusec.generate` puts it again)."""

    def __init__(self, streamer: Any):
        self.streamer, self.seen_prompt = streamer, False

    def put(self, value: Any) -> None:
        if not self.seen_prompt:
            self.seen_prompt = True
            return
        self.streamer.put(value)

    def end(self) -> None:
        self.streamer.end()


def _compile_options(generation_config: Any) -> dict[str, Any] | None:
    """fusec's options from generate()'s ``compile_config`` (None: not a fusec config)."""
    from fusec.frontend.hf_generate import is_fusec_backend
    cc = getattr(generation_config, "compile_config", None)
    if cc is None or not is_fusec_backend(getattr(cc, "backend", None)):
        return None
    return dict(cc.options or {})


def refusal(model: Any, input_ids: torch.Tensor, logits_processor: Any, stopping_criteria: Any,
            generation_config: Any, synced_gpus: bool, model_kwargs: dict[str, Any],
            lookup: bool = False, assistant: Any = None) -> str | None:
    """Why this ``_sample`` call (``lookup``: this ``_assisted_decoding`` call) keeps HF's loop,
    or None when :func:`fusec.generate` runs it.

    Args: ``GenerationMixin._sample``'s (``input_ids`` int64 ``[B, T]``, the prepared
    ``LogitsProcessorList`` and ``StoppingCriteriaList``, the merged ``GenerationConfig``,
    ``model_kwargs`` as generate() made them). Reads the mask and positions (one host sync).
    ``lookup``: prompt lookup (``prompt_lookup_num_tokens``), which fusec.generate takes for one
    prompt without padding, greedy, with transformers' default n-gram size; HF's own assisted
    decoding needs a dynamic cache and runs the plain forward, so here any cache generate() made
    will do (fusec.generate makes its own static one). ``assistant``: with ``lookup``, the draft
    model of assisted decoding (``assistant_model``), whose drafts fusec.generate's speculative
    decoding makes instead of prompt lookup's."""
    from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

    from fusec.generation.arguments import MAX_BATCH
    from fusec.generation.batch import positions
    if generation_config.compile_config.dynamic is not None:
        return "CompileConfig(dynamic=...) set (HF's compiled call, as asked)"
    if generation_config.do_sample:
        return "sampling (HF's loop draws eager generate()'s tokens for the same seed)"
    if len(logits_processor):
        return "logits processors " + ", ".join(sorted({type(p).__name__ for p in logits_processor}))
    kinds = {type(c) for c in stopping_criteria}
    if not kinds <= {MaxLengthCriteria, EosTokenCriteria} or MaxLengthCriteria not in kinds:
        return "stopping criteria " + ", ".join(sorted(k.__name__ for k in kinds))
    if generation_config.return_dict_in_generate:
        return "return_dict_in_generate"
    if synced_gpus or getattr(generation_config, "is_assistant", False) or model.config.is_encoder_decoder:
        return "synced GPUs, an assistant model or an encoder-decoder model"
    own = _own_generation_hooks(model)
    if own:
        return f"{type(model).__name__} has its own {', '.join(own)} (fusec.generate does not call it)"
    if getattr(generation_config, "prefill_chunk_size", None):
        return "prefill_chunk_size (fusec.generate prefills in one call)"
    other = sorted(set(model_kwargs) - MODEL_KWARGS)
    if other:
        return "model arguments " + ", ".join(other)
    if model_kwargs.get("output_attentions") or model_kwargs.get("output_hidden_states") \
            or model_kwargs.get("return_dict") is False:
        return "output_attentions, output_hidden_states or return_dict=False"
    if lookup:
        why = _lookup_refusal(model, generation_config, model_kwargs, assistant)
        if why:
            return why
    elif not model._valid_auto_compile_criteria(model_kwargs, generation_config):
        cc = getattr(generation_config, "compile_config", None)
        if cc is not None and not getattr(cc, "_compile_all_devices", False) and model.device.type != "cuda":
            return (f"{NO_COMPILE_ON_DEVICE} and the model is on {model.device.type}: set "
                    "compile_config._compile_all_devices = True to run fusec's simulator there")
        cache = model_kwargs.get("past_key_values")
        if not getattr(generation_config, "disable_compile", False) and not getattr(cache, "is_compileable", False):
            return (f"{NO_COMPILE_WITHOUT_STATIC} ({type(cache).__name__ if cache is not None else 'no cache'}): "
                    "pass cache_implementation='static' to generate()")
        return "generate() would not compile this call (compilation disabled)"
    if getattr(model_kwargs.get("past_key_values"), "_is_user_defined", False):
        return "a cache the caller passed (generate() must fill it)"
    rows, length = input_ids.shape
    drafts = "a draft model" if assistant is not None else "prompt lookup"
    if not 1 <= rows <= (1 if lookup else MAX_BATCH):
        return f"a batch of {rows} sequences (at most {1 if lookup else MAX_BATCH}" + \
            (f" with {drafts})" if lookup else ")")
    if _max_new_tokens(stopping_criteria, length) < 1:
        return "no new token to generate"
    if model_kwargs.get("cache_position") is not None:
        return "cache_position"
    mask = model_kwargs.get("attention_mask")
    if mask is not None and mask.shape != input_ids.shape:
        return f"an attention mask of shape {tuple(mask.shape)} for input_ids {tuple(input_ids.shape)}"
    if lookup and mask is not None and not bool(mask.all()):
        return f"{drafts} with a padded prompt"
    pos = model_kwargs.get("position_ids")
    if pos is not None:
        made = positions(mask.long()) if mask is not None else torch.arange(length, device=pos.device).expand(rows, -1)
        if pos.shape != made.shape or not torch.equal(pos.to(made.device), made):
            return "position_ids other than generate()'s own"
    return None


def _lookup_refusal(model: Any, generation_config: Any, model_kwargs: dict[str, Any],
                    assistant: Any = None) -> str | None:
    """What of a prompt-lookup call (``assistant``: of assisted decoding with that draft model)
    fusec.generate does not do as HF would, or None: a compile HF would not make, transformers'
    other n-gram sizes, an ensemble weight or ``use_cache=False`` (HF refuses both), a
    sliding-window model (the target or the draft)."""
    cc = generation_config.compile_config
    if getattr(generation_config, "disable_compile", False):
        return "disable_compile"
    if not (model.device.type == "cuda" or getattr(cc, "_compile_all_devices", False)):
        return "generate() compiles on a GPU only (compile_config._compile_all_devices for another device)"
    quantizer, devices = getattr(model, "hf_quantizer", None), set(getattr(model, "hf_device_map", {}).values())
    if (quantizer is not None and not quantizer.is_compileable) or "disk" in devices \
            or ("cpu" in devices and len(devices) > 1):
        return "a quantization or an offload generate() does not compile"
    if assistant is None and generation_config.max_matching_ngram_size not in (None, 0, 2):   # HF: `or 2`
        return f"max_matching_ngram_size={generation_config.max_matching_ngram_size} (fusec drafts from 2-grams)"
    if getattr(generation_config, "assistant_ensemble_weight", None) is not None:
        return "assistant_ensemble_weight (HF refuses it with prompt lookup)"
    if not model_kwargs.get("use_cache", True):
        return "use_cache=False (HF's assisted decoding refuses it)"
    if _sliding(model.config) or (assistant is not None and _sliding(getattr(assistant, "config", None))):
        return "a sliding-window model (fusec's prompt lookup and draft steps count positions on the device)"
    return None


#: the methods generate()'s loop calls that a model class may override (Phi-3's drops the cache
#: when LongRoPE switches factors and prefills again; BLOOM's pads the mask to the cache for ALiBi):
#: fusec.generate calls none of them, so a model with its own keeps HF's loop
GENERATION_HOOKS = ("prepare_inputs_for_generation", "_update_model_kwargs_for_generation", "_prefill")


def _own_generation_hooks(model: Any) -> list[str]:
    """The :data:`GENERATION_HOOKS` that ``model``'s class overrides."""
    from transformers.generation.utils import GenerationMixin
    return [name for name in GENERATION_HOOKS
            if getattr(type(model), name, None) is not getattr(GenerationMixin, name, None)]


def _sliding(config: Any) -> bool:
    """Whether transformers' ``StaticCache`` for ``config`` has sliding-window (or chunked)
    layers, whose positions HF counts in Python (its rule: ``layer_types`` where the config has
    them, else a set ``sliding_window`` or ``attention_chunk_size``)."""
    types = getattr(config, "layer_types", None)
    if types:
        return any(t in ("sliding_attention", "chunked_attention") for t in types)
    return getattr(config, "sliding_window", None) is not None or getattr(config, "attention_chunk_size", None) is not None


def _max_new_tokens(stopping_criteria: Any, prompt_len: int) -> int:
    from transformers.generation.stopping_criteria import MaxLengthCriteria
    return min(c.max_length for c in stopping_criteria if isinstance(c, MaxLengthCriteria)) - prompt_len


def _eos(stopping_criteria: Any) -> list[int]:
    from transformers.generation.stopping_criteria import EosTokenCriteria
    ids: list[int] = []
    for c in stopping_criteria:
        if isinstance(c, EosTokenCriteria):
            ids += torch.as_tensor(c.eos_token_id).flatten().tolist()
    return ids


#: what HF's assisted decoding says of a static cache (transformers' generate(), 5.x)
_HF_STATIC_REFUSAL = "assisted generate is not supported with Static cache classes"


def _static_cache(generation_config: Any, model_kwargs: dict[str, Any]) -> bool:
    """Whether generate() asked for a static cache (``cache_implementation="static"`` or a
    ``StaticCache`` passed), which HF's assisted decoding refuses with a ValueError."""
    from transformers import StaticCache
    return getattr(generation_config, "cache_implementation", None) == "static" or \
        isinstance(model_kwargs.get("past_key_values"), StaticCache)


#: the start of the reason given where generate() compiles nothing because of the model's device:
#: a warning (fusec, which the caller asked for, runs nowhere in the call, and HF's own line does
#: not say why), not an info line
NO_COMPILE_ON_DEVICE = "generate() compiles only on a CUDA device"
#: the same where the cache is not a static one (generate()'s default is a DynamicCache)
NO_COMPILE_WITHOUT_STATIC = "generate() compiles only over a static cache"


def _tell(model: Any, why: str, asked: bool = False, lookup: bool = False, assistant: bool = False,
          static: bool = False) -> None:
    """One info line per model and reason (a warning where the device keeps generate() from
    compiling at all, :data:`NO_COMPILE_ON_DEVICE`, or its cache, :data:`NO_COMPILE_WITHOUT_STATIC`; ``asked``: the user chose HF's loop; ``lookup``: of
    prompt lookup, which HF runs as assisted decoding; ``assistant``: of assisted decoding with a
    draft model). ``static`` (with ``lookup`` or ``assistant``: the call asked for a static cache,
    which HF's assisted decoding refuses with its own error next): a warning that says so, since
    HF's message does not name the reason fusec did not take the call."""
    told = model.__dict__.setdefault("_fusec_loop_told", set())
    key = ("assistant: " if assistant else "lookup: " if lookup else "") + why
    if key in told and not static:
        return
    told.add(key)
    if static and (assistant or lookup):
        log.warning("fusec: generate()'s %s is not fusec's here (%s), and HF's own assisted decoding refuses a "
                    "static cache (it raises %r next): drop cache_implementation='static' for HF's, or use "
                    "fusec.generate where it takes the model", "assisted decoding" if assistant else "prompt lookup",
                    why, _HF_STATIC_REFUSAL)
    elif assistant:
        log.info("fusec: generate()'s assisted decoding runs HF's own, its plain forward (%s); with an "
                 "assistant_model, one greedy prompt without padding runs as fusec.generate's speculative decoding",
                 why)
    elif lookup:
        log.info("fusec: generate()'s prompt lookup runs as HF's assisted decoding, its plain forward (%s); one "
                 "greedy prompt without padding runs as fusec.generate's prompt lookup", why)
    elif why.startswith((NO_COMPILE_ON_DEVICE, NO_COMPILE_WITHOUT_STATIC)):
        log.warning("fusec: generate() runs HF's decode loop uncompiled: fusec does not run (%s)", why)
    else:
        log.info("fusec: generate() runs HF's decode loop (%s)%s", why,
                 "" if asked else "; where it compiles, greedy search without logits processors runs as "
                 "fusec.generate's device loop")


def run(model: Any, input_ids: torch.Tensor, stopping_criteria: Any, generation_config: Any, streamer: Any,
        model_kwargs: dict[str, Any], options: dict[str, Any], lookup: int | None = None,
        assistant: Any = None) -> torch.Tensor:
    """The tokens of greedy search (int64 ``[B, T + n]``, as ``_sample`` returns them) by
    :func:`fusec.generate` (``lookup`` N: with ``prompt_lookup_num_tokens=N``, or with a draft
    model ``assistant``, ``assistant_model=assistant, num_assistant_tokens=N``). Its errors
    propagate: :func:`arguments_refusal` has checked its arguments."""
    import fusec
    pad = generation_config._pad_token_tensor
    try:
        return fusec.generate(model, input_ids, _max_new_tokens(stopping_criteria, input_ids.shape[1]),
                              attention_mask=model_kwargs.get("attention_mask"), eos_token_id=_eos(stopping_criteria),
                              pad_token_id=None if pad is None else int(pad),
                              streamer=_AfterPrompt(streamer) if streamer is not None else None,
                              options=step_options(options), **_drafts(lookup, assistant))
    except BaseException:
        if streamer is not None:   # a consumer thread waits for the end (fusec.generate ends it on success)
            streamer.end()
        raise


def _drafts(lookup: int | None, assistant: Any) -> dict[str, Any]:
    """:func:`fusec.generate`'s arguments for ``lookup`` drafts per step, by prompt lookup or by
    the draft model ``assistant``."""
    if assistant is None:
        return {"prompt_lookup_num_tokens": lookup}
    return {"assistant_model": assistant, "num_assistant_tokens": lookup}


def step_options(options: dict[str, Any]) -> dict[str, Any]:
    """fusec.generate's options from a ``CompileConfig``'s: less ``generate_loop`` (HF's loop or
    not) and ``mode`` (fusec.generate replays its chunks from a CUDA graph either way)."""
    return {k: v for k, v in options.items() if k not in ("generate_loop", "mode")}


def arguments_refusal(model: Any, input_ids: torch.Tensor, stopping_criteria: Any, generation_config: Any,
                      streamer: Any, model_kwargs: dict[str, Any], options: dict[str, Any],
                      lookup: int | None, assistant: Any = None) -> str | None:
    """What :func:`fusec.generate` would refuse in these arguments before any work (its own
    checks, run here: a ``FusecError`` raised later, e.g. by a step, is the call's error), as a
    reason, or None."""
    from fusec.config import Options
    from fusec.errors import FusecError
    from fusec.generation.arguments import check_args, check_model
    try:
        device = check_model(model)
        pad = generation_config._pad_token_tensor
        check_args(input_ids, model_kwargs.get("attention_mask"), _max_new_tokens(stopping_criteria, input_ids.shape[1]),
                   False, 1.0, None, None, None if pad is None else int(pad), streamer, None,
                   step_options(options), device)
        Options.from_dict({"check_watchdog": False, **step_options(options)})
        if lookup is not None:
            from fusec.generation import lookup_arguments
            if assistant is None:
                lookup_arguments.check_num(lookup, False)
            else:
                lookup_arguments.check_num(lookup, False, "num_assistant_tokens")
                lookup_arguments.check_assistant(assistant, device, model.config.vocab_size)
    except FusecError as e:
        return f"fusec.generate refuses it: {str(e).splitlines()[0]}"
    return None


def _on_the_device(model: Any, input_ids: torch.Tensor, logits_processor: Any, stopping_criteria: Any,
                   generation_config: Any, synced_gpus: bool, streamer: Any, model_kwargs: dict[str, Any],
                   lookup: int | None = None, assistant: Any = None) -> torch.Tensor | None:
    """The tokens by :func:`run` where generate()'s ``compile_config`` is fusec's and neither its
    option ``generate_loop="hf"`` nor :func:`refusal` keeps HF's loop; else None (a fusec config:
    one line says why). ``lookup``: drafts per step (prompt lookup's, or ``assistant``'s)."""
    options = _compile_options(generation_config)
    if options is None or getattr(generation_config, "is_assistant", False):
        return None   # not fusec's; or the draft model's own generate() inside HF's assisted decoding
    from fusec.config import Options
    from fusec.errors import FusecError
    try:
        loop = Options.from_dict(options).generate_loop
    except FusecError:
        if streamer is not None:   # generate() put the prompt: a consumer thread waits for end()
            streamer.end()
        raise
    drafts = assistant is not None
    if loop == "hf":
        _tell(model, "the option generate_loop='hf'", asked=lookup is None, lookup=lookup is not None,
              assistant=drafts)
        return None
    why = refusal(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus,
                  model_kwargs, lookup=lookup is not None, assistant=assistant) or \
        arguments_refusal(model, input_ids, stopping_criteria, generation_config, streamer, model_kwargs, options,
                          lookup, assistant)
    if why is not None:
        _tell(model, why, lookup=lookup is not None, assistant=drafts,
              static=(lookup is not None or drafts) and _static_cache(generation_config, model_kwargs))
        return None
    return run(model, input_ids, stopping_criteria, generation_config, streamer, model_kwargs, options, lookup,
               assistant)


@functools.cache   # once per process
def install() -> None:
    """Wrap ``transformers.generation.utils.GenerationMixin._sample`` and ``_assisted_decoding``
    (:func:`_assisted`; idempotent, :func:`fusec.frontend.hf_patch.wrap_once`; a no-op without
    transformers): a greedy call with a fusec ``compile_config`` that :func:`refusal` accepts
    runs :func:`run`; every other call is HF's."""
    try:
        from transformers.generation.utils import GenerationMixin
    except Exception:   # noqa: BLE001 - no transformers (or a broken one): nothing to wrap
        return
    from fusec.frontend.hf_patch import wrap_once

    def make(original: Any) -> Any:
        def _sample(self: Any, input_ids: torch.Tensor, logits_processor: Any, stopping_criteria: Any,
                    generation_config: Any, synced_gpus: bool = False, streamer: Any = None,
                    **model_kwargs: Any) -> Any:
            out = _on_the_device(self, input_ids, logits_processor, stopping_criteria, generation_config,
                                 synced_gpus, streamer, model_kwargs)
            if out is not None:
                return out
            return original(self, input_ids, logits_processor, stopping_criteria, generation_config,
                            synced_gpus=synced_gpus, streamer=streamer, **model_kwargs)
        return _sample
    wrap_once(GenerationMixin, "_sample", make)
    wrap_once(GenerationMixin, "_assisted_decoding", _assisted)


def _assistant_tokens(generation_config: Any, assistant: Any) -> int:
    """Drafts per step for a draft model: its own generation config's ``num_assistant_tokens``,
    as transformers' ``AssistedCandidateGenerator`` reads it (else generate()'s; transformers'
    default 20, which its schedule adapts: the tokens do not depend on it), at most
    ``MAX_QUERY_TOKENS - 1``, the most a fusec verification step takes."""
    from fusec.config import MAX_QUERY_TOKENS
    from fusec.generation.lookup_arguments import ASSISTANT_TOKENS
    num = getattr(getattr(assistant, "generation_config", None), "num_assistant_tokens", None)
    if num is None:
        num = getattr(generation_config, "num_assistant_tokens", None)
    return min(int(num), MAX_QUERY_TOKENS - 1) if isinstance(num, int) and num >= 1 else ASSISTANT_TOKENS


def _assisted(original: Any) -> Any:
    """The wrapper of ``GenerationMixin._assisted_decoding`` (``original``): prompt lookup
    (``prompt_lookup_num_tokens``, beside an ``assistant_model`` too: HF's precedence) with a
    fusec ``compile_config`` that :func:`refusal` accepts runs :func:`run` with fusec.generate's
    prompt lookup (K = N + 1 query tokens per step, drafts accepted on the device); an
    ``assistant_model`` (with the target's tokenizer: no ``assistant_tokenizer``; not a kind HF
    drafts with in its own way) runs fusec.generate's speculative decoding with it; every other
    call is HF's (which refuses a static cache)."""

    def _assisted_decoding(self: Any, input_ids: torch.Tensor, logits_processor: Any, stopping_criteria: Any,
                           generation_config: Any, synced_gpus: bool = False, streamer: Any = None,
                           inputs_tensor: Any = None, assistant_model: Any = None, assistant_tokenizer: Any = None,
                           tokenizer: Any = None, **model_kwargs: Any) -> Any:
        # HF's precedence (GenerationMixin._get_candidate_generator): early exit, then prompt lookup
        # (even beside an assistant model), then multi-token prediction, then the draft models
        num = getattr(generation_config, "prompt_lookup_num_tokens", None)
        early_exit = getattr(generation_config, "assistant_early_exit", None) is not None
        mtp = getattr(generation_config, "use_mtp", False)
        own_kind = assistant_model is not None and (
            type(assistant_model).__name__.startswith(("Gemma4Assistant", "Gemma4UnifiedAssistant"))
            or getattr(generation_config, "speculation_type", None) == "dflash")
        out = None
        why = None
        if not early_exit and num is not None:
            out = _on_the_device(self, input_ids, logits_processor, stopping_criteria, generation_config,
                                 synced_gpus, streamer, model_kwargs, lookup=int(num))
        elif early_exit or mtp:
            why = "assistant_early_exit or use_mtp (the model drafts for itself)"
        elif own_kind:
            why = "a draft model of its own kind (Gemma-4's assistant, DFlash), which HF's own drafting serves"
        elif assistant_model is not None and assistant_tokenizer is None:
            out = _on_the_device(self, input_ids, logits_processor, stopping_criteria, generation_config,
                                 synced_gpus, streamer, model_kwargs,
                                 lookup=_assistant_tokens(generation_config, assistant_model), assistant=assistant_model)
        elif assistant_tokenizer is not None:
            why = "assistant_tokenizer (a draft model with its own tokenizer)"
        if why is not None and _compile_options(generation_config) is not None \
                and not getattr(generation_config, "is_assistant", False):
            _tell(self, why, lookup=True, assistant=True, static=_static_cache(generation_config, model_kwargs))
        if out is not None:
            return out
        return original(self, input_ids, logits_processor, stopping_criteria, generation_config,
                        synced_gpus=synced_gpus, streamer=streamer, inputs_tensor=inputs_tensor,
                        assistant_model=assistant_model, assistant_tokenizer=assistant_tokenizer,
                        tokenizer=tokenizer, **model_kwargs)

    return _assisted_decoding
