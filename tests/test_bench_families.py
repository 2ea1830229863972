"""benchmarks/families.py on the CPU: its dry run at full depth (meta device) and its read floor."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import families  # noqa: E402

#: num_hidden_layers of each checkpoint's config.json, written out here again (not read from
#: families.PUBLISHED) so that a wrong depth there fails.
CHECKPOINT_LAYERS = {
    "llama": 16, "smollm2": 32, "qwen3": 28, "qwen2": 24, "gemma": 18, "phi3": 32, "olmo2": 16,
    "gpt_neox": 16, "stablelm": 24, "olmo": 16, "granite": 40, "mistral_sw": 32, "gemma2": 26,
    "gemma3": 26, "falcon": 32, "gpt2": 12, "phi2": 32, "starcoder2": 30,
}
#: a dry-run row: family, "label (N layers)", layers, hidden, heads, vocab, params, read GB, floor ms
ROW = re.compile(r"(\S+) +.*\((\d+) layers\) +(\d+) +\d+ +\d+/\d+ +\d+ +[\d,]+ +([\d.]+) +([\d.]+)  ")


def _dry_run(capsys, *argv: str) -> dict[str, tuple[int, int, float]]:
    """{family: (layers in the label, layers column, floor ms)} of one dry run's printed rows."""
    assert families.main(["--dry-run", *argv]) == 0
    rows = {}
    for line in capsys.readouterr().out.splitlines()[1:]:
        m = ROW.match(line)
        assert m, line
        rows[m[1]] = (int(m[2]), int(m[3]), float(m[5]))
    return rows


def test_published_table_is_the_checkpoints():
    assert {name: pub.layers for name, pub in families.PUBLISHED.items()} == CHECKPOINT_LAYERS


def test_dry_run_full_depth_prints_published_layers_and_floor(capsys):
    rows = _dry_run(capsys, "--layers", "full", "--families", ",".join(CHECKPOINT_LAYERS))
    assert set(rows) == set(CHECKPOINT_LAYERS)
    for name, (label_layers, layers, floor_ms) in rows.items():
        assert label_layers == layers == CHECKPOINT_LAYERS[name], name
        assert floor_ms > 0, name


def test_dry_run_layers_override(capsys):
    rows = _dry_run(capsys, "--layers", "2", "--families", "llama,gpt2,cohere")
    assert {name: r[:2] for name, r in rows.items()} == {n: (2, 2) for n in ("llama", "gpt2", "cohere")}


@pytest.mark.parametrize("text", ["0", "-1", "two", ""])
def test_layers_argument_rejects(text):
    with pytest.raises(SystemExit):
        families.main(["--dry-run", "--layers", text, "--families", "llama"])


def test_cache_must_hold_prefill_and_steps():
    with pytest.raises(SystemExit):
        families.main(["--dry-run", "--prefill", "1000", "--max-cache-len", "1024", "--families", "llama"])


H, INTER, LAYERS, HEADS, KV, HEAD_DIM, VOCAB = 64, 96, 2, 4, 2, 16, 128


def _tiny_llama(tied: bool) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=H, intermediate_size=INTER, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                      num_key_value_heads=KV, head_dim=HEAD_DIM, vocab_size=VOCAB, tie_word_embeddings=tied)
    with torch.device("meta"):
        return LlamaForCausalLM(cfg).to(torch.bfloat16)


@pytest.mark.parametrize("tied", [True, False])
def test_floor_counts_the_embedding(tied):
    """Tied: the table once (the LM head reads all of it); untied: the head's table plus one
    row of the input embedding. Counted from the architecture, bf16 (2 bytes)."""
    model = _tiny_llama(tied)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    layer = (H * HEADS * HEAD_DIM + 2 * H * KV * HEAD_DIM + HEADS * HEAD_DIM * H   # q, k, v, o
             + 3 * H * INTER + 2 * H)                                               # gate, up, down; 2 norms
    body = LAYERS * layer + H                                                       # the final norm
    expected = body + VOCAB * H + (0 if tied else H)
    assert families.step_read_bytes(model) == 2 * expected


def test_floor_reads_one_row_of_learned_positions():
    """GPT-2: the token table is tied to the head (all of it); the position table reads one row."""
    from transformers import GPT2Config, GPT2LMHeadModel
    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=H, n_layer=LAYERS, n_head=HEADS, n_positions=256,
                                           bos_token_id=0, eos_token_id=0))
    every = sum(p.numel() for p in model.parameters())   # shared parameters once
    assert families.step_read_bytes(model) == 4 * (every - 255 * H)
