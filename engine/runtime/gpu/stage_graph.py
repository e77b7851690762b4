"""A GPU stage's decode step and its CUDA graph (``GpuStage`` mixes it in): one token through
the stage's layers, the head and the GPU sampler, captured once and replayed at every depth
(the graph reads the token and the position from device buffers); a stage with experts in host
memory captures the stretches between those layers and runs their experts eagerly in between.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from carve_kernels import sample
from engine.runtime.gpu.layers import GEMV_ROWS, Experts, Ffn
from engine.runtime.models import cpu_native


def graph_rows(n: int, full: int) -> int:
    """The rows a prefill chunk of n runs as through the prefill graphs: the next power of two
    from GEMV_ROWS (chunks up to it take the GEMV path), at most the plan's full chunk. A
    chunk of any length then replays one of a few graphs, all captured at the load's
    warm-up."""
    if n >= full:
        return full
    return min(full, max(GEMV_ROWS, 1 << (n - 1).bit_length()))


class DecodeGraph:
    """GpuStage's decode step, its capture and replay (they read the stage's buffers, layers
    and its ``forward``, ``_rows``, ``_embed``, ``_attention``, ``_ffn``, ``_add_norm``,
    ``_add_output``, ``_route``, ``_experts_out`` and ``head``)."""

    def decode_step(self) -> None:
        """One token: buf.tokens[0] at buf.positions[0]; leaves logits (last stage) and, on the
        last stage, the next id drawn by the GPU sampler under the settings in its state
        (greedy until a reply writes others) in ``next_id``; advances the device position."""
        self.forward(1, None)
        if self.last:
            self.sample_next()
        self.buf["positions"][:1] += 1

    # buffers written once at load (the YaRN frequencies, the IQ types' value tables and the
    # scan's flags): `clear_buffers` leaves them as they are
    LOADED_BUFFERS = frozenset({"rope_freqs", "lookup"})

    def clear_buffers(self) -> None:
        """Zero the working buffers (ids, counts, sort places, activations, sampler state): in
        range for any kernel that reads them as indices (gpu/precompile.py's dry pass)."""
        for name, t in self.buf.items():
            if name not in self.LOADED_BUFFERS:
                t.zero_()

    def decode_eager(self) -> None:
        """One decode step as `capture` runs it before capturing (host layers' pieces too)."""
        for _, run in (self._decode_pieces() if self.eager_hosts() else
                       [(True, self.decode_step)]):
            run()

    def sample_next(self) -> None:
        """Draw the next id from buf.logits[0] into ``next_id`` (carve_kernels/sample.py); one stage
        feeds it back as the next input without leaving the graph."""
        sample.sample(self.buf["logits"][0], self.samp_state, self.samp_keys, self.next_id)
        if self.first:
            self.buf["tokens"][:1].copy_(self.next_id)

    def capture(self) -> None:
        """Capture decode_step in a CUDA graph (after one eager warm-up that compiles kernels).
        On the CPU (interpreter) there is no graph: replay runs decode_step eagerly. A stage
        with host layers (their experts wait on the host) captures the stretches between them,
        one graph each, and replay runs the host layers' experts eagerly in between (on the
        CPU the same pieces, all eager)."""
        pieces = self._decode_pieces() if self.eager_hosts() else []
        # the host layers whose experts a replay reads in place (it counts their bytes)
        self.in_place_hosts = [h for h in self._hosts() if h.in_place is not None]
        # the host layers split between CPU and GPU, which replay answers after the graph's
        # launch (on the CPU, eager, each is answered as it runs). They read in place, so a
        # stage with one has no host layer waiting between graphs: "both" takes no cache
        # slots, and its arenas are either pinned (every host layer in place) or not (none)
        self.split_hosts = [h for h in self._hosts() if h.split]
        assert not (pieces and self.split_hosts), "split host layers in a stage of pieces"
        self.split_server = self._split_server()
        if not self.on_cuda:
            self.pieces = [run for _, run in pieces]
            return
        s = torch.cuda.Stream(self.device)
        s.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(s):
            self.decode_eager()
        torch.cuda.current_stream(self.device).wait_stream(s)
        if not pieces:
            self.graph = torch.cuda.CUDAGraph()
            # torch.cuda.graph's default capture stream is created once, on the first device
            # that captures; a second GPU's stage needs a stream of its own device
            with torch.cuda.graph(self.graph, stream=torch.cuda.Stream(self.device)):
                self.decode_step()
            return
        self.pieces = []
        for graphable, run in pieces:
            if graphable:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, stream=torch.cuda.Stream(self.device)):
                    run()
                self._graphs.append(g)
                run = g.replay
            self.pieces.append(run)

    def graphs_chunks(self) -> bool:
        """Whether this stage runs prefill chunks through CUDA graphs (``RunnerOptions.
        prefill_graph``, the default, on a GPU, with no host layers: their experts wait on
        the host); the pipeline then pads each chunk to ``graph_rows``."""
        return self.prefill_graph and self.on_cuda and not self._hosts()

    def forward_chunk(self, n: int, pos0: int, head: bool = True,
                      check: Callable[[int, torch.Tensor], None] | None = None,
                      real: int | None = None) -> None:
        """A prefill chunk of n rows, the first ``real`` of them the prompt's (all of them
        unless given; the rest padding that repeats the last row's token at its position:
        the KV store keeps none of it): ``forward(n, pos0, check=check)``, then the head of
        the last real rows. With the prefill graphs on (``graphs_chunks``) a chunk of
        ``graph_rows`` rows runs its layers through a CUDA graph of its length, the head
        after it: the first such chunk (the load's warm-up runs each length) runs eagerly,
        which compiles its kernels and is its result, and is then captured (capturing runs
        nothing); later ones replay the capture. Every launch of a chunk reads its tokens and
        positions on the device (prefill attention its first position too), so one capture
        serves a chunk at any position. The NaN hunt (``check``), precompile's dry pass and
        stages with host layers run eagerly."""
        real = n if real is None else real
        if (not self.graphs_chunks() or check is not None or self.dry_runs is not None
                or n != graph_rows(n, self.buf["positions"].shape[0])):
            self.forward(n, pos0, head=False, check=check)
        elif (g := self._prefill_graphs.get(n)) is not None:
            g.replay()
        else:  # the first chunk of this length: eagerly (its result), then captured
            self.forward(n, pos0, head=False)
            if self._prefill_stream is None:
                # one capture stream for every chunk graph: a stream's first GEMM makes its
                # cuBLAS workspace, once
                self._prefill_stream = torch.cuda.Stream(self.device)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=self._prefill_stream):
                self.forward(n, pos0, head=False)
            self._prefill_graphs[n] = g
        if self.last and head:
            self.head_last(real)

    def replay_prefill_graphs(self) -> None:
        """Replay each prefill graph once on what its buffers hold (the load's last replays:
        a graph's first launch uploads it)."""
        for g in self._prefill_graphs.values():
            g.replay()

    def _decode_pieces(self) -> list[tuple[bool, Callable[[], None]]]:
        """decode_step as pieces run in order, each (graphable, run): the stretch up to each
        host layer's routing, that layer's experts (eager: they wait on the host), and the
        stretch after the last one through the head, the sampler and the position."""
        eager = self.eager_hosts()
        hosts = [p for p, la in enumerate(self.layers) if la.index in eager]
        out: list[tuple[bool, Callable[[], None]]] = []
        start = 0
        for p in hosts:
            out.append((True, lambda s=start, e=p: self._decode_span(s, e, True)))
            out.append((False, lambda e=p: self._experts_out(self.layers[e].ffn, self._rows(1))))
            start = p + 1
        out.append((True, lambda s=start: self._decode_span(s, len(self.layers), False)))
        return out

    def _split_server(self) -> cpu_native.StepServer | None:
        """The split layers' answers in one call of the native kernel (`answer_split`), where
        it computes every one of them and the GPU's graph raises their tickets, unless
        ``CARVE_SPLIT_SERVE=python`` asks for the per-layer path (`HostExperts.serve`)."""
        hosts = self.split_hosts
        if (not hosts or not self.on_cuda or any(h.native is None for h in hosts)
                or os.environ.get("CARVE_SPLIT_SERVE", "native").strip().lower() == "python"):
            return None
        xf = torch.empty(self.hp.n_embd, dtype=torch.float32)
        return cpu_native.StepServer(hosts[0].native.lib, [h.serve_layer(xf) for h in hosts],
                                     [xf], lambda i, w, c: hosts[i].add_times(w, c))

    def answer_split(self) -> None:
        """The host's answers to a launched decode graph's split layers, in order (their CPU
        share of the experts, while the GPU runs the rest): the native kernel's `StepServer`
        where there is one, else layer by layer; where one fails, the tickets still
        outstanding are answered first (`_drain_split`)."""
        try:
            if self.split_server is not None:
                self.split_server.serve()
                self.split_hosts[0].check_answered()
            else:
                for h in self.split_hosts:
                    h.serve()
        except BaseException:
            self._drain_split()
            raise

    def _drain_split(self) -> None:
        """After a replay that failed on the host: answer every ticket its split layers still
        raise (their sums NaN) until the stream is done, so the GPU neither waits out its spin
        budget nor falls out of step with the host, then clear the words."""
        if not self.split_hosts:
            return
        h = self.split_hosts[0]
        flags, y = h.flags.numpy(), h.y  # (one buffer a stage)
        stream = torch.cuda.current_stream(self.device) if self.on_cuda else None
        while stream is not None and not stream.query():
            if flags[0] != flags[1]:
                y.fill_(float("nan"))
                flags[1] = flags[0]
        flags[:] = 0

    def _decode_span(self, s: int, e: int, route: bool) -> None:
        """Decode's layers [s, e) of this stage (as `forward(1, None)` runs them); ``route``:
        then layer e up to its routing; else the stage's end, the head, the sampler and the
        position (as `decode_step`)."""
        a = self._rows(1)
        if s == 0 and self.first:
            self._embed(a)
        prev: Ffn | Experts | None = self.layers[s - 1].ffn if s else None
        for layer in self.layers[s:e]:
            self._attention(layer.attn, a, None, prev)
            self._ffn(layer, a)
            prev = layer.ffn
        if route:
            layer = self.layers[e]
            self._attention(layer.attn, a, None, prev)
            self._add_norm(a, layer.attn.post_norm, layer.ffn.norm, layer.ffn.xq)
            self._route(layer.ffn, a)
            return
        if prev is not None:
            self._add_output(a, prev)
        if self.last:
            self.head(0, 1)
            self.sample_next()
        self.buf["positions"][:1] += 1

    def replay(self) -> None:
        """One decode step: the captured graph (or its pieces) launched, then the host's
        answers to its split layers (`answer_split`)."""
        if self.pieces:
            for run in self.pieces:
                run()
        elif self.graph is None:
            self.decode_step()
            return
        else:
            self.graph.replay()
            self.answer_split()
        for h in self.in_place_hosts:  # what the graph's in-place reads of host experts moved
            h.moved += h.row_bytes
