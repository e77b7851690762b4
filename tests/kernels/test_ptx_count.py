"""The decode GEMV bodies compile for sm_90 without a GPU (benchmarks/ptx_count.py: Triton's
compiler and the ptxas of its wheel, in a process of its own since the tests run the kernels
under the interpreter), with the instructions they were written for: dp4a on decode's int8
copy of x, popc for the IQ2 sign parity, prmt for IQ4_XS's table, funnel shifts for Q8_0's
words. The interpreter runs no inline assembly, so this is where CI sees it assembled at all;
and each body's loop stays well under the generic walk's instructions per value (a codegen
property, not a timing)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from benchmarks import ptx_count
from carve_kernels import quant_matmul
from spec import quant_types as qt


def _json_of(*argv: str):
    # the last line of what python prints with these arguments, as JSON: compiled in a process
    # of its own, without the interpreter
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _count(*args: str) -> dict:
    return _json_of("-m", "benchmarks.ptx_count", *args, "--json")


@pytest.mark.parametrize("ggml_type, ops, tiles", [
    (qt.IQ2_XXS, {"dp4a", "popc"}, ("4,4,4", "4,8,4")),
    (qt.IQ3_S, {"dp4a"}, ("4,4,4", "4,8,4")),
    (qt.IQ4_XS, {"dp4a", "prmt"}, ("4,4,4", "4,8,4")),
    (qt.Q2_K, {"dp4a"}, ("4,4,4", "4,8,4")),
    # Q8_0: a thread per block (its words cut by funnel shifts); each at its launch tile
    (qt.Q8_0, {"dp4a", "shf"}, ("8,32,4", "4,16,4")),
], ids=lambda v: qt.type_name(v) if isinstance(v, int) else "")
def test_int8_bodies_assemble_with_their_instructions(ggml_type, ops, tiles):
    name = qt.type_name(ggml_type)
    body = ["--body", "row"] if ggml_type in quant_matmul.ROW_BODY_TRIAL else []
    row = _count(name, "--x", "int8", "--config", tiles[0], *body)
    assert ops <= set(row["counts"]), sorted(row["counts"])
    generic = _count(name, "--config", tiles[1], "--body", "generic")
    assert row["per_value"] < 0.5 * generic["per_value"], (row, generic)


@pytest.mark.parametrize("ggml_type, ops", [
    (qt.IQ2_XXS, {"IDP", "POPC"}),
    (qt.IQ4_XS, {"IDP", "PRMT"}),
], ids=lambda v: qt.type_name(v) if isinstance(v, int) else "")
def test_t_bodies_assemble_to_dp4a_machine_code(ggml_type, ops):
    # the T-layout bodies (carve_kernels/gemv_t_low.py, gemv_t_grid.py, gemv_t_iq1.py) on int8 x,
    # in sm_90 machine code (IDP is
    # dp4a): fewer instructions per value at two rows a thread than at one (x's loads and
    # x-only work shared)
    two = _count(qt.type_name(ggml_type), "--t", "--x", "int8", "--sass", "--config", "256,4")
    assert ops <= set(two["counts"]), sorted(two["counts"])
    one = _count(qt.type_name(ggml_type), "--t", "--x", "int8", "--sass", "--config", "128,4")
    assert two["per_value"] < one["per_value"], (two, one)


@pytest.mark.parametrize("ggml_type, part, ops", [
    (qt.MXFP4, "glu", {"IDP", "PRMT"}),
    (qt.MXFP4, "down", {"IDP", "PRMT"}),
    (qt.Q4_K, "glu", {"IDP"}),
    (qt.Q6_K, "down", {"IDP"}),
], ids=lambda v: qt.type_name(v) if isinstance(v, int) else "")
def test_expert_int8_bodies_assemble_to_dp4a_machine_code(ggml_type, part, ops):
    # decode's routed experts on int8 x (carve_kernels/gemv_q8.py), at their launch tiles: MXFP4's
    # nibbles become values through byte permutes (its inline assembly is only assembled
    # here); each loop step stays within a few instructions a value (measured: MXFP4 gate/up
    # 2.2, down 5.0; Q4_K gate/up 2.3; Q6_K down 3.6)
    got = _count(qt.type_name(ggml_type), "--expert", part, "--sass")
    assert ops <= set(got["counts"]), sorted(got["counts"])
    assert got["per_value"] < 6, got


def test_the_split_expert_gate_up_assembles_with_its_counter():
    # decode's Q4_K expert gate/up along each row's blocks in two programs compiles
    # for sm_90 with the same dp4a loop and one atomic on its tile's counter (the last split
    # adds the partial sums)
    code = ("import json\nfrom benchmarks import ptx_count as p\n"
            "from spec import quant_types as qt\n"
            "out = {}\n"
            "for s in (1, 2):\n"
            "    cubin = p.compile_expert(qt.Q4_K, 'glu', (32, 4, 4), split=s).asm['cubin']\n"
            "    out[str(s)] = [dict(p.sass_counts(cubin)),\n"
            "                   dict(p.sass_counts(cubin, whole=True))]\n"
            "print(json.dumps(out))")
    got = _json_of("-c", code)
    (plain_loop, plain), (split_loop, split) = got["1"], got["2"]
    assert split_loop.get("IDP") == plain_loop.get("IDP") > 0, (split_loop, plain_loop)
    assert split.get("ATOMG", 0) >= 1 and "ATOMG" not in plain, (split, plain)


def test_decode_attention_reads_its_cached_block_before_the_pdl_wait():
    # each split's first block of cached keys and values (all but the newest cell, which the
    # q/k/v launch before writes) is loaded before the PDL wait (ACQBULK), on f16 and q8_0
    # caches (sm_90 codegen: the compiler must not sink the loads past the wait), and so with
    # the int8 copy of the output written by the merging programs (matrices.ATTN_Q8_TYPES)
    code = ("import json\nfrom benchmarks import ptx_count as p\n"
            "ops = {}\n"
            "for q8, oq in ((False, False), (True, False), (False, True)):\n"
            "    text = p.sass(p.compile_attention(q8, out_q8=oq).asm['cubin'])\n"
            "    ops[f'{q8}-{oq}'] = [w.split('.')[0] for w in text.split()\n"
            "                         if w == 'ACQBULK' or w.startswith('LDG')]\n"
            "print(json.dumps(ops))")
    for q8, ops in _json_of("-c", code).items():
        assert ops.count("ACQBULK") == 1, (q8, ops)
        # the position, then the two [64, 128] tiles' loads (16-byte vectors on f16)
        assert ops.index("ACQBULK") >= 9, (q8, ops)


def test_rope_store_with_the_q_k_norms_compiles():
    # the norms inside decode's RoPE + cache-store launch (qwen3's q/k norms): a square root
    # and the head sums' shuffles that the plain launch does not have
    plain = _count("--rope-store")
    normed = _count("--rope-store", "--qk-norm")
    assert "sqrt" in normed["counts"] and "sqrt" not in plain["counts"]
    assert normed["counts"].get("shfl", 0) > plain["counts"].get("shfl", 0)


def test_the_tool_refuses_what_it_cannot_count(capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert ptx_count.main(["Q4_K", "--x", "int8"]) == 2
    assert "reads no int8 x" in capsys.readouterr().err
    assert ptx_count.main(["NOPE"]) == 2
    assert ptx_count.main(["Q5_0", "--t"]) == 2
    assert "no T layout for Q5_0" in capsys.readouterr().err
    assert ptx_count.main(["IQ2_XXS", "--expert", "glu"]) == 2
    assert "no int8-x expert GEMV for type 'IQ2_XXS'" in capsys.readouterr().err
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert ptx_count.main(["IQ2_XXS"]) == 2
    assert "TRITON_INTERPRET" in capsys.readouterr().err


@pytest.mark.parametrize("ggml_type", [qt.IQ2_XXS, qt.IQ3_S, qt.IQ1_M], ids=qt.type_name)
def test_grid_bodies_read_a_shared_grid_with_ld_shared(ggml_type):
    # the shared grid (gemv_iq.grid_fill / grid_row: a static .shared array declared by
    # inline PTX) assembles for sm_90, int64 rows (IQ2_XXS), int32 rows (IQ3_S) and the 16 KiB
    # grid (IQ1_M): the loop reads every grid row by LDS, two rows a thread, its 8 grid rows
    # a group (IQ3_S's 8 of 4 values) each
    per_step = {qt.IQ2_XXS: 2 * 16, qt.IQ3_S: 2 * 32, qt.IQ1_M: 2 * 16}[ggml_type]
    got = _count(qt.type_name(ggml_type), "--t", "--x", "int8", "--sass", "--config", "256,4",
                 "--smem")
    assert got["counts"].get("LDS", 0) == per_step, got["counts"]


def test_decode_attention_writing_the_int8_copy_lets_the_next_launch_in_after_its_partials():
    # with the int8 copy of its output (attn_output's x) the next launch's programs become
    # resident once the split's partial sums are stored, before the merge's counter; without
    # it right after the wait
    code = ("import json\nfrom benchmarks import ptx_count as p\n"
            "out = {}\n"
            "for oq in (False, True):\n"
            "    lines = p.compile_attention(out_q8=oq).asm['ptx'].splitlines()\n"
            "    out[str(oq)] = [\n"
            "        k for l in lines for k in ('griddepcontrol.wait',\n"
            "        'griddepcontrol.launch_dependents', 'st.global', 'atom.') if k in l]\n"
            "print(json.dumps(out))")
    got = _json_of("-c", code)
    for late, ops in got.items():
        assert ops.count("griddepcontrol.wait") == ops.count("griddepcontrol.launch_dependents") == 1
        at = ops.index("griddepcontrol.launch_dependents")
        if late == "True":
            assert "st.global" in ops[:at] and ops.index("atom.") > at, ops
        else:
            assert at == ops.index("griddepcontrol.wait") + 1, ops


@pytest.mark.parametrize("last", [False, True])
def test_the_l2_prefetch_assembles_to_bulk_prefetches(last):
    # carve_kernels/l2.py's inline assembly (never run by the interpreter) becomes sm_90's bulk
    # L2 prefetch, predicated per piece; evict-last with a cache policy made in the kernel
    code = ("import json\nfrom benchmarks import ptx_count as p\n"
            "from carve_kernels import l2\n"
            "sig = {'ptr': '*u8', 'stride': 'i32', 'length': 'i32', 'total': 'i32'}\n"
            f"k = p._compile_sm90(l2._prefetch_kernel, sig, {{'CHUNK': l2.CHUNK, 'LAST': {last}}}, 1)\n"
            "print(json.dumps({'sass': dict(p.sass_counts(k.asm['cubin'], whole=True)),\n"
            "                  'policy': 'createpolicy' in k.asm['ptx']}))")
    got = _json_of("-c", code)
    assert got["sass"].get("UBLKPF", 0) >= 1, sorted(got["sass"])
    assert got["policy"] == last
