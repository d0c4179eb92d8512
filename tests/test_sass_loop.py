"""scripts/sass_loop.py on the CPU: its dump step (the project's jax lowering a kernel to Triton IR) and its SASS loop
counting on a made-up listing.  Its compile step needs PyPI's `triton` in a venv of its own (scripts/sass_loop.sh),
not installed here, so it is run by hand (docs/PERF.md, thirteenth session, has its counts)."""
from __future__ import annotations

import importlib.util
import pathlib

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "sass_loop.py"


def _script():
    spec = importlib.util.spec_from_file_location("sass_loop", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_dump_writes_each_kernels_triton_ir(tmp_path):
    m = _script()
    paths = m.dump(str(tmp_path), "moe_experts", "k3", 2, 1, "scale=group,x_f32=1")
    assert [pathlib.Path(p).name for p in paths] == [f"moe_experts_k3_tp2_b1_scalegroup_x_f321_k{i}.ttir" for i in (1, 2)]
    for p in paths:
        text = pathlib.Path(p).read_text()
        assert "tt.func" in text and "scf.for" in text  # a kernel with its K loop


def test_dump_other_kernels_and_patches(tmp_path):
    """The other kernels it is wired for (the 48B's shapes at B = 1), a module constant patched for the dump only, and
    a name it does not know refused by name."""
    import pytest

    from jaxk3.kernels import moe_experts as ME

    m = _script()
    for kernel, n in (("kda_decode_in", 1), ("gemv_norm", 1), ("gemv_gnorm", 1), ("moe_experts_routed", 2)):
        paths = m.dump(str(tmp_path), kernel, "kimi-linear-48b", 1, 1, "")
        assert len(paths) == n and all("tt.func" in pathlib.Path(p).read_text() for p in paths), kernel
    before = ME.MAX_B
    [p] = m.dump(str(tmp_path), "gemv_norm", "kimi-linear-48b", 1, 1, "", ["moe_experts:MAX_B=7"])
    assert p.endswith("_MAX_B7_k1.ttir") and ME.MAX_B == 7
    ME.MAX_B = before
    with pytest.raises(SystemExit, match="wired up for"):
        m.dump(str(tmp_path), "nope", "k3", 2, 1, "")
    with pytest.raises(SystemExit, match="has no constant NOPE"):
        m.dump(str(tmp_path), "gemv_norm", "k3", 2, 1, "", ["gemv:NOPE=1"])


def test_sass_loop_counting():
    m = _script()
    sass = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0020*/                   FFMA R8, R4, R5, R8 ;
        /*0030*/              @!P0 FMUL R9, R6, R7 ;
        /*0040*/                   ISETP.GE.AND P0, PT, R10, 0x4, PT ;
        /*0050*/               @P0 BRA 0x10 ;
        /*0060*/                   EXIT ;
    """
    [body] = m.sass_loops(sass)
    assert [m.kind(t) for t in body] == ["LDG.E.128", "FFMA", "FMUL", "ISETP", "BRA"]
    assert m.sass_loops("/*0000*/ BRA 0x40 ;\n/*0040*/ EXIT ;") == []  # a forward branch is not a loop
    # the loads against the barriers, in program order, runs counted
    order = m.mem_order(sass + "/*0070*/ BAR.SYNC.DEFER_BLOCKING 0x0 ;\n/*0080*/ @P1 LDG.E R2, desc[UR4][R4.64] ;\n"
                        "/*0090*/ LDG.E R3, desc[UR4][R6.64] ;\n/*00a0*/ STG.E desc[UR4][R8.64], R2 ;")
    assert order == "LDG.E.128x1 BAR.SYNC.DEFER_BLOCKINGx1 LDG.Ex2 STG.Ex1"
