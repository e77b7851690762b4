"""The next token, drawn on the GPU inside the captured decode step.

llama.cpp's default chain, as the host sampler (engine/runtime/sampling.py) runs it: repetition
penalty over the last ``last_n`` tokens, top-k, top-p and min-p on the distribution before
temperature, temperature, then one draw. temperature 0 is greedy (the lowest id among equal
maxima). The draw is the inverse of the candidates' cumulative distribution at a uniform number
that a counter-based hash makes from (seed, draw number), so the host and the GPU, given the same
logits and seed, pick the same ids.

Three launches, no host round trip: the penalty (one program, in place on the logits row),
each of ``SAMPLE_PARTS`` programs sorting its slice of the vocabulary and keeping its best
``SAMPLE_TOP_K``, then one program that sorts those, applies the chain and writes the id where
the next step reads it, into the history ring the penalty reads and into the ring of ids the host
reads back. Settings live in a device buffer (``state``), so one captured graph serves every
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

from spec.launch import SAMPLE_LAST_N, SAMPLE_PARTS, SAMPLE_RING, SAMPLE_STATE, SAMPLE_TOP_K

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
def _topk_part_kernel(logits_ptr, keys_ptr, state_ptr, V, SLICE, BS: tl.constexpr,
                      K: tl.constexpr):
    # this program's slice of the vocabulary: its best `rounds` keys, best first
    pid = tl.program_id(0)
    r = tl.arange(0, BS)
    idx = pid * SLICE + r
    m = (r < SLICE) & (idx < V)
    key = _key(tl.load(logits_ptr + idx, mask=m, other=float("-inf")), idx)
    for i in range(_rounds(state_ptr, K)):
        best = tl.max(key, axis=0)
        tl.store(keys_ptr + pid * K + i, best)
        key = tl.where(key == best, MIN_KEY, key)  # keys are unique: the id is in them


@triton.jit
def _pick_kernel(keys_ptr, state_ptr, out_ptr, P, PB: tl.constexpr, K: tl.constexpr,
                 HIST_N: tl.constexpr, RING_N: tl.constexpr):
    rounds = _rounds(state_ptr, K)
    c = tl.arange(0, PB * K)
    keys = tl.load(keys_ptr + c, mask=(c // K < P) & (c % K < rounds), other=MIN_KEY)
    r = tl.arange(0, K)
    top = tl.full([K], MIN_KEY, tl.int64)
    for i in range(rounds):  # the best `rounds` of every part's best, best first
        best = tl.max(keys, axis=0)
        top = tl.where(r == i, best, top)
        keys = tl.where(keys == best, MIN_KEY, keys)
    hi = (top >> 32).to(tl.int32)
    vals = tl.where(hi < 0, hi ^ 0x7FFFFFFF, hi).to(tl.float32, bitcast=True)
    vals = tl.where(r < rounds, vals, float("-inf"))
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


def sample(logits: torch.Tensor, state: torch.Tensor, keys: torch.Tensor,
           out: torch.Tensor) -> None:
    """Draw the next id from ``logits`` [n_vocab] (float32, penalized in place) under the
    settings in ``state`` into ``out`` [1] (any integer dtype), advancing the draw counter and
    the rings. ``keys`` [SAMPLE_PARTS * SAMPLE_TOP_K] int64 is scratch. Allocates nothing."""
    v = logits.shape[-1]
    if keys.numel() < SAMPLE_PARTS * SAMPLE_TOP_K or state.numel() < SAMPLE_STATE:
        raise ValueError("sample: scratch or state smaller than spec/launch.py prices")
    parts, sl = partition(v)
    _penalize_kernel[(1,)](logits, state, v, HIST_N=SAMPLE_LAST_N)
    _topk_part_kernel[(parts,)](logits, keys, state, v, sl, BS=triton.next_power_of_2(sl),
                                K=SAMPLE_TOP_K, num_warps=4)
    _pick_kernel[(1,)](keys, state, out, parts, PB=triton.next_power_of_2(parts),
                       K=SAMPLE_TOP_K, HIST_N=SAMPLE_LAST_N, RING_N=SAMPLE_RING, num_warps=8)


def partition(n_vocab: int) -> tuple[int, int]:
    """(programs, ids per program) of the first pass: about 1,024 ids each, at most
    SAMPLE_PARTS programs (151,936 ids: 128 of 1,187)."""
    parts = max(1, min(SAMPLE_PARTS, -(-n_vocab // 1024)))
    return parts, -(-n_vocab // parts)


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
