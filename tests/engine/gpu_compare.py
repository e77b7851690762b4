"""Comparing the Triton runner with the CPU engine (tests/engine/test_gpu_*.py)."""

from __future__ import annotations

import torch

from engine.runtime.sampling import SamplingParams


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute difference over the reference's largest magnitude."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def keys_alike(g, c, cells: int, bound: float) -> None:
    """Each layer's first ``cells`` cached keys on the Triton runner ``g`` (its first stage)
    within ``bound`` of the CPU engine's (``c``): what each rotated into its cache."""
    for i, layer in enumerate(g.pipe.stages[0].layers):
        err = rel(layer.attn.k_cache[:cells], c.kv.layers[i].k[:cells])
        assert err < bound, f"layer {i}: rotated keys differ by {err:.2e}"


def decode_errors(g, c, toks: list[int]) -> tuple[list[float], torch.Tensor]:
    """Decode ``toks`` after what both sessions hold: the relative error of each step, and the
    runner's last logits row."""
    errs = []
    for tok in toks:
        dg = g.forward([tok], g.kv.n_past, "last")
        dc = c.forward([tok], c.kv.n_past, "last")
        g.kv.n_past += 1
        c.kv.n_past += 1
        errs.append(rel(dg[-1], dc[-1]))
    return errs, dg[-1].clone()


GREEDY = SamplingParams(temperature=0.0, repeat_penalty=1.0, max_tokens=4)


def tie_free(plan, n_prompt: int, n_steps: int, n_greedy: int, tau: float = 0.03,
             logit_tau: float = 0.05, tries: int = 64) -> tuple[list[int], list[int], list[int]]:
    """Token ids (prompt, steps, greedy_prompt) for `against_cpu_engine` away from ties, for a
    runner whose decode rounds on purpose (int8 activations). A synthetic model's router sends
    rows to random experts, so at a few rows in a hundred its k-th and (k+1)-th choices nearly
    tie, and any rounding flips one: another expert, logits 10 % apart, yet no kernel is wrong;
    the same holds for greedy ids whose top two logits nearly tie. Tries seeds until, run
    through the CPU engine on ``plan``, the routing of every MoE layer at every decode row (the
    steps after the prompt, and the 3 steps that generate 4 greedy ids after greedy_prompt)
    holds when each router logit moves by ``tau`` times its row's spread (std), and each greedy
    id's logit leads the next by ``logit_tau`` times its row's spread."""
    from types import SimpleNamespace

    from engine.runtime.models.ops import TORCH_OPS
    from engine.runtime.session import Session

    held: list[bool] = []

    def route(logits, k, gating, norm, scale, bias=None, groups=(0, 0)):
        ids, w = TORCH_OPS.route(logits, k, gating, norm, scale, bias, groups)
        if logits.shape[0] != 1:  # a prefill chunk (a prompt here is longer than a row)
            return ids, w
        lg = logits.float()
        d = tau * lg.std(-1, keepdim=True)
        b = 0.0 if bias is None or gating == "softmax_topk" else bias.float()
        if gating == "softmax":  # moving every logit by d moves a probability by e^(+-2d)
            p = torch.softmax(lg, -1)
            lo, hi = p * torch.exp(-2 * d) + b, p * torch.exp(2 * d) + b
        else:
            f = torch.sigmoid if gating == "sigmoid" else (lambda z: z)
            lo, hi = f(lg - d) + b, f(lg + d) + b
        chosen = torch.zeros_like(lg, dtype=torch.bool).scatter_(-1, ids, True)
        worst_in = lo.masked_fill(~chosen, float("inf")).amin(-1)
        best_out = hi.masked_fill(chosen, float("-inf")).amax(-1)
        held.append(bool((worst_in > best_out).all()))
        return ids, w

    ops = SimpleNamespace(**{**vars(TORCH_OPS), "route": route})
    c = Session.load(plan, ops=ops)
    try:
        for seed in range(0, 4 * tries, 4):
            gen = torch.Generator().manual_seed(seed)
            prompt, steps, greedy_prompt = (
                torch.randint(3, 300, (n,), generator=gen).tolist()
                for n in (n_prompt, n_steps, n_greedy))
            c.logits(prompt)
            held.clear()
            for tok in steps:  # decoded as against_cpu_engine decodes them
                c.forward([tok], c.kv.n_past, "last")
                c.kv.n_past += 1
            out: list[int] = []
            c.generate(greedy_prompt, GREEDY, set(), out.append)
            rows = c.logits(greedy_prompt + out[:3])[n_greedy - 1:]
            top2 = rows.topk(2, -1).values
            lead = bool(((top2[:, 0] - top2[:, 1]) > logit_tau * rows.std(-1)).all())
            if held and all(held) and lead and len(out) == 4:
                return prompt, steps, greedy_prompt
    finally:
        c.close()
    raise AssertionError(f"no ids clear of ties in {tries} tries (tau {tau})")


def chunk_and_decode_rows(g, prompt: list[int]) -> torch.Tensor:
    """The last logits row of a session after the second of two prefill chunks of ``prompt``
    (8 rows, then the rest) and after each of two decode steps, stacked, then ``g`` closed:
    what a split must not change."""
    try:
        g.forward(prompt[:8], 0, "none")
        rows = [g.forward(prompt[8:], 8, "last").clone()]
        rows += [g.forward([t], len(prompt) + i, "last").clone() for i, t in enumerate((5, 9))]
        return torch.stack([r[-1] for r in rows])
    finally:
        g.close()


def against_cpu_engine(plan, device: torch.device, prompt: list[int], steps: list[int],
                       greedy_prompt: list[int] | None, bound: float, label: str,
                       check=None, options=None, after=None) -> None:
    """Load ``plan`` on the Triton runner (its stages on ``device``) and on the CPU engine:
    the prefill logits of every row of ``prompt``, then decode ``steps``, within ``bound``
    relative error; with ``greedy_prompt``, the same 4 greedy ids from a fresh cache (prefill,
    then decode steps as generate runs them). ``check``: called with the loaded GpuSession
    first (that the stages took the path under test); ``after``: called with both sessions
    after the decode steps (before the greedy ids); ``options``: the Triton runner's
    RunnerOptions."""
    from engine.runtime.gpu.session import GpuSession
    from engine.runtime.options import RunnerOptions
    from engine.runtime.session import Session

    g = GpuSession.load(plan, devices=[device], remember=False,
                        options=options or RunnerOptions())
    c = Session.load(plan)
    try:
        if check is not None:
            check(g)
        lg, lc = g.logits(prompt), c.logits(prompt)
        assert lg.shape == lc.shape and lg.shape[0] == len(prompt)
        errs = [rel(lg, lc), *decode_errors(g, c, steps)[0]]
        print(f"{label}: rel errors prefill {errs[0]:.2e}, decode {max(errs[1:]):.2e}")
        assert max(errs) < bound
        if after is not None:
            after(g, c)
        if greedy_prompt is None:
            return
        one: list[int] = []
        ref: list[int] = []
        g.generate(greedy_prompt, GREEDY, set(), one.append)
        c.generate(greedy_prompt, GREEDY, set(), ref.append)
        assert one == ref and len(one) == 4
    finally:
        g.close()
        c.close()
