"""The next token, drawn on the GPU inside the captured decode step.

llama.cpp's default chain, as the host sampler (engine/runtime/sampling.py) runs it: repetition
penalty over the last ``last_n`` tokens, top-k, top-p and min-p on the distribution before
temperature, temperature, then one draw. temperature 0 is greedy (the lowest id among equal
maxima). The draw is the inverse of the candidates' cumulative distribution at a uniform number
that a counter-based hash makes from (seed, draw number), so the host and the GPU, given the same
logits and seed, pick the same ids.

Three launches, no host round trip: the penalty (one program, in place on the logits row);
up to ``SAMPLE_PARTS`` programs, each keeping the best FIRST ids of its part of the vocabulary
(runs of GROUP consecutive ids dealt in turn, so that the likeliest tokens, often neighbours,
spread over many parts); then one program that finds the best top_k, applies the chain and
writes the id where the next step reads it, into the history ring the penalty reads and into
the ring of ids the host reads back. The pick ranks at once every kept key at or above the
top_k-th best of the parts' bests (at or below the top_k-th best id). A part whose every kept
key is among the best top_k may hold more of them: the pick searches its whole part again
(rare, and exact either way). Serial rounds of block-wide maxima over every part's best 64, the
earlier design, took 50 us a draw at 151,936 ids on an H200; this takes 22 (greedy: 7).
Settings live in a device buffer (``state``), so one captured graph serves every
request. top-k between 1 and ``SAMPLE_TOP_K`` and a penalty window up to ``SAMPLE_LAST_N`` run
here; other settings take the host sampler.

``state`` (int32, spec/launch.py SAMPLE_STATE): float32 bits of temperature, top_p,
log(min_p) (-inf when off) and the penalty; then top_k, last_n, the seed's two halves, the
draws made, the tokens pushed into the history ring; from 16 the history ring, then the ring of
sampled ids.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from carve_kernels import trace
from spec.launch import (
    SAMPLE_KEYS,
    SAMPLE_LAST_N,
    SAMPLE_MERGE,
    SAMPLE_PARTS,
    SAMPLE_RING,
    SAMPLE_STATE,
    SAMPLE_TOP_K,
)

# slots of ``state``
TEMP, TOP_P, LOG_MIN_P, PENALTY, TOP_K, LAST_N, SEED_LO, SEED_HI, DRAWS, PUSHED = range(10)
HIST = 16
RING = HIST + SAMPLE_LAST_N
M32 = 0xFFFFFFFF


def served(params) -> bool:
    """Whether these sampling settings run on the GPU sampler (else the host sampler draws):
    greedy or top-k from 1 to SAMPLE_TOP_K, with a penalty window of at most SAMPLE_LAST_N."""
    window = params.repeat_penalty == 1.0 or params.repeat_last_n <= SAMPLE_LAST_N
    return window and (params.temperature == 0 or 1 <= params.top_k <= SAMPLE_TOP_K)


def _mix32(x: int) -> int:
    """A 32-bit integer hash (Chris Wellons' lowbias32); _mix in the kernel is the same."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def uniform(seed: int, draw: int) -> float:
    """The uniform number in [0, 1) of draw number ``draw`` under ``seed`` (24 bits: exact in
    float32)."""
    h = _mix32(_mix32(_mix32(draw & M32) ^ (seed & M32)) ^ ((seed >> 32) & M32))
    return (h >> 8) * (1.0 / 16777216.0)


def write_settings(state: torch.Tensor, params, seed: int, history: list[int]) -> None:
    """Settings, seed and the penalty's history into the device ``state`` (one host-to-device
    copy of a small tensor; at the start of a reply, never inside the decode loop)."""
    last_n = params.repeat_last_n if params.repeat_penalty != 1.0 else 0
    last_n = min(last_n, SAMPLE_LAST_N)
    hist = history[-last_n:] if last_n else []
    host = torch.zeros(HIST + len(hist), dtype=torch.int32)
    f = host[:4].view(torch.float32)
    f[TEMP] = params.temperature
    f[TOP_P] = params.top_p
    f[LOG_MIN_P] = math.log(params.min_p) if params.min_p > 0 else -math.inf
    f[PENALTY] = params.repeat_penalty
    host[TOP_K] = max(1, min(params.top_k, SAMPLE_TOP_K)) if params.top_k else SAMPLE_TOP_K
    host[LAST_N] = last_n
    host[SEED_LO] = _i32(seed & M32)
    host[SEED_HI] = _i32((seed >> 32) & M32)
    host[DRAWS] = 0
    host[PUSHED] = len(hist)
    # the ring holds the last `last_n` tokens in slots 0.., the next one going to pushed % last_n
    if hist:
        host[HIST:] = torch.tensor(hist, dtype=torch.int32)
    state[: host.numel()].copy_(host)


def _i32(u: int) -> int:
    return u - (1 << 32) if u >= 1 << 31 else u


def sampled(state: torch.Tensor) -> torch.Tensor:
    """The ring of sampled ids: draw d is at ``d % SAMPLE_RING``."""
    return state[RING:RING + SAMPLE_RING]


@triton.jit
def _mix(x):
    # x: int64 in [0, 2**32); products wrap mod 2**64, whose low 32 bits are the uint32 ones
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


MIN_KEY = tl.constexpr(-(2**63))  # below every key
FIRST = 8  # the best ids each first-pass program keeps when sampling (a power of two)
GROUP = 8  # consecutive ids a first-pass program takes at a time (32 bytes of logits)


@triton.jit
def _key(x, idx):
    """(value, id) as one int64 that orders by value, then by lower id first."""
    b = x.to(tl.int32, bitcast=True)
    b = tl.where(b < 0, b ^ 0x7FFFFFFF, b)
    return (b.to(tl.int64) << 32) + (0xFFFFFFFF - idx.to(tl.int64))


@triton.jit
def _penalize_kernel(logits_ptr, state_ptr, V, HIST_N: tl.constexpr):
    f = (state_ptr + 3).to(tl.pointer_type(tl.float32), bitcast=True)
    penalty = tl.load(f)
    penalty = tl.where(penalty > 0, penalty, 1.0)  # 0 in a zeroed (greedy) state: no penalty
    last_n = tl.load(state_ptr + 5)
    n = tl.minimum(tl.load(state_ptr + 9), last_n)
    r = tl.arange(0, HIST_N)
    m = r < n
    ids = tl.load(state_ptr + 16 + r, mask=m, other=0)
    m = m & (ids >= 0) & (ids < V)
    x = tl.load(logits_ptr + ids, mask=m, other=0.0)
    # a token seen twice gets the same value written twice: the penalty applies once
    y = tl.where(x > 0, x / penalty, x * penalty)
    tl.store(logits_ptr + ids, y, mask=m)


@triton.jit
def _rounds(state_ptr, K: tl.constexpr):
    """How many best candidates the chain needs: top_k (1..K), or 1 when greedy."""
    temp = tl.load(state_ptr.to(tl.pointer_type(tl.float32), bitcast=True))
    top_k = tl.minimum(tl.maximum(tl.load(state_ptr + 4), 1), K)
    return tl.where(temp > 0, top_k, 1)


@triton.jit
def _slice_keys(logits_ptr, pid, P, V, BS: tl.constexpr, G: tl.constexpr):
    """Part ``pid``'s keys: runs of G consecutive ids, one run in every P (ids past V: -inf)."""
    r = tl.arange(0, BS)
    idx = ((r // G) * P + pid) * G + r % G
    return _key(tl.load(logits_ptr + idx, mask=idx < V, other=float("-inf")), idx)


@triton.jit
def _top(key, n, K: tl.constexpr):
    """The best ``n`` (at most K) of ``key`` (any shape) as a [K] vector, best first (MIN_KEY
    after n): rounds of maxima."""
    key = tl.reshape(key, [key.numel])
    r = tl.arange(0, K)
    top = tl.full([K], MIN_KEY, tl.int64)
    for i in range(n):
        best = tl.max(key, axis=0)
        top = tl.where(r == i, best, top)
        key = tl.where(key == best, MIN_KEY, key)  # keys are unique: the id is in them
    return top


@triton.jit
def _best(key, n, out_ptr, K: tl.constexpr):
    """The best ``n`` (at most K) of ``key`` to out_ptr[0..n), best first."""
    r = tl.arange(0, K)
    tl.store(out_ptr + r, _top(key, n, K), mask=r < n)


@triton.jit
def _rank(x, src_ptr, stride, n, N: tl.constexpr, CH: tl.constexpr):
    """For each key of x [N]: how many of the ``n`` keys at src_ptr[j * stride] exceed it."""
    rank = tl.zeros([N], tl.int32)
    for j0 in tl.static_range(0, N, CH):
        j = j0 + tl.arange(0, CH)
        y = tl.load(src_ptr + j * stride, mask=j < n, other=MIN_KEY)
        rank += tl.sum((y[None, :] > x[:, None]).to(tl.int32), axis=1)
    return rank


@triton.jit
def _topk_part_kernel(logits_ptr, keys_ptr, state_ptr, V, P, trace_ptr, BS: tl.constexpr,
                      G: tl.constexpr, K: tl.constexpr, FIRST: tl.constexpr,
                      TRACE: tl.constexpr):
    # this part's best min(rounds, FIRST) keys, best first
    trace.wait(trace_ptr, False, TRACE)  # launched without PDL: no wait
    pid = tl.program_id(0)
    key = _slice_keys(logits_ptr, pid, P, V, BS, G)
    trace.stamp(trace_ptr, 2, TRACE)
    _best(key, tl.minimum(_rounds(state_ptr, K), FIRST), keys_ptr + pid * K, FIRST)
    trace.stamp(trace_ptr, 3, TRACE)


@triton.jit
def _pick_kernel(logits_ptr, keys_ptr, state_ptr, out_ptr, V, P, trace_ptr, BS: tl.constexpr,
                 G: tl.constexpr, PB: tl.constexpr, K: tl.constexpr, FIRST: tl.constexpr,
                 MERGE: tl.constexpr, MERGE_AT: tl.constexpr, HIST_N: tl.constexpr,
                 RING_N: tl.constexpr, TRACE: tl.constexpr):
    trace.wait(trace_ptr, False, TRACE)  # launched without PDL: no wait
    rounds = _rounds(state_ptr, K)
    first = tl.minimum(rounds, FIRST)
    pp = tl.arange(0, PB)
    s = tl.arange(0, FIRST)
    live = pp < P
    # each part's best `first`, sorted (slots past them may hold an earlier draw's keys: masked)
    blk = tl.load(keys_ptr + pp[:, None] * K + s[None, :],
                  mask=live[:, None] & (s[None, :] < first), other=MIN_KEY)
    r = tl.arange(0, K)
    m = tl.max(blk, axis=1)  # each part's best
    top = tl.where(r == 0, tl.max(m, axis=0), MIN_KEY)  # greedy: the best of the bests
    if rounds > 1:
        # L, the rounds-th best of the parts' bests, is at or below the rounds-th best id: the
        # candidates at or above it are ranked against each other at once (no serial rounds)
        rank_m = _rank(m, keys_ptr, K, P, PB, 64)
        low = tl.max(tl.where(live & (rank_m == rounds - 1), m, MIN_KEY), axis=0)
        sel = (blk >= low) & (blk > MIN_KEY)
        n = tl.sum(sel.to(tl.int32), axis=1)  # a prefix of each part's sorted best
        c = tl.sum(n, axis=0)
        at = (tl.cumsum(n, axis=0) - n)[:, None] + s[None, :]
        tl.store(keys_ptr + MERGE_AT + at, blk, mask=sel & (at < MERGE))
        tl.debug_barrier()
        mi = tl.arange(0, MERGE)
        cand = tl.load(keys_ptr + MERGE_AT + mi, mask=mi < c, other=MIN_KEY)
        rank = _rank(cand, keys_ptr + MERGE_AT, 1, c, MERGE, 64)
        top = tl.max(tl.where(rank[:, None] == r[None, :], cand[:, None], MIN_KEY), axis=0)
        if c > MERGE:  # too many to rank at once: rounds over the parts' best
            top = _top(blk, rounds, K)
        # a part whose every kept key is in the best `rounds` may hold more of them: its whole
        # slice is searched again, then every part's best are merged by rounds (rare: ids are
        # dealt to parts in runs of G, so the likeliest tokens spread over many parts)
        last = tl.max(tl.where(s[None, :] == first - 1, blk, MIN_KEY), axis=1)
        cut = tl.max(tl.where(r == rounds - 1, top, MIN_KEY), axis=0)
        again = live & (first < rounds) & (last >= cut) & (last > MIN_KEY)
        if tl.sum(again.to(tl.int32), axis=0) > 0:
            p = tl.min(tl.where(again, pp, PB), axis=0)
            while p < P:
                _best(_slice_keys(logits_ptr, p, P, V, BS, G), rounds, keys_ptr + p * K, K)
                p = tl.min(tl.where(again & (pp > p), pp, PB), axis=0)
            tl.debug_barrier()
            cnt = tl.where(again, rounds, first)
            full = tl.load(keys_ptr + pp[:, None] * K + r[None, :],
                           mask=live[:, None] & (r[None, :] < cnt[:, None]), other=MIN_KEY)
            top = _top(full, rounds, K)
    hi = (top >> 32).to(tl.int32)
    vals = tl.where(hi < 0, hi ^ 0x7FFFFFFF, hi).to(tl.float32, bitcast=True)
    vals = tl.where((r < rounds) & (top > MIN_KEY), vals, float("-inf"))
    ids = (0xFFFFFFFF - (top & 0xFFFFFFFF)).to(tl.int32)

    f = state_ptr.to(tl.pointer_type(tl.float32), bitcast=True)
    temp = tl.load(f)
    top_p = tl.load(f + 1)
    log_min_p = tl.load(f + 2)
    draw = tl.load(state_ptr + 8)
    v0 = tl.max(vals, axis=0)
    # top-p on the top-k candidates' softmax, before temperature: the shortest prefix whose
    # mass reaches top_p, at least one
    kept = r < rounds
    e = tl.where(kept, tl.exp(vals - v0), 0.0)
    probs = e / tl.sum(e, axis=0)
    cum = tl.cumsum(probs, axis=0)
    n = tl.minimum(tl.sum((kept & (cum < top_p)).to(tl.int32), axis=0) + 1, rounds)
    n = tl.where(top_p < 1.0, n, rounds)  # off: rounding must not cut the tail
    # min-p: p_i >= min_p * p_max, i.e. logit_i >= logit_max + log(min_p)
    n = tl.maximum(tl.sum(((r < n) & (vals >= v0 + log_min_p)).to(tl.int32), axis=0), 1)
    z = tl.where(r < n, vals / tl.where(temp > 0, temp, 1.0), float("-inf"))
    w = tl.exp(z - tl.max(z, axis=0))
    cdf = tl.cumsum(w / tl.sum(w, axis=0), axis=0)
    seed_lo = tl.load(state_ptr + 6).to(tl.int64) & 0xFFFFFFFF
    seed_hi = tl.load(state_ptr + 7).to(tl.int64) & 0xFFFFFFFF
    h = _mix(_mix(_mix(draw.to(tl.int64) & 0xFFFFFFFF) ^ seed_lo) ^ seed_hi)
    u = (h >> 8).to(tl.float32) * (1.0 / 16777216.0)
    pick = tl.minimum(tl.sum(((r < n) & (cdf <= u)).to(tl.int32), axis=0), n - 1)
    pick = tl.where(temp > 0, pick, 0)  # greedy: the best, lowest id among equals
    tok = tl.sum(tl.where(r == pick, ids, 0), axis=0)

    # logits that are not finite: -1 in the ring for the host to see, a valid id as the input
    trace.stamp(trace_ptr, 2, TRACE)
    bad = (v0 != v0) | (v0 == float("inf")) | (v0 == float("-inf"))
    tl.store(out_ptr, tl.where(bad, 0, tok).to(out_ptr.dtype.element_ty))
    tok = tl.where(bad, -1, tok)
    tl.store(state_ptr + 16 + HIST_N + draw % RING_N, tok)
    tl.store(state_ptr + 8, draw + 1)
    last_n = tl.load(state_ptr + 5)
    pushed = tl.load(state_ptr + 9)
    if last_n > 0:
        tl.store(state_ptr + 16 + pushed % last_n, tok)
        tl.store(state_ptr + 9, pushed + 1)
    trace.stamp(trace_ptr, 3, TRACE)


def sample(logits: torch.Tensor, state: torch.Tensor, keys: torch.Tensor,
           out: torch.Tensor, parts: int = SAMPLE_PARTS, first: int = FIRST) -> None:
    """Draw the next id from ``logits`` [n_vocab] (float32, penalized in place) under the
    settings in ``state`` into ``out`` [1] (any integer dtype), advancing the draw counter and
    the rings. ``keys`` [SAMPLE_KEYS] int64 is scratch. Allocates nothing. ``parts`` (at most
    SAMPLE_PARTS) and ``first`` (a power of two up to SAMPLE_TOP_K): the first pass's programs
    and the best ids each keeps, for measuring."""
    v = logits.shape[-1]
    if keys.numel() < SAMPLE_KEYS or state.numel() < SAMPLE_STATE:
        raise ValueError("sample: scratch or state smaller than spec/launch.py prices")
    parts, sl = partition(v, parts)
    bs = triton.next_power_of_2(sl)
    _penalize_kernel[(1,)](logits, state, v, HIST_N=SAMPLE_LAST_N)
    _topk_part_kernel[(parts,)](logits, keys, state, v, parts,
                                **trace.args("sample_topk", (parts,), keys), BS=bs, G=GROUP,
                                K=SAMPLE_TOP_K, FIRST=first, num_warps=4)
    _pick_kernel[(1,)](logits, keys, state, out, v, parts, **trace.args("sample_pick", (1,), out),
                       BS=bs, G=GROUP,
                       PB=triton.next_power_of_2(parts), K=SAMPLE_TOP_K, FIRST=first,
                       MERGE=SAMPLE_MERGE, MERGE_AT=SAMPLE_PARTS * SAMPLE_TOP_K,
                       HIST_N=SAMPLE_LAST_N, RING_N=SAMPLE_RING, num_warps=8)


def partition(n_vocab: int, most: int = SAMPLE_PARTS) -> tuple[int, int]:
    """(programs, ids per program) of the first pass: about 1,024 ids each, at most ``most``
    (and SAMPLE_PARTS) programs, each taking runs of GROUP consecutive ids in turn (151,936
    ids: 128 programs of 149 runs of 8)."""
    parts = max(1, min(most, SAMPLE_PARTS, -(-n_vocab // 1024)))
    return parts, -(-n_vocab // (parts * GROUP)) * GROUP


def apply_repeat_penalty(logits: torch.Tensor, history: list[int], penalty: float,
                         last_n: int) -> torch.Tensor:
    """llama.cpp's repetition penalty: each distinct token of the last ``last_n`` of
    ``history`` has its logit divided by ``penalty`` when > 0, multiplied when <= 0 (once,
    however often it occurred). Returns a new tensor."""
    if penalty == 1.0 or last_n == 0 or not history:
        return logits
    ids = torch.tensor(sorted(set(history[-last_n:])), dtype=torch.long, device=logits.device)
    ids = ids[(ids >= 0) & (ids < logits.shape[-1])]
    out = logits.clone()
    sel = out[ids]
    out[ids] = torch.where(sel > 0, sel / penalty, sel * penalty)
    return out


def sample_ref(logits: torch.Tensor, params, seed: int, history: list[int], draw: int) -> int:
    """The chain in plain torch, with the same draw: the reference twin of ``sample`` and the
    host sampler of engine/runtime/sampling.py. Any top-k, any penalty window."""
    x = apply_repeat_penalty(logits.detach().reshape(-1).float(), history,
                             params.repeat_penalty, params.repeat_last_n)
    if params.temperature == 0:
        return int(torch.argmax(x))  # the first of equal maxima
    vals, ids = torch.sort(x, descending=True, stable=True)  # equal values: lower id first
    if 0 < params.top_k < vals.numel():
        vals, ids = vals[:params.top_k], ids[:params.top_k]
    if params.top_p < 1.0:  # the shortest prefix whose mass reaches top_p, at least one
        cum = torch.cumsum(torch.softmax(vals, dim=-1), dim=-1)
        n = min(int((cum < params.top_p).sum()) + 1, vals.numel())
        vals, ids = vals[:n], ids[:n]
    if params.min_p > 0.0:  # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p)
        n = int((vals >= vals[0] + math.log(params.min_p)).sum())
        vals, ids = vals[: max(n, 1)], ids[: max(n, 1)]
    cdf = torch.cumsum(torch.softmax(vals / params.temperature, dim=-1), dim=-1)
    i = min(int((cdf <= uniform(seed, draw)).sum()), vals.numel() - 1)
    return int(ids[i])
