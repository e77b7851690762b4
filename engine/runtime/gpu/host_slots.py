"""The GPU-side places of a stage's host experts (gpu/host.py): the expert-cache slots a host
layer keeps its recently routed experts in (`SlotCache`, its share of the Layout's span
`expert_cache`) and the staging span a layer's routed experts are copied into for one call
(`Stream`, the span `expert_stream`), neighbours in one copy (`expert_runs`)."""

from __future__ import annotations

from collections import OrderedDict

import torch

from engine.planning.arena import align_up
from engine.runtime.models import ops


class SlotCache:
    """One host layer's share of the stage's expert-cache slots: per expert matrix a region
    of ``n`` slots on the device, [n * rows, bytes per row] like a resident expert tensor of n
    experts, and which expert each slot holds (least recently used first)."""

    def __init__(self, region: torch.Tensor, n: int, mats: list[ops.QExperts]) -> None:
        self.n, self.mats = n, mats
        self.views, self.slices = [], []
        off = 0
        for m in mats:
            per = m.raw.numel() // m.n_expert  # one expert's bytes
            self.views.append(region[off:off + n * per].view(n * m.rows, -1))
            self.slices.append(per)
            off += align_up(n * per)
        assert off <= region.numel(), "the priced slots hold every matrix's slices"
        self.held: OrderedDict[int, int] = OrderedDict()  # expert -> slot, oldest use first
        self.free = list(range(n - 1, -1, -1))
        self.hits = self.misses = self.copied = 0
        self.seeded = 0  # bytes copied in on the device from the staging span (`seed`)

    def place(self, experts: list[int]) -> dict[int, int] | None:
        """Slots for ``experts`` (distinct), copying in the ones not held; None when the share
        cannot hold them all at once."""
        if len(experts) > self.n:
            return None
        for e in experts:
            if e in self.held:
                self.held.move_to_end(e)
                self.hits += 1
        for e in experts:
            if e in self.held:
                continue
            # the oldest held expert is not one of these: they were all just moved to the end
            slot = self.free.pop() if self.free else self.held.popitem(last=False)[1]
            for m, view, per in zip(self.mats, self.views, self.slices, strict=True):
                dst = view.view(-1)[slot * per:(slot + 1) * per]
                dst.copy_(m.raw[e * per:(e + 1) * per], non_blocking=True)
                self.copied += per
            self.held[e] = slot
            self.misses += 1
        return {e: self.held[e] for e in experts}

    def seed(self, staged: list[torch.Tensor], rows: list[list[int]]) -> None:
        """After a chunk's rows ran on the staging span, which then holds every expert of the
        layer (``staged``: its views, per matrix [n_expert * rows, bytes per row]): hold the
        ``n`` experts the rows chose last (a row's later choices after its earlier ones, the
        last row's last), as least-recently-used placement would after the rows one by one.
        The ones not held yet are copied from the span on the device: nothing crosses PCIe,
        and the first decode tokens of a reply find the experts its prompt ended on."""
        recent: OrderedDict[int, None] = OrderedDict()
        for row in rows:
            for e in row:
                recent.pop(e, None)
                recent[e] = None
        want = list(recent)[-self.n:]
        for e in want:  # the held ones to keep are newer than every other held one
            if e in self.held:
                self.held.move_to_end(e)
        for e in want:
            if e in self.held:
                continue
            # the oldest held is not wanted: |wanted not held| <= free + |held not wanted|
            slot = self.free.pop() if self.free else self.held.popitem(last=False)[1]
            for src, view, per in zip(staged, self.views, self.slices, strict=True):
                view.view(-1)[slot * per:(slot + 1) * per].copy_(
                    src.view(-1)[e * per:(e + 1) * per], non_blocking=True)
                self.seeded += per
            self.held[e] = slot
        for e in want:
            self.held.move_to_end(e)


class Stream:
    """The staging span a host layer's experts are copied into to run on the GPU: per matrix
    its whole tensor's room, [n_expert * rows, bytes per row] like the resident tensor, then
    (gpt-oss) per matrix its biases' room, float32 [n_expert * rows] like a resident bias."""

    def __init__(self, span: torch.Tensor, mats: list[ops.QExperts],
                 biases: list[torch.Tensor] | None = None) -> None:
        self.mats, self.views, self.slices = mats, [], []
        # (the host bias bytes, their float32 view in the span) per matrix; [] without biases
        self.bias_pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        off = 0
        for m in mats:
            self.views.append(span[off:off + m.raw.numel()].view(m.n_expert * m.rows, -1))
            self.slices.append(m.raw.numel() // m.n_expert)
            off += align_up(m.raw.numel())
        for raw in biases or []:
            self.bias_pairs.append((raw, span[off:off + raw.numel()].view(torch.float32)))
            off += align_up(raw.numel())
        assert off <= span.numel(), "the priced span holds the layer's experts and biases"
        self.n = mats[0].n_expert

    @property
    def biases(self) -> list[torch.Tensor] | None:
        """The biases the kernels read, in the span (None: the experts have none)."""
        return [v for _, v in self.bias_pairs] or None

    def fill(self, experts: list[int] | None) -> int:
        """Copy ``experts`` (sorted, distinct; None: all of them) in at their own places, their
        bias rows too, a run of neighbouring experts in one copy per tensor; returns bytes
        copied. The span's other experts keep whatever they held: the kernels read only the
        experts the rows chose."""
        runs = [(0, self.n)] if experts is None else expert_runs(experts)
        done = 0
        parts = [(m.raw, view.view(-1), per)
                 for m, view, per in zip(self.mats, self.views, self.slices, strict=True)]
        parts += [(raw, dst.view(torch.uint8), raw.numel() // self.n)
                  for raw, dst in self.bias_pairs]
        for src, dst, per in parts:
            for lo, hi in runs:
                dst[lo * per:hi * per].copy_(src[lo * per:hi * per], non_blocking=True)
                done += (hi - lo) * per
        return done


def expert_runs(experts: list[int]) -> list[tuple[int, int]]:
    """Sorted distinct expert ids as half-open runs of neighbours: [0, 1, 2, 5] -> [(0, 3),
    (5, 6)]."""
    runs: list[tuple[int, int]] = []
    for e in experts:
        if runs and runs[-1][1] == e:
            runs[-1] = (runs[-1][0], e + 1)
        else:
            runs.append((e, e + 1))
    return runs
