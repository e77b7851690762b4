"""Run Triton kernels under the interpreter where there is no GPU.

Triton decides interpreter vs compiler when a kernel is decorated (module import), so the
variable is set here, before the test modules import kernels; modules imported earlier by
another test directory are reloaded.
"""

import importlib
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    for _name in [n for n in sys.modules if n.startswith("kernels.")]:
        importlib.reload(sys.modules[_name])
