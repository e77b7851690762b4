"""The mixture-of-experts kernels (carve_kernels/moe.py, moe_decode.py, moe_prefill.py) on a GPU
against their torch twins, each timed against the bytes it must move or its FLOPs, and the
sweeps of the decode expert tiles and the grouped GEMM tiles, at Qwen3-30B-A3B and gpt-oss-20b
expert shapes:

    python -m benchmarks.device_check_moe [--json FILE]

the same as ``python -m benchmarks.device_check --moe`` (whose copy-rate and matmul-rate
ceilings, table and JSON it shares). Needs a CUDA GPU."""

# Timed lambdas run at once inside their loop iteration (B023); a failing section is reported
# and the run goes on, so one device call brings back everything else (BLE001).
# ruff: noqa: B023, BLE001

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import triton
import triton.language as tl

from benchmarks.device_check import graph_time, nerr
from carve_kernels import quant_matmul
from carve_kernels.random_blocks import random_weight
from spec import quant_types as qt

# mixture of experts at Qwen3-30B-A3B (Q4_K_M: gate/up Q4_K, down Q6_K)
# and gpt-oss-20b (MXFP4) expert shapes
MOE_SHAPES = [  # (label, n_expert, k, n_embd, n_ff_exp, gate/up type, down type)
    ("30B-A3B", 128, 8, 2048, 768, qt.Q4_K, qt.Q6_K),
    ("30B-A3B", 128, 8, 2048, 768, qt.Q4_K, qt.Q4_K),
    ("gpt-oss-20b", 32, 4, 2880, 2880, qt.MXFP4, qt.MXFP4),
]
# run only when --types names their gate/up type: GLM-4.5-Air's Q3_K_M experts (gate/up Q3_K;
# down Q5_0, llama.cpp's fallback for Q4_K on its 1408-value rows), its Q4_K_M file's bumped
# downs (Q8_0, Q6_K's fallback), and pure IQ4_NL experts
MOE_SHAPES_BY_TYPE = [("glm4.5-air", 128, 8, 4096, 1408, qt.Q3_K, qt.Q5_0),
                      # down Q3_K too
                      ("glm4.5-air 1536", 128, 8, 4096, 1536, qt.Q3_K, qt.Q3_K),
                      ("glm4.5-air", 128, 8, 4096, 1408, qt.Q4_K, qt.Q8_0),
                      ("glm4.5-air", 128, 8, 4096, 1408, qt.IQ4_NL, qt.IQ4_NL)]


def moe_section(g, copy_bw, mm_rate, row, types=None, prefill=True):
    """Each MoE kernel against the bytes it must move (decode: the k routed experts' rows only;
    prefill 512 tokens: every expert's bytes once, or its FLOPs). Decode calls in one graph
    draw different experts (8 id sets), so the 8 calls do not hit L2 for each other.
    ``types``: only the shapes whose gate/up type is one of these; ``prefill`` False: decode's
    kernels only."""
    from carve_kernels import gemv_q8, moe, moe_decode, moe_decode_q8, moe_prefill
    from spec.launch import moe_tiles

    # the int8-x bodies on trial are timed here too (the engine takes them with CARVE_TRIAL)
    moe_decode_q8.Q8_ON_TRIAL = frozenset(t for ts in gemv_q8.Q8_TRIAL_TYPES.values() for t in ts)

    swept: set = set()
    for label, ne, k, e, f, gt, dt in MOE_SHAPES + (MOE_SHAPES_BY_TYPE if types else []):
        if types and gt not in types:
            continue
        tag = f"{label} {qt.type_name(gt)}/{qt.type_name(dt)}"
        gate = random_weight(gt, ne * f, e, "cuda", g)
        up = random_weight(gt, ne * f, e, "cuda", g)
        down = random_weight(dt, ne * e, f, "cuda", g)
        router_w = torch.randn(ne, e, device="cuda", generator=g) * 0.05
        per_g, per_d = gate.numel() // ne, down.numel() // ne  # one expert's bytes
        x = torch.randn(1, e, device="cuda", generator=g).to(torch.bfloat16)
        sets = [torch.randperm(ne, device="cuda", generator=g)[:k].view(1, k).to(torch.int32)
                for _ in range(8)]
        wts = torch.rand(1, k, device="cuda", generator=g)
        logits = torch.empty(1, ne, device="cuda")
        ids, w_out = torch.empty(1, k, dtype=torch.int32, device="cuda"), torch.empty(1, k,
                                                                                     device="cuda")
        h = torch.empty(k, f, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(1, e, device="cuda", dtype=torch.bfloat16)
        t = graph_time(lambda i=0: moe.router(router_w, x, out=logits))
        row(f"moe router {label} T=1", t, router_w.numel() * 4 / copy_bw)
        t = graph_time(lambda i=0: moe.route(logits, k, "softmax", True, 1.0, None, ids, w_out))
        row(f"moe route {label} T=1", t, 0.0, note="latency only")
        # timed first: the graph's last call leaves sets[7]'s output in h and y, so each
        # result is checked after its timing, from a poisoned output, with the ids it used
        cg, cd = moe_decode.expert_config(gt, f, e, "glu"), moe_decode.expert_config(dt, e, f, "down")
        t = graph_time(lambda i=0: moe_decode.expert_glu(gate, gt, up, gt, ne, x, sets[i], h,
                                                         config=cg))
        h.fill_(float("nan"))
        moe_decode.expert_glu(gate, gt, up, gt, ne, x, sets[0], h, config=cg)
        ref = moe_decode.expert_glu_ref(gate, gt, up, gt, ne, x.float(), sets[0],
                                        torch.empty(k, f, device="cuda"))
        row(f"moe expert gate/up+glu {tag} T=1", t, 2 * k * per_g / copy_bw, nerr(h, ref),
            f"cfg={cg}")
        t = graph_time(lambda i=0: moe_decode.expert_down(down, dt, ne, h, sets[i], wts, y,
                                                          config=cd))
        y.fill_(float("nan"))
        moe_decode.expert_down(down, dt, ne, h, sets[0], wts, y, config=cd)
        ref = moe_decode.expert_down_ref(down, dt, ne, h.float(), sets[0], wts,
                                         torch.empty(1, e, device="cuda"))
        row(f"moe expert down {tag} T=1", t, k * per_d / copy_bw, nerr(y, ref), f"cfg={cd}")
        # the k experts in parallel programs, then summed in order (moe_decode.DOWN_SPLIT)
        yr = torch.empty(k, e, device="cuda")
        t = graph_time(lambda i=0: moe_decode.expert_down(down, dt, ne, h, sets[i], wts, y,
                                                          config=cd, rows_out=yr))
        y.fill_(float("nan"))
        moe_decode.expert_down(down, dt, ne, h, sets[0], wts, y, config=cd, rows_out=yr)
        row(f"moe expert down split {tag} T=1", t, k * per_d / copy_bw, nerr(y, ref),
            f"cfg={cd} DOWN_SPLIT={moe_decode.DOWN_SPLIT}")
        # the int8-x bodies
        if moe_decode_q8.q8_able(gt, e) and moe_decode_q8.q8_able(dt, f):
            _q8_rows(moe_decode, gate, up, down, gt, dt, ne, k, x, sets, wts, h, y, yr,
                     2 * k * per_g / copy_bw, k * per_d / copy_bw, tag, row,
                     (label, gt) not in swept)
            swept.add((label, gt))  # the Q4_K/Q4_K shape repeats the gate/up of Q4_K/Q6_K
        # the tiles moe_decode.EXPERT_CONFIG may take (blocks per step clamp to the row's
        # blocks): for the types decode runs on bf16 x (the int8-x ones: _q8_rows)
        if not moe_decode_q8.q8_able(gt, e):
            _expert_sweep(f"glu {tag}", lambda c, i: moe_decode.expert_glu(
                gate, gt, up, gt, ne, x, sets[i], h, config=c), 2 * k * per_g / copy_bw, row)
        if not moe_decode_q8.q8_able(dt, f):
            _expert_sweep(f"down {tag}", lambda c, i: moe_decode.expert_down(
                down, dt, ne, h, sets[i], wts, y, config=c), k * per_d / copy_bw, row)
            _expert_sweep(f"down split {tag}", lambda c, i: moe_decode.expert_down(
                down, dt, ne, h, sets[i], wts, y, config=c, rows_out=yr), k * per_d / copy_bw,
                row)
        if not prefill:
            continue
        # prefill: 512 tokens routed by random logits
        m = 512
        xp = torch.randn(m, e, device="cuda", generator=g).to(torch.bfloat16)
        lg = torch.empty(m, ne, device="cuda")
        ids_p = torch.empty(m, k, dtype=torch.int32, device="cuda")
        w_p = torch.empty(m, k, device="cuda")
        rows_, pos = (torch.empty(m * k, dtype=torch.int32, device="cuda") for _ in range(2))
        tiles = torch.empty(3, moe_tiles(m * k, ne), dtype=torch.int32, device="cuda")
        hp_ = torch.empty(m * k, f, device="cuda", dtype=torch.bfloat16)
        out_rows = torch.empty(m * k, e, device="cuda")
        yp = torch.empty(m, e, device="cuda", dtype=torch.bfloat16)
        t = graph_time(lambda i=0: moe.router(router_w, xp, out=lg), calls=2)
        row(f"moe router {label} T=512", t, 2 * m * e * ne / mm_rate,
            nerr(lg, moe.router_ref(router_w, xp)))
        default_rc = moe.ROUTER_MM_CONFIG
        for rc in ROUTER_TILES:  # the tiles moe.ROUTER_MM_CONFIG may take
            moe.ROUTER_MM_CONFIG = rc
            try:
                t = graph_time(lambda i=0: moe.router(router_w, xp, out=lg), calls=2)
                print(f"  router {label} T=512 cfg {rc}: {t * 1e6:.1f} us (err "
                      f"{nerr(lg, moe.router_ref(router_w, xp)):.1e})", flush=True)
            except Exception as exc:
                print(f"  router {label} cfg {rc}: {type(exc).__name__}: {str(exc)[:100]}")
        moe.ROUTER_MM_CONFIG = default_rc
        moe.router(router_w, xp, out=lg)
        moe.route(lg, k, "softmax", True, 1.0, None, ids_p, w_p)
        t = graph_time(lambda i=0: moe_prefill.sort_routes(ids_p, ne, rows_, pos, tiles,
                                                           lg.view(torch.int32)), calls=2)
        same = _sort_agrees(moe_prefill, ids_p, ne, rows_, pos, tiles)
        row(f"moe sort {label} T=512", t, 0.0, None if same else float("inf"),
            note="latency only" + ("" if same else "; DIFFERS from sort_routes_ref"))
        flops = 2 * m * k * e * f
        t = graph_time(lambda i=0: moe_prefill.grouped_glu(gate, gt, up, gt, ne, xp, ids_p, rows_, tiles,
                                                           hp_), calls=2)
        ex_of = ids_p.reshape(-1)[rows_.long()].long()  # expert of each sorted row
        tok_of = rows_.long() // k  # token of each sorted row
        gd = _per_expert(gate, gt, ne, xp.float()[tok_of], ex_of)
        h_ref = torch.nn.functional.silu(gd) * _per_expert(up, gt, ne, xp.float()[tok_of], ex_of)
        gd = None
        row(f"moe grouped gate/up {tag} T=512", t,
            max(2 * gate.numel() / copy_bw, 2 * flops / mm_rate), nerr(hp_, h_ref))
        h0 = hp_.clone()  # down's input for every variant below
        y_ref = _per_expert(down, dt, ne, h0.float(), ex_of)
        t = graph_time(lambda i=0: moe_prefill.grouped_down(down, dt, ne, h0, tiles, out_rows), calls=2)
        row(f"moe grouped down {tag} T=512", t, max(down.numel() / copy_bw, flops / mm_rate),
            nerr(out_rows, y_ref))
        # the tiles moe_prefill.GROUPED_CONFIG may take, on tiles of 32 sorted rows of one
        # expert and of 64 (spec.launch.MOE_TILE_ROWS)
        default_rows = moe_prefill.MOE_TILE_ROWS
        for tile_rows in (32, 64):
            moe_prefill.MOE_TILE_ROWS = tile_rows
            tiles_r = torch.empty_like(tiles)
            moe_prefill.sort_routes(ids_p, ne, rows_, pos, tiles_r, lg.view(torch.int32))
            for c in GROUPED_TILES:
                try:
                    tg = graph_time(lambda i=0, c=c: moe_prefill.grouped_glu(
                        gate, gt, up, gt, ne, xp, ids_p, rows_, tiles_r, hp_, config=c), calls=2)
                    eg = nerr(hp_, h_ref)
                    td = graph_time(lambda i=0, c=c: moe_prefill.grouped_down(
                        down, dt, ne, h0, tiles_r, out_rows, config=c), calls=2)
                    ed = nerr(out_rows, y_ref)
                except Exception as exc:  # a tile can exceed registers or shared memory
                    print(f"  grouped {tag} {c} tile rows {tile_rows}: {type(exc).__name__}: "
                          f"{str(exc)[:100]}", flush=True)
                    continue
                print(f"  grouped {tag} cfg {c} tile rows {tile_rows}: gate/up {tg * 1e6:.1f} "
                      f"us (err {eg:.1e}), down {td * 1e6:.1f} us (err {ed:.1e})", flush=True)
        moe_prefill.MOE_TILE_ROWS = default_rows
        h_ref = y_ref = h0 = None
        t = graph_time(lambda i=0: moe.combine(out_rows, pos, w_p, yp), calls=2)
        row(f"moe combine {label} T=512", t, (out_rows.numel() * 4 + yp.numel() * 2) / copy_bw,
            nerr(yp, moe.combine_ref(out_rows, pos, w_p, torch.empty(m, e, device="cuda"))))
        gate = up = down = hp_ = out_rows = None  # free before the next shape
        torch.cuda.empty_cache()


def host_section(g, copy_bw, mm_rate, row):
    """Decode's expert kernels (one row, k of the experts) reading gate, up and down where
    they lie in pinned host memory (registered with the driver as the GPU runner's host
    arenas are), each against the bytes it reads over the measured host-to-GPU copy rate;
    beside them the way a host layer ran before: the chosen experts copied into device
    memory, then the kernels there. Every tile of EXPERT_TILES for the host reads."""
    from carve_kernels import moe_decode
    from engine.runtime.gpu.host_arena import new_host_arena, unpin

    label, ne, k, e, f, gt, dt = MOE_SHAPES[0]
    tag = f"{label} {qt.type_name(gt)}/{qt.type_name(dt)}"
    dev = [random_weight(gt, ne * f, e, "cuda", g), random_weight(gt, ne * f, e, "cuda", g),
           random_weight(dt, ne * e, f, "cuda", g)]
    arenas, host = [], []
    for w in dev:
        buf, pinned = new_host_arena(w.numel(), True)
        if not pinned:
            print("pinning refused: no in-place reads to time", flush=True)
            return
        arenas.append(buf)
        buf.copy_(w.view(-1).cpu())
        host.append(buf.view(w.shape))
    big, _ = new_host_arena(1 << 30, True)
    arenas.append(big)
    to = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    from triton.testing import do_bench
    ms = do_bench(lambda: to.copy_(big, non_blocking=True), warmup=5, rep=40,
                  return_mode="median")
    h2d = (1 << 30) / (ms / 1e3)
    print(f"# host to GPU copy {h2d / 1e9:.1f} GB/s (1 GiB, registered host memory)", flush=True)
    to = None
    per = [w.numel() // ne for w in dev]  # one expert's bytes per matrix
    x = torch.randn(1, e, device="cuda", generator=g).to(torch.bfloat16)
    sets = [torch.randperm(ne, device="cuda", generator=g)[:k].view(1, k).to(torch.int32)
            for _ in range(8)]
    wts = torch.rand(1, k, device="cuda", generator=g)
    h = torch.empty(k, f, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(1, e, device="cuda", dtype=torch.bfloat16)
    cg, cd = moe_decode.expert_config(gt, f, e, "glu"), moe_decode.expert_config(dt, e, f, "down")
    for where, (gm, um, dm) in (("in VRAM", dev), ("host in place", host)):
        t = graph_time(lambda i=0: moe_decode.expert_glu(gm, gt, um, gt, ne, x, sets[i], h,
                                                         config=cg))
        h.fill_(float("nan"))
        moe_decode.expert_glu(gm, gt, um, gt, ne, x, sets[0], h, config=cg)
        ref = moe_decode.expert_glu_ref(dev[0], gt, dev[1], gt, ne, x.float(), sets[0],
                                        torch.empty(k, f, device="cuda"))
        floor = 2 * k * per[0] / (copy_bw if where == "in VRAM" else h2d)
        row(f"moe expert gate/up {where} {tag}", t, floor, nerr(h, ref), f"cfg={cg}")
        t = graph_time(lambda i=0: moe_decode.expert_down(dm, dt, ne, h, sets[i], wts, y,
                                                          config=cd))
        y.fill_(float("nan"))
        moe_decode.expert_down(dm, dt, ne, h, sets[0], wts, y, config=cd)
        ref = moe_decode.expert_down_ref(dev[2], dt, ne, h.float(), sets[0], wts,
                                         torch.empty(1, e, device="cuda"))
        floor = k * per[2] / (copy_bw if where == "in VRAM" else h2d)
        row(f"moe expert down {where} {tag}", t, floor, nerr(y, ref), f"cfg={cd}")
    # the chosen experts copied into device memory first (what a host layer did per token)
    chosen = sets[0].view(-1).tolist()
    staged = [torch.empty_like(w) for w in dev]
    layer_bytes = k * sum(per)

    def one(t, ex, n):  # expert ex's n bytes of expert tensor t
        return t.view(-1)[ex * n:(ex + 1) * n]

    def copy_in():
        for src, dst, n in zip(host, staged, per, strict=True):
            for ex in chosen:
                one(dst, ex, n).copy_(one(src, ex, n), non_blocking=True)

    ms = do_bench(copy_in, warmup=5, rep=40, return_mode="median")
    row(f"moe copy-in of {k} experts {tag}", ms / 1e3, layer_bytes / h2d,
        note=f"{3 * k} copies")
    # the same experts gathered on the GPU (ids on the device, in a graph), then the kernels
    # in VRAM: what a host layer's decode runs now (HostExperts.gather)
    t = graph_time(lambda i=0: moe_decode.gather_experts(host, staged, ne, sets[i]))
    for w, s_, n in zip(dev, staged, per, strict=True):  # the last replay's experts, bytewise
        for ex in sets[7].view(-1).tolist():
            assert torch.equal(one(w, ex, n), one(s_, ex, n))
    row(f"moe gather of {k} experts {tag}", t, layer_bytes / h2d, note="3 launches")

    def gathered(i=0):
        moe_decode.gather_experts(host, staged, ne, sets[i])
        moe_decode.expert_glu(staged[0], gt, staged[1], gt, ne, x, sets[i], h, config=cg)
        moe_decode.expert_down(staged[2], dt, ne, h, sets[i], wts, y, config=cd)

    def direct(i=0):
        moe_decode.expert_glu(host[0], gt, host[1], gt, ne, x, sets[i], h, config=cg)
        moe_decode.expert_down(host[2], dt, ne, h, sets[i], wts, y, config=cd)

    row(f"moe host layer gathered {tag}", graph_time(gathered), layer_bytes / h2d)
    row(f"moe host layer read directly {tag}", graph_time(direct), layer_bytes / h2d)
    _expert_sweep(f"glu host {tag}", lambda c, i: moe_decode.expert_glu(
        host[0], gt, host[1], gt, ne, x, sets[i], h, config=c), 2 * k * per[0] / h2d, row)
    _expert_sweep(f"down host {tag}", lambda c, i: moe_decode.expert_down(
        host[2], dt, ne, h, sets[i], wts, y, config=c), k * per[2] / h2d, row)
    host = staged = dev = None
    for buf in arenas:
        unpin(buf)


@triton.jit
def _ping_kernel(flags_ptr, y_ptr, out_ptr, E, READ: tl.constexpr, BLOCK: tl.constexpr):
    # the hand-over's bare round trip: raise the ticket, spin for the answer (then read the
    # host's sum, READ)
    ticket = tl.load(flags_ptr + 1, volatile=True) + 1
    tl.store(flags_ptr, ticket, cache_modifier=".wt")
    answer = tl.load(flags_ptr + 1, volatile=True)
    spins = 0
    while (answer != ticket) & (spins < 1 << 18):
        answer = tl.load(flags_ptr + 1, volatile=True)
        spins += 1
    if READ:
        o = tl.arange(0, BLOCK)
        tl.store(out_ptr + o, tl.load(y_ptr + o, mask=o < E, volatile=True), mask=o < E)


def split_section(row, n: int = 32) -> None:
    """The hand-over of a decode row split between the GPU and the CPU (carve_kernels/
    host_split.py), alone: ``n`` publish + await pairs in one CUDA graph, the host answering
    each ticket at once as the engine does (the main thread, after the replay), so each
    pair's time is the round trip a split layer adds beyond the CPU's own work: the ticket
    reaching the host, the answer reaching the GPU, the row down and the sum up. Then the
    same while a 1 GiB host-to-GPU copy streams on another stream (a host layer's gather is
    crossing PCIe while the host computes). In a real step the GPU's experts run between the
    two; here nothing does, so a slow ticket shows as it is."""
    from carve_kernels import host_split
    from engine.runtime.gpu.host_arena import new_host_arena, unpin

    e, c = 2048, 2
    buf, pinned = new_host_arena(64 << 10, True)
    if not pinned:
        print("pinning refused: no hand-over to time", flush=True)
        return
    hx = buf[:2 * e].view(torch.bfloat16)
    hids = buf[16384:16384 + 64].view(torch.int32)
    hw = buf[16640:16640 + 64].view(torch.float32)
    flags = buf[16896:16896 + 16].view(torch.int32)
    hy = buf[32768:32768 + 4 * e].view(torch.float32)
    flags.zero_()
    hy.zero_()
    x = torch.randn(e, device="cuda").to(torch.bfloat16)
    ids = torch.arange(c, dtype=torch.int32, device="cuda")
    w = torch.ones(c, device="cuda")
    out = torch.zeros(e, device="cuda")
    f = flags.numpy()

    def full(use_pdl=True, asm=True):
        def launch():
            for _ in range(n):
                if asm:
                    host_split.publish(x, ids, w, hx, hids, hw, flags, use_pdl=use_pdl)
                    host_split.await_sum(flags, hy, out, accumulate=True, use_pdl=use_pdl)
                else:  # the same kernels without their system-scope fences
                    host_split._publish_kernel[(1,)](
                        x, ids, w, hx, hids, hw, flags, e, c, BLOCK=host_split.PUBLISH_BLOCK,
                        KB=2, ASM=False, PDL=True, launch_pdl=True)
                    host_split._await_kernel[(e // host_split.AWAIT_BLOCK,)](
                        flags, hy, out, e, 1 << 18, ACC=True,
                        BLOCK=host_split.AWAIT_BLOCK, ASM=False, PDL=True, launch_pdl=True)
        return launch

    def ping(read_y):
        def launch():
            for _ in range(n):
                _ping_kernel[(1,)](flags, hy, out, e, READ=read_y, BLOCK=2048)
        return launch

    def answer():
        # (a ticket that never comes, a variant without fences: given up after 2 s)
        deadline = time.perf_counter() + 2.0
        for _ in range(n):
            while f[0] == f[1]:
                if time.perf_counter() > deadline:
                    return
            f[1] = f[0]

    big, _ = new_host_arena(1 << 30, True)
    to = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    variants = (("", full()), (" no PDL", full(use_pdl=False)), (" no fences", full(asm=False)),
                (" ping only (ticket, spin)", ping(False)),
                (" ping + read the sum", ping(True)))
    for name, launch in variants:
        flags.zero_()
        launch()  # compiles; the launches are asynchronous, so the answers come after them
        answer()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            launch()
        for label, busy in (("alone", False), ("beside a 1 GiB host-to-GPU copy", True)):
            times = []
            for _ in range(15):
                if busy:
                    with torch.cuda.stream(side):
                        to.copy_(big, non_blocking=True)
                t0 = time.perf_counter()
                graph.replay()
                answer()
                torch.cuda.synchronize()
                times.append((time.perf_counter() - t0) / n)
            sec = statistics.median(times)
            ok = f[2] == 0 and f[0] == f[1]
            row(f"host split hand-over{name} {label}", sec, 0.0,
                note=f"{n} in a graph, in step={ok}")
    torch.cuda.synchronize()  # the last copy done before its source is unpinned
    graph = to = None
    unpin(big)
    unpin(buf)


def _q8_rows(moe_decode, gate, up, down, gt, dt, ne, k, x, sets, wts, h, y, yr, floor_glu,
             floor_down, tag, row, sweep_glu):
    """Decode's expert GEMVs on the int8 copies (carve_kernels/gemv_q8.py): gate/up+GLU on x's copy
    writing the copy of its outputs, down on that copy (its k rows summed by combine, or by
    each row tile's last program as the stage runs it), each checked against the reference on
    the dequantized int8 input, then their tiles swept (gate/up with ``sweep_glu``)."""
    from carve_kernels import moe_decode_q8, q8x

    f, e = h.shape[1], x.shape[1]
    (q, d, s), xd = q8x.copy_ref(x[0].float())
    hq = (torch.empty(k * f // 4, dtype=torch.int32, device="cuda"),
          *torch.empty(2, k * f // 32, device="cuda"))
    cg, cd = (moe_decode_q8.EXPERT_Q8_CONFIG[(gt, "glu")],
              moe_decode_q8.EXPERT_Q8_CONFIG[(dt, "down")])
    t = graph_time(lambda i=0: moe_decode_q8.expert_glu_q8(gate, gt, up, gt, ne, (q, d, s),
                                                           sets[i], h, out_q=hq))
    h.fill_(float("nan"))
    moe_decode_q8.expert_glu_q8(gate, gt, up, gt, ne, (q, d, s), sets[0], h, out_q=hq)
    ref = moe_decode.expert_glu_ref(gate, gt, up, gt, ne, xd, sets[0],
                                    torch.empty(k, f, device="cuda"))
    row(f"moe expert gate/up+glu int8 x {tag} T=1", t, floor_glu, nerr(h, ref), f"cfg={cg}")
    t = graph_time(lambda i=0: moe_decode_q8.expert_down_q8(down, dt, ne, hq, sets[i], wts, y,
                                                            yr))
    y.fill_(float("nan"))
    moe_decode_q8.expert_down_q8(down, dt, ne, hq, sets[0], wts, y, yr)
    hd = q8x.dequantize_ref(hq[0].view(torch.int8), hq[1]).view(k, f)
    ref = moe_decode.expert_down_ref(down, dt, ne, hd, sets[0], wts,
                                     torch.empty(1, e, device="cuda"))
    row(f"moe expert down int8 x {tag} T=1", t, floor_down, nerr(y, ref), f"cfg={cd}")
    cnt = torch.zeros(e // 16, dtype=torch.int32, device="cuda")
    t = graph_time(lambda i=0: moe_decode_q8.expert_down_q8(down, dt, ne, hq, sets[i], wts, y,
                                                            yr, counter=cnt))
    y.fill_(float("nan"))
    moe_decode_q8.expert_down_q8(down, dt, ne, hq, sets[0], wts, y, yr, counter=cnt)
    row(f"moe expert down int8 x fused sum {tag} T=1", t, floor_down, nerr(y, ref), f"cfg={cd}")
    small = moe_decode_q8.Q8_BLOCK[gt] == 32  # MXFP4's blocks: more of them a step
    sweeps = [("down int8 x", lambda c, i: moe_decode_q8.expert_down_q8(
        down, dt, ne, hq, sets[i], wts, y, yr, config=c, counter=cnt), floor_down,
        Q8_DOWN_TILES_32 if small else Q8_DOWN_TILES)]
    if sweep_glu:
        sweeps.append(("glu int8 x", lambda c, i: moe_decode_q8.expert_glu_q8(
            gate, gt, up, gt, ne, (q, d, s), sets[i], h, out_q=hq, config=c), floor_glu,
            Q8_TILES_32 if small else Q8_TILES))
    for name, fn, floor, tiles in sweeps:
        _expert_sweep(f"{name} {tag}", fn, floor, row, tiles)


# the sweeps' candidates, few enough that --moe stays within a few minutes of compiles
GROUPED_TILES = [(64, 4), (64, 4, 2), (128, 4, 2), (64, 8), (128, 8), (32, 4),
                 (32, 8)]  # (columns, warps[, stages])
# (rows, experts, columns a step, warps)
ROUTER_TILES = [(16, 32, 64, 4), (32, 32, 64, 4), (16, 64, 64, 4), (16, 32, 32, 4),
                (16, 32, 64, 2), (16, 32, 128, 4), (16, 32, 64, 8), (16, 16, 64, 4)]
EXPERT_TILES = [(1, 16, 1), (2, 16, 2), (4, 16, 4), (8, 16, 4), (16, 16, 8), (32, 16, 8)]
# the int8-x bodies' (rows a multiple of 32: the GLU writes its output's copy per 32 values)
# (32, 4, 4) runs 232 registers a thread, so at most 2 programs (8 warps) share an SM: the
# more-warps tiles give each warp fewer rows' dependent instructions
Q8_TILES = [(32, 2, 4), (32, 4, 4), (32, 8, 4), (64, 4, 8), (32, 4, 8), (32, 2, 8), (32, 1, 8),
            (32, 8, 8), (32, 4, 16), (32, 2, 16), (64, 2, 16)]
# down's: any rows (the row tile's counters: one per 16 rows here)
Q8_DOWN_TILES = [(16, 1, 2), (16, 4, 4), (32, 1, 4), (32, 4, 4), (64, 1, 4), (64, 4, 8),
                 (128, 4, 8), (16, 1, 4), (16, 2, 4), (32, 1, 8), (32, 2, 8), (16, 4, 8)]
# the same for 32-value blocks (MXFP4: 17 bytes a block, a thread each)
Q8_TILES_32 = [(32, 8, 4), (32, 16, 4), (32, 32, 4), (32, 16, 8), (32, 32, 8), (64, 8, 4),
               (64, 16, 8), (64, 32, 8)]
Q8_DOWN_TILES_32 = [(16, 16, 2), (16, 32, 4), (32, 8, 4), (32, 16, 4), (32, 32, 4), (32, 32, 8),
                    (64, 16, 8), (64, 32, 8)]


def _expert_sweep(name, fn, floor, row, tiles=None):
    """Each tile of EXPERT_TILES (or ``tiles``) for one decode expert kernel; the fastest as a
    row."""
    timings = []
    for cfg in tiles or EXPERT_TILES:
        try:
            sec = graph_time(lambda i=0, c=cfg: fn(c, i))
        except Exception as exc:  # a tile can exceed registers or a body's constraints
            print(f"  {name} {cfg}: {type(exc).__name__}: {str(exc)[:100]}", flush=True)
            continue
        timings.append((sec, cfg))
        print(f"  {name} cfg {cfg}: {sec * 1e6:.1f} us", flush=True)
    if timings:
        sec, cfg = min(timings)
        row(f"moe expert {name} best tile", sec, floor, note=f"cfg={cfg}")


def _per_expert(w, t, n_expert, x, ex_of):
    """Reference of a grouped GEMM: row s of ``x`` times expert ex_of[s]'s matrix, in float32
    from ``quant_matmul.dequantize_ref`` one expert at a time."""
    n = w.shape[0] // n_expert
    y = torch.zeros(x.shape[0], n, device=x.device)
    for ex in ex_of.unique().tolist():
        sel = ex_of == ex
        y[sel] = x[sel] @ quant_matmul.dequantize_ref(w[ex * n:(ex + 1) * n], t,
                                                      torch.float32).T
    return y


def _sort_agrees(moe_prefill, ids, n_expert, rows, pos, tiles) -> bool:
    """The device sort's rows, places and used tiles against ``sort_routes_ref``."""
    r, p, tl_ = torch.empty_like(rows), torch.empty_like(pos), torch.empty_like(tiles)
    moe_prefill.sort_routes_ref(ids, n_expert, r, p, tl_)
    used = tl_[0] >= 0
    return (torch.equal(r, rows) and torch.equal(p, pos)
            and torch.equal(tl_[:, used], tiles[:, used]) and bool((tiles[0, ~used] < 0).all()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.device_check_moe",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--json", metavar="FILE", default=None, help="also write the rows to FILE")
    args = ap.parse_args(argv)
    from benchmarks import device_check

    return device_check.main(["--moe"] + (["--json", args.json] if args.json else []),
                             prog="python -m benchmarks.device_check_moe")


if __name__ == "__main__":
    sys.exit(main())
