"""Gemma 3 270M against transformers loading the same GGUF in float32 (the helpers:
hf_compare.py): logits across the 512-token sliding window and greedy continuations, then the
product path's logits on a CPU capped at AVX2. A module of its own so that it and the demo model
(test_models_transformers.py) load on two test workers at once; loading it in transformers takes
~30 s on two cores, its 600-position logits once for both tests.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hf_compare import check_real, errors, random_ids, real_models, report

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def gemma(gemma_model_path):
    yield from real_models(gemma_model_path, "gemma")


@pytest.fixture(scope="module")
def window(gemma):
    """600 ids (> the 512-token window: the sliding layers' rings wrap during prefill), with
    transformers' logits and the product path's."""
    hf, _, product, _ = gemma
    ids = random_ids(600)
    with torch.inference_mode():
        ref = hf(ids.unsqueeze(0)).logits[0]
    return ids, ref, product.logits(ids.tolist())


@pytest.mark.slow  # ~80 s on two cores with the model's load
def test_gemma3_270m_matches_transformers_across_the_window(gemma, window) -> None:
    check_real(*gemma, *window, "gemma-3-270m")


# torch's own kernels, oneDNN and MKL each choose their instruction set when they start; these
# cap all three at AVX2, as on an x86-64 CPU without AVX-512 (where bf16 GEMMs are ATen's, not
# oneDNN's)
AVX2_ONLY = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
}
COLUMNS = 16  # the AVX2 run sends back every 16th logit: 600 x 16384 floats

_PRODUCT_LOGITS = """
import sys
from pathlib import Path

import torch

sys.path.insert(0, sys.argv[1])
from hf_compare import session

torch.set_num_threads(1)
assert torch.backends.cpu.get_cpu_capability() == "AVX2", torch.backends.cpu.get_cpu_capability()
sess = session(Path(sys.argv[2]), cached=True, ctx=1024, chunk=256)
logits = sess.logits(torch.load(sys.argv[3]).tolist())
torch.save(logits[:, ::int(sys.argv[5])].clone(), sys.argv[4])
"""


@pytest.mark.slow  # ~15 s on two cores: a second engine process loads the model
def test_gemma3_270m_product_path_holds_its_bound_on_avx2(gemma, window, tmp_path) -> None:
    """The product path's logits do not move with the CPU's instruction set: a process capped at
    AVX2 gives this process's logits, within the bound of the reference."""
    product = gemma[2]
    ids, ref, here = window
    ref, here = ref[:, ::COLUMNS], here[:, ::COLUMNS]
    torch.save(ids, tmp_path / "ids.pt")
    run = subprocess.run(
        [sys.executable, "-c", _PRODUCT_LOGITS, str(Path(__file__).parent), product.plan.model,
         str(tmp_path / "ids.pt"), str(tmp_path / "logits.pt"), str(COLUMNS)],
        # the same modules as this process, wherever pytest was started
        env={**os.environ, **AVX2_ONLY, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
        capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    avx2 = torch.load(tmp_path / "logits.pt")
    _, rel = errors(avx2, here)
    print(f"gemma-3-270m product on AVX2 vs here: relative {rel:.2e}")
    # float32 products differ between instruction sets only in the order of their sums; Gemma's
    # large activations (~5e4 in the residual stream) magnify that to 6e-4 of the range here.
    # bf16 products moved by 4-7e-2.
    assert rel < 5e-3, f"the product path's logits moved by {rel:.2e} of their range on AVX2"
    assert report("gemma-3-270m product on AVX2 (every 16th logit)", avx2, ref) < 4e-2
