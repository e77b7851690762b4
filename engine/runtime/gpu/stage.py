"""A GPU stage: layers [lb, le) of a model on one device, run with the Triton kernels of
``carve_kernels/`` on the allocations of its DeviceLayout and nothing else. The llama family (llama,
mistral, qwen2 with q/k/v biases, qwen3 with per-head q/k RMSNorm) and gemma3 (embeddings
scaled by sqrt(n_embd), q/k norms, sandwich norms, GeGLU, sliding-window layers with their own
RoPE base) follow engine/runtime/models/ step for step.

Every tensor the stage touches is a view into one of the Layout's arenas (weights, globals, KV,
``buf.*`` activation buffers, ``dq.*`` dequant cache), so the memory it holds is the priced
memory. Decode runs one token through preallocated buffers and is captured once in a CUDA graph
that reads the token id and the position from device buffers; prefill runs in chunks of the
priced size with the dequant cache feeding bf16 GEMMs. Which kernel multiplies by each matrix
is decided once at load (engine/runtime/gpu/matrices.py); `GpuStage.forward` runs a layer as
its steps, attention then FFN, along those decisions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from carve_kernels import lowbit_blocks, norm, q8x, quant_matmul, scale_scan, t_layout
from carve_kernels.dequant import dequantize
from engine.gguf.hparams import rope_per_pair
from engine.planning.carve import is_expert
from engine.planning.host import CPU_PREFIX
from engine.runtime.gpu.host import host_experts, host_layers
from engine.runtime.gpu.host_share import split_shares
from engine.runtime.gpu.layers import GEMV_ROWS, Ffn, Layer, launch_signature
from engine.runtime.gpu.matrices import LayerBuilder
from engine.runtime.gpu.matrices import packed as packed_matrix
from engine.runtime.gpu.rows import Rows
from engine.runtime.gpu.stage_attn import AttentionLayers
from engine.runtime.gpu.stage_dense import DenseLayers
from engine.runtime.gpu.stage_graph import DecodeGraph
from engine.runtime.gpu.stage_moe import MoeLayers
from engine.runtime.models.layers import _linear_scale, factors_name, global_freqs
from engine.runtime.options import RunnerOptions
from spec import quant_types as qt
from spec.errors import CarveError
from spec.runners import TRITON_ARCHS

DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16,
          "i64": torch.int64, "i32": torch.int32, "uint8": torch.uint8}


def new_arena(nbytes: int, device: torch.device) -> torch.Tensor:
    """The one place the GPU runner allocates device memory (tests wrap it to watch or fail)."""
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def allocate(dl: Any, device: torch.device | str, arenas: list[torch.Tensor] | None = None,
             spans: dict[str, torch.Tensor] | None = None,
             ) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """One uint8 allocation per Arena of the DeviceLayout; every span becomes a view into it
    (typed for float spans, raw bytes for GGUF-typed weights). ``arenas``/``spans``: the
    caller's containers, filled as it goes, so a failure midway leaves the caller holding
    (and able to drop) every arena already made."""
    arenas = [] if arenas is None else arenas
    spans = {} if spans is None else spans
    device = torch.device(device)
    for a in dl.arenas:
        buf = new_arena(a.nbytes, device)
        arenas.append(buf)
        for s in a.spans:
            raw = buf[s.offset:s.offset + s.nbytes]
            dt = DTYPES.get(s.dtype)
            if dt is not None and s.purpose != "weights" and s.purpose != "globals":
                raw = raw.view(dt).view(s.shape)
            spans[s.name] = raw
    return arenas, spans


class GpuStage(AttentionLayers, DenseLayers, MoeLayers, DecodeGraph):
    def __init__(self, hp: Any, model: Any, dl: Any, spans: dict[str, torch.Tensor],
                 device: torch.device | str, ctx: int, chunk: int,
                 options: RunnerOptions = RunnerOptions(), host_compute: str = "gpu",
                 host_pinned: bool = False) -> None:
        if hp.arch not in TRITON_ARCHS:  # with their experts, where a file has them
            raise CarveError(f"the GPU stage runs {', '.join(TRITON_ARCHS)} models; {hp.arch} "
                             "runs on the torch engine (CARVE_RUNNER=torch)")
        # the global layers' RoPE: a frequency per pair in buf.rope_freqs (YaRN's, every layer;
        # the file's rope_freqs factors applied, with any linear scale), or the base and the
        # linear scale; the CPU engine's error for other kinds
        freqs = rope_per_pair(hp)
        self.rope_scale = 1.0 if freqs else 1.0 / _linear_scale(hp)
        self.hp, self.model, self.spans = hp, model, spans
        self.device = torch.device(device)
        self.on_cuda = self.device.type == "cuda"  # else the CPU under TRITON_INTERPRET=1
        self.pdl = options.pdl  # every launch passes it to the kernel (carve_kernels/pdl.py)
        self.neox = hp.rope_style == "neox"
        self.lb, self.le = dl.layers
        self.first, self.last = dl.first, dl.last
        self.ctx, self.chunk = ctx, chunk
        self.graph: torch.cuda.CUDAGraph | None = None
        # with host layers: decode's pieces (graph replays and eager host layers) and graphs
        self.pieces: list[Callable[[], None]] = []
        self._graphs: list[torch.cuda.CUDAGraph] = []
        self.in_place_hosts: list = []  # host layers decode reads in place (set by capture)
        # the host layers split between CPU and GPU, in order: replay answers them (capture)
        self.split_hosts: list = []
        self.split_server = None  # their answers in one native call (stage_graph.py)
        # prefill chunks through a CUDA graph of each padded length, the head outside them
        # (CARVE_PREFILL_GRAPH; stage_graph.py forward_chunk)
        self.prefill_graph = options.prefill_graph
        self._prefill_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._prefill_stream: torch.cuda.Stream | None = None
        # decode's L2 prefetch (CARVE_L2_PREFETCH, bytes a layer; 0: off) from a stream of
        # its own: a dense layer's gate/up, and under a MoE layer's experts the next layer's
        # attention matrices and router (stage_dense.py _l2_ffn, _l2_next)
        self.l2_bytes = options.l2_prefetch << 20 if self.on_cuda else 0
        self.l2_last = "l2_last" in options.trials
        self._l2_stream: torch.cuda.Stream | None = None
        self._buffers(spans)
        self.xq = self._int8_x(options)
        # the layers whose experts the plan keeps in host memory (engine/runtime/gpu/host.py)
        self.host_layers = host_layers(dl)
        build = LayerBuilder(hp, model, spans, ctx, self.on_cuda, options, self.xq,
                             self.rope_scale, self._freqs() if freqs else (None, 1.0),
                             frozenset(self.host_layers if host_compute == "cpu" else ()))
        self.tmats = build.tmats  # the matrices in the T layout (fill_dequant_cache repacks)
        self.layers: list[Layer] = [build.layer(i) for i in range(self.lb, self.le)]
        # during a precompile's dry pass (GpuPipeline.dry_pass): which layers forward runs
        self.dry_runs: list[bool] | None = None
        # host_pinned: the host arenas are registered with the driver, so decode's kernels can
        # read a host layer's experts where they lie (host_compute "gpu", no cache slots);
        # under the interpreter they read host memory anyway
        hosts = host_experts(hp, model, spans, sorted(self.host_layers), host_compute,
                             host_pinned or not self.on_cuda)
        for layer in self.layers:
            if layer.index in hosts:
                layer.ffn.host = hosts[layer.index]
        # host_compute "both": decode's rows split between the CPU and the GPU
        self.cpu_shares = split_shares(hp, list(hosts.values()), self.device)
        # the embedding (first stage); the output norm, projection and its int8 x (last stage)
        self.token_embd = packed_matrix(model, spans, "token_embd.weight") if self.first else None
        self.output_norm, self.output, self.xq_out = build.head() if self.last else (None,) * 3

    def _buffers(self, spans: dict[str, torch.Tensor]) -> None:
        self.buf = {n[4:]: t for n, t in spans.items() if n.startswith("buf.")}
        self.act = self.buf["hidden"].dtype
        self.q_w = self.hp.n_head * self.hp.head_dim
        self.kv_w = self.hp.n_head_kv * self.hp.head_dim
        self.attn_ws = (self.buf["attn_partial"], self.buf["attn_lse"])
        self.attn_count = self.buf.get("attn_count")
        if self.attn_count is not None:
            self.attn_count.zero_()  # the decode kernel leaves it at zero after each use
        # the sampled id lives in the last slot of buf.tokens: nothing outside the Layout
        self.next_id = self.buf["tokens"][-1:] if self.last else None
        self.samp_state, self.samp_keys = self.buf.get("samp_state"), self.buf.get("samp_keys")
        if self.samp_state is not None:
            self.samp_state.zero_()  # greedy, no penalty, until a reply writes its settings
        self.t_part, self.t_count = self.buf.get("t_part"), self.buf.get("t_count")
        if self.t_count is not None:
            self.t_count.zero_()  # the T GEMVs leave their counters at zero after each use
        if "moe_count" in self.buf:
            self.buf["moe_count"].zero_()  # so do the MoE down GEMVs (stage_moe.py)
        # the IQ types' value tables, in the Layout (carve_kernels/lowbit_blocks.py), and the flags
        # of the load's scan for non-finite scales
        lookup = self.buf.get("lookup")
        self.scan_flags = None if lookup is None else lowbit_blocks.install_tables(lookup)

    def _freqs(self) -> tuple[torch.Tensor, float]:
        # the CPU engine's frequencies of the global layers (engine/runtime/models/layers.py),
        # from the file's factors where it has them (llama-3.1's rope_freqs, or LongRoPE's set
        # for this context; read back from their span: a few hundred bytes), written once
        # into their priced buffer, and the cos/sin scale
        factors, name = None, factors_name(self.hp, self.ctx)
        if name is not None and self.hp.rope_scaling != "yarn":
            t = self.model.tensor(name)
            factors = dequantize(self.spans[name].reshape(-1)[:t.nbytes].cpu(), t.ggml_type,
                                 t.shape)
        f, mscale = global_freqs(self.hp, factors, name or "")
        dst = self.buf["rope_freqs"]
        dst.copy_(f)  # straight from the host: no device temporary outside the Layout
        return dst, mscale

    def _int8_x(self, options: RunnerOptions) -> tuple | None:
        """Decode's int8 copies of the T GEMVs' inputs (a normed row, the GLU output) for their
        dp4a bodies (llama.cpp's activation rounding; Qwen2-7B tg128 324.6 -> 438.1 t/s on an
        H200). None (bf16 x) with RunnerOptions.q8x off, for gemma3's sandwich norms, and for
        widths that are not whole 32-value blocks."""
        hp, b = self.hp, self.buf
        if (not options.q8x or "xq" not in b or hp.sandwich_norm or hp.n_embd % 32
                or hp.n_ff % 32):
            return None
        # a MoE layer's k routed GLU outputs (the routed experts' down GEMVs, gpu/stage_moe.py)
        routed = hp.n_expert_used * hp.n_ff_exp if hp.n_expert else 0
        return (q8x.buffers(b["xq"], b["xq_ds"], hp.n_embd),
                q8x.buffers(b["xq"], b["xq_ds"], hp.n_ff, hp.n_embd),
                q8x.buffers(b["xq"], b["xq_ds"], routed, hp.n_embd)
                if routed and routed % 32 == 0 else None)

    def fill_dequant_cache(self, dry: bool = False) -> int:
        """Dequantize every matrix that has a ``dq.`` span into it, and repack the T-layout
        matrices on the way (their GGUF bytes go through the still-empty dq span, so no
        memory outside the Layout); returns matrices cached. Runs once, before any forward,
        after the scan for non-finite scales (`check_scales`). ``dry``: the same kernel
        launches, but no byte moves into a weight span (the repack is left out): the
        precompile's dry pass (gpu/precompile.py) records the variants, and a launch that
        does run writes only the dq spans and a scratch buffer, which the real fill rewrites."""
        self.check_scales()
        n = 0
        seen = set()  # a dry pass: the launches of each kind of matrix once
        for name, dst in self.spans.items():
            if not name.startswith("dq."):
                continue
            w, t = packed_matrix(self.model, self.spans, name[3:])
            rows = w.shape[0]
            if dry:
                kind = (name[3:] in self.tmats, t, launch_signature(w), launch_signature(dst))
                if kind in seen:
                    continue
                seen.add(kind)
            if name[3:] in self.tmats:
                if not dry:
                    g = dst.view(torch.uint8).reshape(-1)[: w.numel()].view(w.shape)
                    g.copy_(w)
                    t_layout.repack(g, t, out=self.spans[name[3:]])
                self._dequant_t(name[3:], t, rows, dst)
            else:
                quant_matmul.dequantize(w, t, dst.dtype, out=dst.view(rows, -1), use_pdl=self.pdl)
            n += 1
        return n

    def check_scales(self) -> None:
        """CarveError naming a quantized tensor of this stage with a block whose scale is
        inf or NaN (a damaged file): every block's scale fields are read once, on the device,
        into buf.lookup's flags (carve_kernels/scale_scan.py), and one flag comes back."""
        if self.scan_flags is None:
            return
        flag = self.scan_flags[:1]
        flag.zero_()
        # the host layers' experts are checked by the CPU (engine/runtime/gpu/host.py), as
        # the file has them (their spans may hold the CPU's layouts)
        names = [n for n, t in self.spans.items()
                 if not n.startswith(("buf.", "kv.", "dq.", "hbuf.", "expert_", CPU_PREFIX))
                 and t.device == self.device
                 and not (is_expert(n) and int(n.split(".")[1]) in self.host_layers)]
        for i, name in enumerate(names, 1):
            info = self.model.tensor(name)
            if len(info.shape) >= 2:
                scale_scan.scan(self.spans[name].view(torch.uint8), info.ggml_type, flag, i)
        bad = int(flag.item())
        if bad:
            info = self.model.tensor(names[bad - 1])
            raise CarveError(
                f"{self.model.paths[info.shard]}: tensor {names[bad - 1]} has a block whose "
                f"{qt.type_name(info.ggml_type)} scale is not finite (inf or NaN): the file is "
                "damaged; download or convert it again")

    def _dequant_t(self, name: str, t: int, rows: int, dst: torch.Tensor) -> None:
        # row slabs back into GGUF order through buf.ffn_up (free at load, wider than any row
        # of any matrix), each slab dequantized into its rows of dst
        wt = self.spans[name]
        scratch = self.buf["ffn_up"].view(torch.uint8).reshape(-1)
        row_bytes = wt.numel() // rows
        slab = max(1, scratch.numel() // row_bytes)
        out = dst.view(rows, -1)
        for r0 in range(0, rows, slab):
            r1 = min(rows, r0 + slab)
            g = t_layout.unpack_rows(wt, t, rows, r0, r1, scratch)
            quant_matmul.dequantize(g, t, dst.dtype, out=out[r0:r1], use_pdl=self.pdl)

    # --- one pass ------------------------------------------------------------------------
    def forward(self, n: int, pos0: int | None, head: bool = True,
                check: Callable[[int, torch.Tensor], None] | None = None) -> None:
        """Run layers on buf.hidden[:n] (first stage: embeds buf.tokens[:n] first). Positions
        are buf.positions[:n], read on the device by every kernel, prefill's attention too;
        ``pos0`` (the chunk's first position on the host) says prefill, None decode (the
        graph-captured path). ``head``: the last stage projects the last rows of buf.logits'
        height (see `head` for other rows).
        ``check(layer, hidden)``: called after every layer (the NaN hunt; not on the hot path)."""
        a = self._rows(n)
        if self.first:
            self._embed(a)
        prev: Ffn | None = None  # the FFN whose output sits in proj, not yet added to hidden
        runs = self.dry_runs
        l2 = self.l2_bytes if pos0 is None and n == 1 and check is None and runs is None else 0
        forked = False
        for i, layer in enumerate(self.layers):
            if runs is not None and not runs[i]:  # a dry pass: its variants run elsewhere
                prev = layer.ffn
                continue
            if l2:
                forked |= self._l2_ffn(layer.ffn, l2)
            self._attention(layer.attn, a, pos0, prev)
            if l2 and i + 1 < len(self.layers):
                forked |= self._l2_next(layer.ffn, self.layers[i + 1], l2)
            self._ffn(layer, a)
            prev = layer.ffn
            if check is not None:  # the residual stream after the layer (allocates: fine here)
                check(layer.index, a.hidden + (a.proj if prev.post_norm is None else norm.rmsnorm(
                    a.proj, prev.post_norm, self.hp.rms_eps, use_pdl=self.pdl)))
        if forked:  # the prefetches' stream joins this one (a graph's capture ends joined)
            torch.cuda.current_stream(self.device).wait_stream(self._l2_stream)
        if prev is not None:
            self._add_output(a, prev)
        if self.last and head:
            self.head_last(n)

    def head_last(self, n: int) -> None:
        """The head of the last rows of n (as many as buf.logits holds)."""
        rows = self.buf["logits"].shape[0]
        self.head(max(0, n - rows), min(n, rows))

    def _rows(self, n: int) -> Rows:
        b, hp, d = self.buf, self.hp, self.hp.head_dim
        qkv, q_w, kv_w = b["qkv"][:n], self.q_w, self.kv_w
        attn = b["attn"][:n]
        # the dense layers' FFN rows, n_ff wide (the buffers are as wide as the widest FFN, a
        # shared expert's where that is wider: stage_moe.py takes its own views)
        nf = hp.n_ff
        ffn_up = b["ffn_up"].view(-1)[: n * 2 * nf].view(n, 2 * nf)
        ffn_act = b["ffn_act"].view(-1)[: n * nf].view(n, nf)
        if getattr(hp, "kv_lora_rank", 0):  # latent attention lays buf.qkv out itself
            q3 = qkv[:, :q_w].unflatten(1, (hp.n_head, d))
            return Rows(n=n, hidden=b["hidden"][:n], normed=b["normed"][:n], qkv=qkv, q3=q3,
                        k3=q3, v3=q3, qk3=q3, attn=attn, o3=attn.view(n, hp.n_head, -1),
                        proj=b["proj"][:n], ffn_up=ffn_up, ffn_act=ffn_act,
                        pos=b["positions"][:n])
        return Rows(n=n, hidden=b["hidden"][:n], normed=b["normed"][:n],
                    qkv=qkv[:, :q_w + 2 * kv_w],
                    q3=qkv[:, :q_w].unflatten(1, (hp.n_head, d)),
                    k3=qkv[:, q_w:q_w + kv_w].unflatten(1, (hp.n_head_kv, d)),
                    v3=qkv[:, q_w + kv_w:q_w + 2 * kv_w].unflatten(1, (hp.n_head_kv, d)),
                    qk3=qkv[:, :q_w + kv_w].unflatten(1, (hp.n_head + hp.n_head_kv, d)),
                    attn=attn, o3=attn.view(n, hp.n_head, d), proj=b["proj"][:n],
                    ffn_up=ffn_up, ffn_act=ffn_act, pos=b["positions"][:n])

    def _embed(self, a: Rows) -> None:
        w, t = self.token_embd
        quant_matmul.embed(w, t, self.buf["tokens"][:a.n], out=a.hidden, use_pdl=self.pdl)
        if self.hp.embed_scale != 1.0:
            a.hidden.mul_(self.hp.embed_scale)  # gemma3: sqrt(n_embd)

    def head(self, r0: int, rows: int) -> torch.Tensor:
        """Output norm and projection of buf.hidden[r0:r0+rows] into buf.logits[:rows]
        (rows <= the logits buffer's height); returns that logits view."""
        b = self.buf
        h, normed = b["hidden"][r0:r0 + rows], b["normed"][:rows]
        xq = self.xq_out if rows == 1 else None
        norm.rmsnorm(h, self.output_norm, self.hp.rms_eps, out=normed, q8=xq, use_pdl=self.pdl)
        out = b["logits"][:rows]
        if rows > GEMV_ROWS and normed.dtype != out.dtype:
            # a GEMM in bf16 would need a [rows, n_vocab] temporary outside the Layout before
            # the f32 logits: run the fused GEMV GEMV_ROWS rows at a time instead
            for s in range(0, rows, GEMV_ROWS):
                self._linear(self.output, normed[s:s + GEMV_ROWS], out[s:s + GEMV_ROWS])
        else:
            self._linear(self.output, normed, out, xq=xq)
        return out

    # --- release -------------------------------------------------------------------------
    def release(self) -> None:
        """Drop every view into the arenas this stage holds (and its graph), so that freeing
        the arenas frees the memory."""
        self.graph = None
        self.pieces, self._graphs, self.in_place_hosts = [], [], []
        self.split_hosts, self.split_server = [], None
        self._prefill_graphs, self._prefill_stream = {}, None
        if self.buf.get("lookup") is not None:
            lowbit_blocks.uninstall_tables(self.buf["lookup"])
        self.scan_flags = None
        self.spans = {}
        self.buf = {}
        self.attn_ws = ()
        self.attn_count = self.next_id = self.samp_state = self.samp_keys = None
        self.t_part = self.t_count = None
        self.tmats = set()
        self.xq = None
        self.layers = []
        self.token_embd = self.output = self.output_norm = self.xq_out = None

