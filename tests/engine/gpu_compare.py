"""Comparing the Triton runner with the CPU engine (tests/engine/test_gpu_*.py)."""

from __future__ import annotations

import torch

from engine.runtime.sampling import SamplingParams


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute difference over the reference's largest magnitude."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


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
                       check=None, options=None) -> None:
    """Load ``plan`` on the Triton runner (its stages on ``device``) and on the CPU engine:
    the prefill logits of every row of ``prompt``, then decode ``steps``, within ``bound``
    relative error; with ``greedy_prompt``, the same 4 greedy ids from a fresh cache (prefill,
    then decode steps as generate runs them). ``check``: called with the loaded GpuSession
    first (that the stages took the path under test); ``options``: the Triton runner's
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
