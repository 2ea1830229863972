"""rms_qkv_rope with a per-head q/k norm (Qwen3): each head's rotation pairs split over several
tiles, the head's last tile (an atomic ticket) norming and rotating it, instead of one tile per
whole head (32 tiles of 256 KiB per Qwen3-0.6B layer while 100 SMs waited)."""
from __future__ import annotations

import pytest
import torch

import hf_tiny
from fusec.api import compile_model
from fusec.errors import HazardError


def _qwen3_step(layers=1):
    model = hf_tiny.qwen3(layers=layers, heads=4, kv_heads=2, head_dim=16)
    cache = hf_tiny.static_cache(model, 32)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 128, (1, 5)), past_key_values=cache, use_cache=True)
    return model, ((), {"input_ids": torch.randint(0, 128, (1, 1)), "past_key_values": cache, "use_cache": True})


@pytest.mark.parametrize("num_sms,pieces", [(8, 1), (16, 2), (24, 3), (132, 8)])
def test_heads_split_over_tiles_match_eager(num_sms, pieces):
    """8 heads (4 q, 2 k, 2 v) of 8 rotation pairs on num_sms SMs: pieces per head =
    num_sms // 8, at most head_dim // 2 = 8; the simulator's step (every interleaving it draws checked for
    hazards) matches eager."""
    torch.manual_seed(0)
    model, step = _qwen3_step()
    res = compile_model(model, *step, {"num_sms": num_sms, "simulate": True})
    assert "match eager" in res.simulated and "no hazard" in res.simulated, res.simulated
    tiles = [i.tile for i in res.schedule.instrs if i.kind == "rms_qkv_rope"]
    assert len(tiles) == 8 * pieces
    assert {t.params["pieces"] for t in tiles} == {pieces}


def test_split_heads_need_their_ticket_edges(monkeypatch):
    """The last piece of a q/k head reads the other pieces' pre-norm values with no counter
    wait on them: only the ticket orders it. Without the ticket edges the hazard check fails."""
    from fusec.sim import simulator
    torch.manual_seed(0)
    model, step = _qwen3_step()
    monkeypatch.setattr(simulator, "_ticket_edges", lambda env: {})
    with pytest.raises(HazardError) as e:
        compile_model(model, *step, {"num_sms": 16, "simulate": True})
    assert any(h["buffer"].endswith("_qk_part") for h in e.value.hazards), e.value.hazards
