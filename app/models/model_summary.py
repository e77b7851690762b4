"""What the model panel shows about a GGUF: read from its header only (no tensor data)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from engine.planning.carve import parameter_counts
from spec.quant_types import type_name


@dataclass(frozen=True, slots=True)
class ModelSummary:
    name: str
    path: str
    arch: str
    n_params: int
    n_layer: int
    n_ctx_train: int
    file_size: int
    n_shards: int
    quant_mix: tuple[tuple[str, float], ...]  # (type name, share of tensor bytes), largest first
    has_chat_template: bool
    # mixture of experts (0 experts: a dense model)
    n_expert: int = 0
    n_expert_used: int = 0
    n_expert_shared: int = 0
    n_active: int = 0  # parameters a token reads (n_expert_used of the routed experts)
    n_layer_skipped: int = 0  # declared layers the model does not run (GLM's NextN)

    def moe_line(self) -> str:
        """ "128 experts, 8 active, ~3.3 B active parameters per token", or "" (dense)."""
        if not self.n_expert:
            return ""
        shared = f" + {self.n_expert_shared} shared" if self.n_expert_shared else ""
        return (f"{self.n_expert} experts{shared}, {self.n_expert_used} active, "
                f"~{about_count(self.n_active)} active parameters per token")

    @property
    def main_quant(self) -> str:
        return self.quant_mix[0][0] if self.quant_mix else "?"

    def rows(self) -> list[tuple[str, str]]:
        """(label, value) pairs in the order the panel lists them."""
        mix = ", ".join(f"{name} {share:.0%}" for name, share in self.quant_mix[:4])
        if len(self.quant_mix) > 4:
            mix += ", …"
        shards = f" in {self.n_shards} files" if self.n_shards > 1 else ""
        layers = str(self.n_layer)
        if self.n_layer_skipped:
            layers += f" (+{self.n_layer_skipped} next-token-prediction, not run)"
        moe = [("MoE", self.moe_line())] if self.n_expert else []
        return [
            ("Architecture", self.arch),
            ("Parameters", human_count(self.n_params)),
            *moe,
            ("Layers", layers),
            ("Quant mix", mix or "?"),
            ("Context (trained)", f"{self.n_ctx_train:,}"),
            ("File size", human_bytes(self.file_size) + shards),
            ("Chat template", "yes" if self.has_chat_template else "no (ChatML is used)"),
        ]


def summarize(gguf: Any, hparams: Any) -> ModelSummary:
    by_type: Counter[str] = Counter()
    n_params = 0
    for t in gguf.tensors:
        by_type[type_name(t.ggml_type)] += t.nbytes
        n_params += t.n_elements
    total = sum(by_type.values()) or 1
    mix = tuple((name, nbytes / total) for name, nbytes in by_type.most_common())
    meta = gguf.metadata
    path = str(gguf.paths[0])
    _, active = parameter_counts(gguf, hparams)
    run = int(getattr(hparams, "n_layer_run", 0) or hparams.n_layer)
    return ModelSummary(
        name=str(meta.get("general.name") or path.rsplit("/", 1)[-1]),
        path=path,
        arch=str(hparams.arch),
        n_params=n_params,
        n_layer=run,
        n_ctx_train=int(hparams.n_ctx_train),
        file_size=int(gguf.file_size),
        n_shards=len(gguf.paths),
        quant_mix=mix,
        has_chat_template=bool(meta.get("tokenizer.chat_template")),
        n_expert=int(getattr(hparams, "n_expert", 0)),
        n_expert_used=int(getattr(hparams, "n_expert_used", 0)),
        n_expert_shared=int(getattr(hparams, "n_expert_shared", 0)),
        n_active=active,
        n_layer_skipped=int(hparams.n_layer) - run,
    )


def human_bytes(n: float) -> str:
    """Binary units, three significant figures: 1.50 GiB, 512 MiB, 12.0 KiB."""
    sign = "-" if n < 0 else ""
    n = abs(float(n))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            if unit == "B":
                return f"{sign}{int(n)} B"
            return f"{sign}{n:.0f} {unit}" if n >= 100 else f"{sign}{n:.3g} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def about_count(n: int) -> str:
    """Two significant figures, rounded down as model cards quote them: 3,353,000,000 ->
    "3.3 B", 22,190,000,000 -> "22 B", 587,000,000 -> "580 M"."""
    for div, unit in ((10**12, "T"), (10**9, "B"), (10**6, "M"), (10**3, "K")):
        if n >= div:
            if n < 10 * div:  # integer arithmetic: 3.3e9 must not floor to 3.2
                return f"{n * 10 // div / 10:.1f} {unit}"
            if n < 100 * div:
                return f"{n // div} {unit}"
            return f"{n // (10 * div) * 10} {unit}"
    return str(n)


def human_count(n: int) -> str:
    for div, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return str(n)
