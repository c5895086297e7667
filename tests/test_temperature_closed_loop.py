"""The temperature law in closed loop with the real default model (transformers, real logits).

Each step: entropy of softmax(z / T) from the model's real next-token logits, sample a token
from that distribution, feed it back, update T by the law. The corrected sign settles inside
its bounds; the paper's printed sign (positive feedback) runs to a clip bound and stays there.
"""
import torch

from controller.laws.temperature import PAPER_SIGN, TemperatureLaw, next_temperature
from kernels.entropy import exact_entropy

T_MIN, T_MAX = 0.05, 5.0


def closed_loop(hf_model, law: TemperatureLaw, steps: int = 120, seed: int = 0):
    model, tokenizer = hf_model
    generator = torch.Generator().manual_seed(seed)
    ids = tokenizer("Once upon a time, in a small village by the sea,", return_tensors="pt").input_ids
    past, t, temps, entropies = None, 1.0, [], []
    with torch.no_grad():
        for _ in range(steps):
            out = model(ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            scaled = out.logits[0, -1].float() / t
            h = float(exact_entropy(scaled.unsqueeze(0))[0])
            temps.append(t)
            entropies.append(h)
            token = torch.multinomial(torch.softmax(scaled, -1), 1, generator=generator)
            ids = token.view(1, 1)
            t = next_temperature(t, h, law)
    return temps, entropies


def test_paper_sign_runs_away_to_a_clip_bound(hf_model):
    law = TemperatureLaw(target_entropy=2.0, eta=0.3, t_min=T_MIN, t_max=T_MAX, sign=PAPER_SIGN)
    temps, _ = closed_loop(hf_model, law)
    tail = temps[-30:]
    assert all(t == T_MIN for t in tail) or all(t == T_MAX for t in tail), tail


def test_corrected_sign_stays_inside_its_bounds_near_target(hf_model):
    law = TemperatureLaw(target_entropy=2.0, eta=0.3, t_min=T_MIN, t_max=T_MAX)
    temps, entropies = closed_loop(hf_model, law)
    assert all(T_MIN < t < T_MAX for t in temps[20:])
    after_warmup = entropies[20:]
    assert abs(sum(after_warmup) / len(after_warmup) - 2.0) < 0.15
