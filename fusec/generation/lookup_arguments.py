"""The arguments of speculative decoding in ``fusec.generate`` (prompt lookup's
``prompt_lookup_num_tokens``, a draft model's ``assistant_model`` and ``num_assistant_tokens``)
checked, and the drafts per step fitted to a learned position table. The decoding itself:
:mod:`fusec.prompt_lookup`."""
from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger("fusec")

#: drafts per step of a draft model when ``num_assistant_tokens`` is not given (transformers'
#: default, 20 with a schedule that adapts it, is past the K = 8 query tokens a fusec step takes)
ASSISTANT_TOKENS = 4


def check_num(num: Any, sample: bool, name: str = "prompt_lookup_num_tokens") -> int:
    """``num`` (drafts per step, the argument ``name``) checked: an int from 1 to
    ``MAX_QUERY_TOKENS - 1``, greedy only.

    Raises:
        FusecError: naming the argument and its range, or sampling asked with it.
    """
    from fusec.config import MAX_QUERY_TOKENS
    from fusec.errors import FusecError
    if isinstance(num, bool) or not isinstance(num, int) or not 1 <= num < MAX_QUERY_TOKENS:
        raise FusecError(f"fusec.generate: {name}={num!r} must be an int from 1 to "
                         f"{MAX_QUERY_TOKENS - 1} (a step verifies it plus one token, at most "
                         f"{MAX_QUERY_TOKENS} query tokens)")
    if sample:
        raise FusecError(f"fusec.generate: {name.replace('num_assistant_tokens', 'assistant_model')} works "
                         "with greedy decoding only (do_sample=False)")
    return num


def check_assistant(assistant: Any, device: torch.device, vocab: int | None = None) -> None:
    """A draft model for ``fusec.generate(assistant_model=...)`` checked: a Hugging Face causal LM
    (:func:`fusec.generation.arguments.check_model`) on the target's ``device`` whose token
    embedding has at least the target's ``vocab`` rows (it reads every token the target
    generates; a larger one drafts ids past the target's, clamped).

    Raises:
        FusecError: naming what is wrong.
    """
    from fusec.errors import FusecError
    from fusec.generation.arguments import check_model
    try:
        where = check_model(assistant)
    except FusecError as e:
        raise FusecError(str(e).replace("fusec.generate: ", "fusec.generate: assistant_model: ", 1)) from None
    if where != device:
        raise FusecError(f"fusec.generate: assistant_model is on {where}, the model on {device}: put both on one device")
    rows = getattr(assistant.get_input_embeddings(), "num_embeddings", None)
    if isinstance(rows, int) and isinstance(vocab, int) and rows < vocab:
        raise FusecError(f"fusec.generate: assistant_model's embedding has {rows} rows, fewer than the model's "
                         f"vocabulary of {vocab}: the draft model must read every token the model generates "
                         "(a draft with the same tokenizer)")


def position_table_rows(model: torch.nn.Module) -> int | None:
    """Rows of the model's table indexed by the position, or None (RoPE computed from
    ``inv_freq`` and other computed positions take any position): ``config.max_position_embeddings``
    where the model has an ``nn.Embedding`` other than the token embedding with that many rows
    (GPT-2's learned ``wpe``), or that many past its ``offset`` (OPT's learned positions, looked up
    at position + 2), or a 2-D buffer with that many rows (GPT-J's and CodeGen's sinusoidal
    ``embed_positions``, indexed by ``position_ids``)."""
    rows = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if not isinstance(rows, int):
        return None
    try:
        tokens = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        tokens = None
    if any(isinstance(m, torch.nn.Embedding) and m is not tokens
           and m.num_embeddings == rows + getattr(m, "offset", 0) for m in model.modules()):
        return rows
    return rows if any(b.dim() == 2 and b.shape[0] == rows for b in model.buffers()) else None


def fit_position_table(model: torch.nn.Module, limit: int, num: int, name: str = "prompt_lookup_num_tokens") -> int:
    """The drafts per step, at most ``num``, whose verification steps stay inside a learned position
    table: a step at length ``n`` (at most ``limit``, the prompt + max_new_tokens) runs its K = num
    + 1 rows at positions ``n - 1 .. n + num - 1``, past what greedy decoding reads, so that
    ``limit + num`` rows must exist. 0: no drafts fit (generate greedily, one token per step).
    Logs one line when it takes fewer than ``num``."""
    rows = position_table_rows(model)
    if rows is None or limit + num <= rows:
        return num
    fit = max(0, rows - limit)
    log.info("fusec.generate: %s: %d drafts per step -> %d: a step's query rows would pass %s's %d-row "
             "position table (prompt + max_new_tokens = %d)%s", name, num, fit, type(model).__name__, rows, limit,
             "; generating one token per step" if fit == 0 else "")
    return fit
