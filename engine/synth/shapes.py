"""Model shapes for synthetic GGUFs (engine/synth/contents.py turns one into the tensor table
and metadata llama.cpp's converter writes).

Real shapes (qwen2-0.5b, qwen2-7b, llama3-8b, qwen2-32b, llama-70b; the MoE ones, DeepSeek-class
deepseek2, MiniMax-M2, dots.llm1 and ERNIE-4.5 MoE included) for speed and memory work, and
tiny ones (every matrix row a multiple of 256 where the shape allows it, so every quant type fits)
for tests.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Shape:
    arch: str  # llama | qwen2 | qwen3 | gemma3 | phi3 | qwen3moe | gpt-oss | glm4moe | deepseek2
    #            | minimax-m2 | dots1 | ernie4_5-moe
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_vocab: int
    head_dim: int = 0  # 0: n_embd // n_head
    tied_embeddings: bool = False
    n_ctx: int = 32768
    rope_base: float = 1e6
    rms_eps: float = 1e-6
    sliding_window: int = 0  # gemma3: local layers' window; gpt-oss: even layers' window
    # --- mixture of experts (qwen3moe, gpt-oss, glm4moe); 0 = dense ---
    n_expert: int = 0  # routed experts per MoE layer
    n_expert_used: int = 0
    n_ff_exp: int = 0  # one routed expert's FFN width
    n_expert_shared: int = 0  # shared experts (glm4moe: 1, dots1, ernie4_5-moe: 2), n_ff_exp wide each
    n_layer_dense_lead: int = 0  # leading layers with a dense FFN of n_ff (glm4moe, dots1, ernie)
    n_nextn: int = 0  # next-token-prediction layers declared after the n_layer run ones (glm4moe)
    rope_dim: int = 0  # partial RoPE: rotated dims per head (glm4moe: half); 0 = all
    qk_norm: bool = False  # per-head q/k RMSNorm where the arch makes it optional (glm4moe)
    expert_weights_scale: float = 1.0  # glm4moe, dots1: routed_scaling_factor
    yarn: tuple[float, int] = (0.0, 0)  # YaRN RoPE (factor, original context); gpt-oss
    # llama-3.1's RoPE (factor, low-frequency factor, high-frequency factor, original context):
    # the converter writes it as per-pair factors, rope_freqs.weight (`llama3_factors`)
    llama3_rope: tuple[float, float, float, int] = (0.0, 0.0, 0.0, 0)
    # phi3's LongRoPE (its original context, its largest long factor): rope_factors_long /
    # _short as `longrope_factors` makes them, and the attention factor the converter computes
    longrope: tuple[int, float] = (0, 0.0)
    # --- deepseek2 (DeepSeek-V2/V3, Kimi K2): multi-head latent attention (MLA) ---
    q_lora_rank: int = 0  # 0: q is one matrix (attn_q), else attn_q_a -> norm -> attn_q_b
    kv_lora_rank: int = 0  # the compressed KV width (the cache holds it and the rope part)
    qk_nope_dim: int = 0  # per head: q/k dims without RoPE
    qk_rope_dim: int = 0  # per head: q/k dims with RoPE (k's are shared by all heads)
    v_head_dim: int = 0
    # the pre-2025 converter's layout: one attn_kv_b, head_count_kv = head_count, key/value
    # lengths per head; the current one splits it into attn_k_b / attn_v_b (MLA, head_count_kv 1)
    mla_legacy: bool = False
    expert_gating: int = 0  # deepseek2, minimax-m2, dots1: 1 softmax, 2 sigmoid (with exp_probs_b)
    expert_weights_norm: bool = False  # deepseek2, dots1: norm_topk_prob
    expert_groups: tuple[int, int] = (0, 0)  # (n_group, topk_group); (0, 0): no group keys
    mscale_all_dim: float = 0.0  # YaRN's; the file's yarn_log_multiplier is 0.1 times it
    mix: str = "q4_k_m"  # the mix the published files use (`carve gen` default)

    @property
    def hd(self) -> int:
        return self.head_dim or self.n_embd // self.n_head

    @property
    def n_block(self) -> int:
        """Layers the file declares (block_count): the run layers and the NextN ones."""
        return self.n_layer + self.n_nextn

    @property
    def mla(self) -> bool:
        """deepseek2's attention (latent KV)."""
        return self.arch == "deepseek2"

    def is_moe_layer(self, i: int) -> bool:
        return self.n_expert > 0 and i >= self.n_layer_dense_lead


SHAPES: dict[str, Shape] = {
    # the demo file's shape: Qwen2.5-0.5B ties its embeddings, but the demo GGUF (and the
    # 463 MiB llama.cpp reference run) carries its own output.weight, so this one does too
    "qwen2-0.5b": Shape("qwen2", 24, 896, 14, 2, 4864, 151936),
    "qwen2-0.5b-tied": Shape("qwen2", 24, 896, 14, 2, 4864, 151936, tied_embeddings=True),
    "qwen2-7b": Shape("qwen2", 28, 3584, 28, 4, 18944, 152064),
    "llama3-8b": Shape("llama", 32, 4096, 32, 8, 14336, 128256, n_ctx=8192, rope_base=5e5,
                       rms_eps=1e-5),
    # Llama 3.1 8B: 3-8B's shape, a 128k context and its RoPE factors
    "llama3.1-8b": Shape("llama", 32, 4096, 32, 8, 14336, 128256, n_ctx=131072, rope_base=5e5,
                         rms_eps=1e-5, llama3_rope=(8.0, 1.0, 4.0, 8192)),
    # Mixtral 8x7B: a llama file with 8 experts of 14336, 2 used (the converter writes no
    # expert_feed_forward_length: the width is feed_forward_length, and the tensors')
    "mixtral-8x7b": Shape("llama", 32, 4096, 32, 8, 14336, 32000, n_ctx=32768, rope_base=1e6,
                          rms_eps=1e-5, n_expert=8, n_expert_used=2, n_ff_exp=14336),
    # Phi-4 (14B): phi3's fused attn_qkv and gate|up ffn_up, no LongRoPE
    "phi4": Shape("phi3", 40, 5120, 40, 10, 17920, 100352, n_ctx=16384, rope_base=250000.0,
                  rms_eps=1e-5),
    # Mixtral 8x22B (v0.3's vocabulary): 141 B parameters, a multi-GPU and host-memory case
    "mixtral-8x22b": Shape("llama", 56, 6144, 48, 8, 16384, 32768, n_ctx=65536, rope_base=1e6,
                           rms_eps=1e-5, n_expert=8, n_expert_used=2, n_ff_exp=16384),
    "qwen2-32b": Shape("qwen2", 64, 5120, 40, 8, 27648, 152064),
    "llama-70b": Shape("llama", 80, 8192, 64, 8, 28672, 128256, n_ctx=8192, rope_base=5e5,
                       rms_eps=1e-5),
    # tiny test shapes: small, but 256-aligned rows so K-types fit every matrix
    "llama-tiny": Shape("llama", 4, 256, 4, 2, 512, 512, n_ctx=2048, rope_base=1e4,
                        rms_eps=1e-5),
    # an original context of 64, so that the factors differ within a test's few positions
    "llama3.1-tiny": Shape("llama", 4, 256, 4, 2, 512, 512, n_ctx=2048, rope_base=1e4,
                           rms_eps=1e-5, llama3_rope=(8.0, 1.0, 4.0, 64)),
    "mixtral-tiny": Shape("llama", 4, 256, 4, 2, 256, 512, n_ctx=2048, rope_base=1e4,
                          rms_eps=1e-5, n_expert=8, n_expert_used=2, n_ff_exp=256),
    # phi3 with LongRoPE on 32 of 64 dims a head; an original context of 64
    "phi3-tiny": Shape("phi3", 4, 256, 4, 2, 512, 512, n_ctx=2048, rope_base=1e4, rms_eps=1e-5,
                       rope_dim=32, longrope=(64, 6.0)),
    "qwen2-tiny": Shape("qwen2", 4, 256, 4, 2, 512, 512, tied_embeddings=True, n_ctx=2048),
    # a MoE file whose heads (48 wide) the Triton kernels do not take: the torch engine runs it
    "qwen3moe-h48-tiny": Shape("qwen3moe", 4, 192, 4, 2, 256, 512, head_dim=48, n_ctx=2048,
                               n_expert=8, n_expert_used=2, n_ff_exp=256),
    "qwen3-tiny": Shape("qwen3", 4, 256, 4, 2, 512, 512, head_dim=128, n_ctx=2048),
    "gemma3-tiny": Shape("gemma3", 6, 256, 2, 1, 512, 512, head_dim=128, tied_embeddings=True,
                         n_ctx=2048, sliding_window=64),
    # mixture of experts, from each model's published config.json
    "qwen3moe-30b-a3b": Shape("qwen3moe", 48, 2048, 32, 4, 6144, 151936, head_dim=128,
                              n_ctx=40960, n_expert=128, n_expert_used=8, n_ff_exp=768),
    "qwen3moe-235b-a22b": Shape("qwen3moe", 94, 4096, 64, 4, 12288, 151936, head_dim=128,
                                n_ctx=40960, n_expert=128, n_expert_used=8, n_ff_exp=1536),
    "gpt-oss-20b": Shape("gpt-oss", 24, 2880, 64, 8, 2880, 201088, head_dim=64, n_ctx=131072,
                         rope_base=150000.0, rms_eps=1e-5, sliding_window=128, n_expert=32,
                         n_expert_used=4, n_ff_exp=2880, yarn=(32.0, 4096), mix="mxfp4_moe"),
    "gpt-oss-120b": Shape("gpt-oss", 36, 2880, 64, 8, 2880, 201088, head_dim=64, n_ctx=131072,
                          rope_base=150000.0, rms_eps=1e-5, sliding_window=128, n_expert=128,
                          n_expert_used=4, n_ff_exp=2880, yarn=(32.0, 4096), mix="mxfp4_moe"),
    "glm4.5-air": Shape("glm4moe", 46, 4096, 96, 8, 10944, 151552, head_dim=128, n_ctx=131072,
                        rms_eps=1e-5, n_expert=128, n_expert_used=8, n_ff_exp=1408,
                        n_expert_shared=1, n_layer_dense_lead=1, n_nextn=1, rope_dim=64),
    # tiny MoE test shapes (4 experts: llama.cpp's 8-expert rules stay out of the way)
    "qwen3moe-tiny": Shape("qwen3moe", 4, 256, 4, 2, 512, 512, head_dim=64, n_ctx=2048,
                           n_expert=4, n_expert_used=2, n_ff_exp=256),
    "gpt-oss-tiny": Shape("gpt-oss", 4, 256, 4, 2, 256, 512, head_dim=64, n_ctx=2048,
                          rope_base=150000.0, rms_eps=1e-5, sliding_window=64, n_expert=4,
                          n_expert_used=2, n_ff_exp=256, yarn=(4.0, 512), mix="mxfp4_moe"),
    "glm4moe-tiny": Shape("glm4moe", 3, 256, 4, 2, 512, 512, head_dim=64, n_ctx=2048,
                          rms_eps=1e-5, n_expert=4, n_expert_used=2, n_ff_exp=256,
                          n_expert_shared=1, n_layer_dense_lead=1, n_nextn=1, rope_dim=32,
                          expert_weights_scale=2.5),
    # DeepSeek-class (deepseek2): MLA attention, shared experts, leading dense layers, YaRN.
    # head_count_kv is 1 in the MLA layout (the converter's MQA view of the latent KV)
    "deepseek-v2-lite": Shape("deepseek2", 27, 2048, 16, 1, 10944, 102400, n_ctx=163840,
                              rope_base=10000.0, n_expert=64, n_expert_used=6, n_ff_exp=1408,
                              n_expert_shared=2, n_layer_dense_lead=1, kv_lora_rank=512,
                              qk_nope_dim=128, qk_rope_dim=64, v_head_dim=128,
                              expert_gating=1, yarn=(40.0, 4096), mscale_all_dim=0.707),
    "deepseek-v3": Shape("deepseek2", 61, 7168, 128, 1, 18432, 129280, n_ctx=163840,
                         rope_base=10000.0, n_expert=256, n_expert_used=8, n_ff_exp=2048,
                         n_expert_shared=1, n_layer_dense_lead=3, q_lora_rank=1536,
                         kv_lora_rank=512, qk_nope_dim=128, qk_rope_dim=64, v_head_dim=128,
                         expert_gating=2, expert_weights_norm=True, expert_weights_scale=2.5,
                         expert_groups=(8, 4), yarn=(40.0, 4096), mscale_all_dim=1.0),
    "kimi-k2": Shape("deepseek2", 61, 7168, 64, 1, 18432, 163840, n_ctx=131072,
                     rope_base=50000.0, n_expert=384, n_expert_used=8, n_ff_exp=2048,
                     n_expert_shared=1, n_layer_dense_lead=1, q_lora_rank=1536, kv_lora_rank=512,
                     qk_nope_dim=128, qk_rope_dim=64, v_head_dim=128, expert_gating=2,
                     expert_weights_norm=True, expert_weights_scale=2.827, yarn=(32.0, 4096),
                     mscale_all_dim=1.0),
    # tiny deepseek2 shapes (16 experts: llama.cpp's 8-expert rules stay out of the way; the
    # 64-wide attn_k_b rows take the row-length fallback, as every real deepseek2 file's do)
    "deepseek2-tiny": Shape("deepseek2", 4, 256, 4, 1, 512, 512, n_ctx=2048, rope_base=1e4,
                            n_expert=16, n_expert_used=2, n_ff_exp=256, n_expert_shared=1,
                            n_layer_dense_lead=1, q_lora_rank=256, kv_lora_rank=256,
                            qk_nope_dim=64, qk_rope_dim=32, v_head_dim=64, expert_gating=2,
                            expert_weights_norm=True, expert_weights_scale=2.5,
                            expert_groups=(4, 2), yarn=(4.0, 512), mscale_all_dim=1.0),
    # DeepSeek-V2-Lite's kind (no q_lora, softmax, 2 shared experts) in the legacy attn_kv_b layout
    "deepseek2-lite-tiny": Shape("deepseek2", 4, 256, 4, 4, 512, 512, n_ctx=2048, rope_base=1e4,
                                 n_expert=16, n_expert_used=2, n_ff_exp=256, n_expert_shared=2,
                                 n_layer_dense_lead=1, kv_lora_rank=256, qk_nope_dim=64,
                                 qk_rope_dim=32, v_head_dim=64, mla_legacy=True,
                                 expert_gating=1, yarn=(4.0, 512), mscale_all_dim=0.707),
    # MiniMax-M2 (minimax-m2, MiniMaxAI/MiniMax-M2's config.json): every layer MoE, sigmoid
    # routing with a selection bias, no shared experts; RoPE on 64 of each head's 128 dims; q/k
    # RMSNorms over the whole projected q and k. feed_forward_length is the config's
    # intermediate_size, the expert width
    "minimax-m2": Shape("minimax-m2", 62, 3072, 48, 8, 1536, 200064, head_dim=128,
                        n_ctx=196608, rope_base=5e6, n_expert=256, n_expert_used=8,
                        n_ff_exp=1536, rope_dim=64, expert_gating=2),
    # tiny (16 experts: llama.cpp's 8-expert rules stay out of the way)
    "minimax-m2-tiny": Shape("minimax-m2", 4, 256, 4, 2, 256, 512, head_dim=64, n_ctx=2048,
                             rope_base=1e4, n_expert=16, n_expert_used=2, n_ff_exp=256,
                             rope_dim=32, expert_gating=2),
    # dots.llm1 (dots1, rednote-hilab/dots.llm1.inst's config.json): qwen3's attention (per-head
    # q/k RMSNorms, no biases, RoPE on whole heads), the first layer a dense FFN of 10944, the
    # rest MoE: 128 routed experts of 1408 (6 used) and 2 shared ones, sigmoid routing with a
    # selection bias (exp_probs_b), the chosen weights normalised and scaled by 2.5
    "dots1": Shape("dots1", 62, 4096, 32, 32, 10944, 152064, head_dim=128, n_ctx=32768,
                   rope_base=1e7, rms_eps=1e-5, n_expert=128, n_expert_used=6, n_ff_exp=1408,
                   n_expert_shared=2, n_layer_dense_lead=1, expert_gating=2,
                   expert_weights_norm=True, expert_weights_scale=2.5),
    # tiny (16 experts: llama.cpp's 8-expert rules stay out of the way)
    "dots1-tiny": Shape("dots1", 4, 256, 4, 2, 512, 512, head_dim=64, n_ctx=2048, rope_base=1e4,
                        rms_eps=1e-5, n_expert=16, n_expert_used=2, n_ff_exp=256,
                        n_expert_shared=1, n_layer_dense_lead=1, expert_gating=2,
                        expert_weights_norm=True, expert_weights_scale=2.5),
    # ERNIE-4.5 MoE (ernie4_5-moe, baidu/ERNIE-4.5-21B-A3B-PT's config.json): llama-style
    # attention (no biases, no q/k norms, RoPE on whole heads by adjacent pairs), the first layer a
    # dense FFN of 12288, the rest MoE (moe_layer_interval 1): 64 routed experts of 1536 (6 used)
    # and 2 shared ones; softmax routing with a selection bias (exp_probs_b) for the choice only,
    # the chosen weights normalised, no scale; tied embeddings (no output.weight)
    "ernie4.5-21b-a3b": Shape("ernie4_5-moe", 28, 2560, 20, 4, 12288, 103424, head_dim=128,
                              n_ctx=131072, rope_base=5e5, rms_eps=1e-5, n_expert=64,
                              n_expert_used=6, n_ff_exp=1536, n_expert_shared=2,
                              n_layer_dense_lead=1, tied_embeddings=True),
    # tiny (16 experts: llama.cpp's 8-expert rules stay out of the way); n_ff / n_head_kv is the
    # shared experts' width, as the converter computes it
    "ernie4.5-tiny": Shape("ernie4_5-moe", 4, 256, 4, 2, 512, 512, head_dim=64, n_ctx=2048,
                           rope_base=1e4, rms_eps=1e-5, n_expert=16, n_expert_used=2,
                           n_ff_exp=256, n_expert_shared=1, n_layer_dense_lead=1),
}
