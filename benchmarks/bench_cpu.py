"""CPU prefill and decode speed of the torch path: `python -m benchmarks.bench_cpu MODEL`.

Loads MODEL for the CPU exactly as a launch would (price -> Layout -> loader), prefills a
prompt of --prompt tokens, then decodes --gen tokens greedily, and prints tokens/s for each.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from engine.hardware.devices import cpu_spec
from engine.planning.plan import Plan
from spec.errors import CarveError


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_cpu", description=__doc__.splitlines()[0])
    p.add_argument("model", help="path of a GGUF file")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens to prefill (default 128)")
    p.add_argument("--gen", type=int, default=64, help="tokens to decode (default 64)")
    p.add_argument("--ctx", type=int, default=1024, help="context length (default 1024)")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk (default 512)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads")
    p.add_argument("--repeat", type=int, default=3, help="runs; the best is reported (default 3)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    # OpenMP's wait policy is left at its default, as the engine process runs it: side by side
    # on an idle 2-core machine, default 14.7-14.8 t/s against ACTIVE 13.7-14.4 (PASSIVE 10.5).
    import torch

    from engine.gguf.hparams import HParams
    from engine.gguf.reader import GGUFModel
    from engine.runtime.session import Session

    torch.set_num_threads(a.threads)
    try:
        if a.prompt + a.gen > a.ctx:
            raise CarveError(f"--ctx {a.ctx} is smaller than --prompt + --gen ({a.prompt + a.gen})")
        n_layer = HParams.from_model(GGUFModel.open(a.model)).n_layer
        plan = Plan(model=a.model, devices=(cpu_spec(),), split=(0, n_layer), ctx=a.ctx,
                    prefill_chunk=a.chunk, cache_reserve=0)
        t0 = time.perf_counter()
        sess = Session.load(plan)
        load_s = time.perf_counter() - t0
    except CarveError as exc:
        print(f"bench_cpu: {exc}", file=sys.stderr)
        return 2
    dq = sum(s.nbytes for a_ in sess.layout.devices[0].arenas if a_.purpose == "dequant_cache"
             for s in a_.spans)
    print(f"model {a.model}\nloaded in {load_s:.1f} s; dequant cache {dq / 2**20:.0f} MiB; "
          f"{a.threads} threads")
    from engine.runtime.models.ops import QWeight
    from spec.quant_types import type_name

    tensors = sess.loaded[-1].tensors
    for name, w in tensors.items():
        embedding_only = name == "token_embd.weight" and "output.weight" in tensors  # a gather
        if isinstance(w, QWeight) and w.cached is None and not embedding_only:
            print(f"not in the dequant cache (dequantized on every use): {name} "
                  f"{type_name(w.ggml_type)} [{w.rows}x{w.cols}]")
    vocab = sess.hp.n_vocab
    prompt = torch.randint(100, min(vocab, 20000), (a.prompt,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    pp, tg = 0.0, 0.0
    with torch.inference_mode():
        for _ in range(a.repeat):
            sess.reset()
            t = time.perf_counter()
            logits = sess.prefill(prompt, all_rows=False)
            pp = max(pp, a.prompt / (time.perf_counter() - t))
            tok = int(logits[-1].argmax())
            t = time.perf_counter()
            for _ in range(a.gen):
                logits = sess.forward([tok], sess.kv.n_past, "last")
                sess.kv.n_past += 1
                tok = int(logits[-1].argmax())
            tg = max(tg, a.gen / (time.perf_counter() - t))
    print(f"prefill pp{a.prompt}: {pp:.1f} t/s\ndecode tg{a.gen}: {tg:.1f} t/s (best of {a.repeat})")
    sess.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
