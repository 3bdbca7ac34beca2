"""The probe on a plain torch.optim.AdamW model through the train_step wrapper.

Used by tests/fullscale/test_megatron_probe_plain.py and by the python 3.8 + torch 2.1 CI
job (.ci/py38.sh), where only torch and numpy are installed:

    python tests/compat/probe_adamw.py OUT [--steps N] [--plain] [--skip STEP]

A Megatron-shaped toy (embedding, 2 blocks with fused qkv / fc1 names, final norm,
output layer) trains on seeded random tokens; `train_step` has Megatron's signature and
return value (loss dict, skipped_iter, ...) and is wrapped exactly as install() wraps
Megatron's. `--skip STEP` makes that step skip the optimizer (a loss-scale overflow).
Writes OUT/run (the run directory) and OUT/reference.json (per step and tensor, the
metrics computed here with numpy from the full state and the true m_{t-1}).
"""

import argparse
import json
import math
import os
import sys
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from adamspike.metrics import reference_metrics  # noqa: E402
from fullscale.megatron_probe import MegatronProbe, make_train_step_wrapper  # noqa: E402


class Block(torch.nn.Module):
    def __init__(self, d, n):
        super().__init__()
        self.layer_number = n
        self.input_layernorm = torch.nn.LayerNorm(d, bias=False) if _ln_bias() else torch.nn.LayerNorm(d)
        self.self_attention = torch.nn.Module()
        self.self_attention.linear_qkv = torch.nn.Linear(d, 3 * d, bias=False)
        self.self_attention.linear_proj = torch.nn.Linear(d, d, bias=False)
        self.mlp = torch.nn.Module()
        self.mlp.linear_fc1 = torch.nn.Linear(d, 4 * d, bias=False)
        self.mlp.linear_fc2 = torch.nn.Linear(2 * d, d, bias=False)

    def forward(self, x):
        h = self.input_layernorm(x)
        q, k, v = self.self_attention.linear_qkv(h).chunk(3, -1)
        a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1) @ v
        x = x + self.self_attention.linear_proj(a)
        g, u = self.mlp.linear_fc1(x).chunk(2, -1)
        return x + self.mlp.linear_fc2(torch.nn.functional.silu(g) * u)


def _ln_bias():
    import inspect
    return "bias" in inspect.signature(torch.nn.LayerNorm).parameters


class Toy(torch.nn.Module):
    def __init__(self, vocab=32, d=16, layers=2):
        super().__init__()
        self.embedding = torch.nn.Module()
        self.embedding.word_embeddings = torch.nn.Embedding(vocab, d)
        self.decoder = torch.nn.Module()
        self.decoder.layers = torch.nn.ModuleList([Block(d, i + 1) for i in range(layers)])
        self.decoder.final_layernorm = torch.nn.LayerNorm(d)
        self.output_layer = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, tok):
        x = self.embedding.word_embeddings(tok)
        for b in self.decoder.layers:
            x = b(x)
        return self.output_layer(self.decoder.final_layernorm(x))


def train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config):
    """Megatron's train_step contract: zero grads, forward/backward, clip, optimizer.step;
    returns (loss dict, skipped_iter, grad_norm, num_zeros_in_grad)."""
    (m,) = model
    optimizer.zero_grad(set_to_none=True)
    tok = next(data_iterator)
    logits = m(tok[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             tok[:, 1:].reshape(-1))
    loss.backward()
    grad_norm = float(torch.nn.utils.clip_grad_norm_(m.parameters(), config["clip"]))
    if config.get("skip") == config["iteration"]:
        return {}, 1, None, None
    optimizer.step()
    return {"lm loss": loss.detach()}, 0, grad_norm, None


def run(out, steps=6, plain=False, skip=None, every=1, hist_every=2):
    torch.manual_seed(0)
    model = Toy()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.1)
    # the clip train_step applies, where Megatron's optimizer keeps it (the probe reads it
    # for the run config and to undo the clipping for its curvature proxy)
    opt.config = types.SimpleNamespace(clip_grad=1.0)
    names = [n for n, _ in model.named_parameters()]
    probe = MegatronProbe(os.path.join(out, "run"), every=every, hist_every=hist_every,
                          precision="float64", plain=plain, flush_every_s=0.0,
                          config={"train": {"seq_len": 8}})
    wrapped = make_train_step_wrapper(lambda: probe)(train_step)
    gen = torch.Generator().manual_seed(1)
    data = iter([torch.randint(0, 32, (4, 9), generator=gen) for _ in range(steps)])
    reference = {}
    for it in range(steps):
        m_prev = {n: (opt.state[p]["exp_avg"].clone() if p in opt.state else torch.zeros_like(p))
                  for n, p in model.named_parameters()}
        cfg = {"clip": 1.0, "iteration": it + 1, "skip": skip}
        wrapped(None, data, [model], opt, None, cfg)
        if skip == it + 1 or (it + 1) % every:
            continue
        rows = {}
        for n, p in model.named_parameters():
            st = opt.state[p]
            t = int(st["step"])
            m_hat = st["exp_avg"].double().numpy() / (1 - 0.9 ** t)
            v_hat = st["exp_avg_sq"].double().numpy() / (1 - 0.95 ** t)
            rows[n] = reference_metrics(p.grad.double().numpy(), m_hat, v_hat,
                                        m_prev[n].double().numpy(), p.detach().double().numpy(), 1e-8)
        reference[str(it + 1)] = rows
    probe.close()
    with open(os.path.join(out, "reference.json"), "w") as fh:
        json.dump({"names": names, "steps": reference}, fh)
    return os.path.join(out, "run")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--plain", action="store_true")
    ap.add_argument("--skip", type=int)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    print(run(a.out, a.steps, a.plain, a.skip))
