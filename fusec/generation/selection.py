"""The next token of each sequence from a decode step's last logits, on the device: greedy
``argmax`` or a Gumbel-max sample under temperature, top-k and top-p (HF's logits warpers), and
HF's ``unfinished_sequences`` bookkeeping (:func:`finish`). Plain torch ops, so that a compiled
step can hold them."""
from __future__ import annotations

import torch


def gumbel_(u: torch.Tensor) -> torch.Tensor:
    """Uniform samples in [0, 1) -> standard Gumbel samples ``-log(-log(u))``, in place."""
    return u.clamp_(min=torch.finfo(torch.float32).tiny).log_().neg_().log_().neg_()


def select(logits: torch.Tensor, gumbel: torch.Tensor | None, temperature: float,
            top_k: int | None, top_p: float | None) -> torch.Tensor:
    """The next token of each sequence, int64 ``[B]``, from the last position's logits ``[B, V]``
    (row by row).

    ``gumbel`` None: greedy (``argmax``, first index among equal maxima). Otherwise ``gumbel``
    holds standard Gumbel samples ``[B, V]`` (:func:`gumbel_`) and the token is a sample of
    ``softmax(logits / temperature)`` restricted to the top-k / top-p tokens (HF's
    ``TopKLogitsWarper`` and ``TopPLogitsWarper``, in that order), drawn with the Gumbel-max
    trick: ``argmax(logits / T + gumbel)``.
    """
    if gumbel is None:
        return logits.argmax(-1)
    x = logits.float() / temperature
    if top_k is not None and top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = torch.where(x < kth, float("-inf"), x)
    if top_p is not None and top_p < 1.0:
        sorted_x, idx = torch.sort(x, dim=-1)                       # ascending, as HF
        remove = sorted_x.softmax(-1).cumsum(-1) <= 1.0 - top_p
        remove[..., -1:] = False                                    # keep the best token
        x = x.masked_fill(remove.scatter(-1, idx, remove), float("-inf"))
    return (x + gumbel).argmax(-1)


def finish(nxt: torch.Tensor, unfinished: torch.Tensor, eos: tuple[int, ...], pad: int) -> torch.Tensor:
    """HF's ``unfinished_sequences`` step (``GenerationMixin._sample``) on the device: a sequence
    that has finished gets ``pad`` instead of its token ``nxt`` (int64 ``[B]``), and a sequence
    whose token is one of ``eos`` is finished from now on (``unfinished``, int64 ``[B, 1]``, 1
    while unfinished, updated in place). Returns the tokens, int64 ``[B]``. Plain elementwise
    ops (no ``isin``), so that the compiled step holds them."""
    unf = unfinished.view(-1)
    nxt = nxt * unf + pad * (1 - unf)
    keep = unf
    for e in eos:
        keep = keep * (nxt != e).to(torch.int64)
    unfinished.copy_(keep.view(unfinished.shape))
    return nxt
