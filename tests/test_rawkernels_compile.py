"""Compiles every CUDA source with NVRTC, exactly as the loader does, for sm_80 and sm_90.

Needs no GPU: NVRTC comes from the ``nvidia-cuda-nvrtc-cu12`` wheel and is driven through
``cuda-bindings``. Any error or warning in the log fails the test. Skipped when cuda-bindings is
not installed.
"""

from __future__ import annotations

import pytest

pytest.importorskip("cuda.bindings.nvrtc")

from kvcanary_cupy.rawkernels import _loader, _ptxas  # noqa: E402
from _devices import INLINE_KERNELS  # noqa: E402

ARCHES = ("sm_80", "sm_90")
SPECS = _loader.compile_specs()


def test_every_source_has_a_spec():
    on_disk = {p.name for p in _loader.RAWKERNEL_DIR.glob("*.cu")}
    assert on_disk == {spec.filename for spec in SPECS}


def test_options_carry_layout_and_std():
    for spec in SPECS:
        assert "--std=c++17" in spec.options
        assert any(opt.startswith("-I") for opt in spec.options)
        for define in _loader._layout.nvrtc_defines():
            assert define in spec.options


def test_each_define_reads_in_c_as_the_constant_it_hands_on():
    """Every ``-D`` constant the CUDA sources get, read as C reads its literal, is the Python
    constant of its name (a 64-bit hash constant as its unsigned pattern): the kernels hash and
    lay out records as the CPU backend does."""
    import re

    layout = _loader._layout
    defines = dict(option[2:].split("=", 1) for option in layout.nvrtc_defines())
    assert len(defines) == len(layout.nvrtc_defines())
    for name, literal in defines.items():
        short = name.removeprefix("KVC_")
        if short.startswith("BIT_"):
            want = int(layout.FailReason[short.removeprefix("BIT_")])
        else:
            want = getattr(layout, {"I64_MAX": "INT64_MAX"}.get(short, short))
        digits = re.fullmatch(r"\(?(-?(?:0x[0-9A-F]+|\d+))(ULL|LL)?\)?", literal)
        assert digits, (name, literal)
        read = int(digits.group(1), 0)
        assert read == (want & layout.U64_MASK if digits.group(2) == "ULL" else want), (name, literal, want)
    assert int(defines["KVC_CHAIN_ANCHOR"].removesuffix("ULL"), 16) == 0xC0FFEE1234567890


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_compiles_cleanly(spec, arch):
    compiled = _ptxas.compile_spec(spec, arch)
    assert compiled.ok, f"{spec.filename} [{arch}]: {compiled.error}\n{compiled.log}"
    assert "warning" not in compiled.log.lower() and "error" not in compiled.log.lower(), (
        f"{spec.filename} [{arch}] log:\n{compiled.log}")
    for expr in spec.name_expressions:
        assert compiled.lowered[expr], expr
    assert compiled.cubin, f"{spec.filename} [{arch}]: empty cubin"


def test_missing_layout_define_is_an_error():
    spec = SPECS[0]
    options = [o for o in spec.options if not o.startswith("-DKVC_CHAIN_ANCHOR=")]
    compiled = _ptxas.nvrtc_compile(spec.code, spec.filename, spec.name_expressions,
                                    [*options, "--gpu-architecture=sm_90"])
    assert not compiled.ok
    assert "KVC_CHAIN_ANCHOR" in compiled.log


# No kernel spills: a spill is a local-memory round trip inside a loop that is otherwise registers.
# The step's verify variant, kvc_step<vec16, false, real_kv>, also keeps to two 512-thread blocks
# per SM (at most 64 registers): it is a latency-bound gather whose speed is warps in flight.
_TWO_BLOCK_STEP = r"kvc_stepILb[01]ELb0E"  # as mangled: kvc_step<bool, false, ...>


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_no_kernel_spills(spec, arch):
    import re

    usage = _ptxas.kernel_usage(spec, arch)
    assert len(usage) == len(spec.kernels), [k.name for k in usage]  # every instantiation
    for k in usage:
        assert k.spill_stores == 0 and k.spill_loads == 0, f"{k.name} [{arch}] spills: {k}"
        if re.search(_TWO_BLOCK_STEP, k.name):
            assert k.registers <= 64, f"{k.name} [{arch}] needs {k.registers} registers, over two blocks' budget"


def _probe_variants():
    """The source variants the GPU probes time (tools/chain_probe.py, tools/decode_probe.py,
    tools/write_geometry_probe.py), as (spec name, label, ((old, new), ...)), and the probes' own
    patching (tools/_probe.py: patched)."""
    from _tools import import_tools

    chain, decode, geometry, probe = import_tools("chain_probe", "decode_probe", "write_geometry_probe", "_probe")
    variants = [("write", label, patch) for label, _, patch in chain.WRITE_PATCHES]
    variants.append(("write", "clock64 stamps", chain.clock_patch()))
    variants.append(("write_decode", "stored slots counted once a block", geometry.BLOCK_COUNT_PATCH))
    variants += [("step", label, patch) for label, patch in decode.PATCHES]
    variants += [("step", f"cut: {label}", ((line, "return;\n" + line),)) for label, line in decode.CUTS if line]
    variants.append(("step", "globaltimer stamps", decode.stamp_patch()))
    return variants, probe.patched


_PROBE_VARIANTS, _patched = _probe_variants()


@pytest.mark.parametrize("source, label, patch", _PROBE_VARIANTS, ids=[f"{s}: {l}" for s, l, _ in _PROBE_VARIANTS])
def test_probe_variants_apply_and_compile(source, label, patch):
    """Each probe patch matches its kernel source exactly once and the patched source compiles, so the
    probes keep working as the kernels change."""
    import dataclasses

    spec = next(s for s in SPECS if s.name == source)
    code = _patched(spec.code, patch, f"{spec.filename} ({label})")
    compiled = _ptxas.compile_spec(dataclasses.replace(spec, code=code), "sm_90")
    assert compiled.ok, f"{label}: {compiled.error}\n{compiled.log}"


def test_a_source_that_does_not_compile_is_reported_with_its_file_arch_and_log():
    """ptxas_log raises for a source NVRTC refuses, naming the file, the architecture and the
    compiler's own message; a failed NVRTC call is never taken for a result."""
    import dataclasses

    from cuda.bindings import nvrtc

    spec = SPECS[0]
    broken = dataclasses.replace(spec, code=spec.code + "\n__device__ int kv_canary_broken = ;\n")
    refused = rf"(?s)^{spec.filename} \[sm_90\]: .*NVRTC_ERROR_COMPILATION.*expected an expression"
    with pytest.raises(RuntimeError, match=refused):
        _ptxas.ptxas_log(broken, "sm_90")
    with pytest.raises(RuntimeError, match="NVRTC_ERROR_INVALID_INPUT"):
        _ptxas._ok((nvrtc.nvrtcResult.NVRTC_ERROR_INVALID_INPUT, None))
    assert _ptxas._ok((nvrtc.nvrtcResult.NVRTC_SUCCESS, 7)) == 7


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("name", sorted(INLINE_KERNELS))
def test_the_tests_own_kernels_compile_cleanly(name, arch):
    """The kernels tests and tools build inline (tests/_devices.py), compiled as CuPy's RawKernel
    would: a mistake in one shows here, not in the next GPU run."""
    compiled = _ptxas.nvrtc_compile(INLINE_KERNELS[name], f"{name}.cu", (), [f"--gpu-architecture={arch}"])
    assert compiled.ok, f"{name} [{arch}]: {compiled.error}\n{compiled.log}"
    assert "warning" not in compiled.log.lower(), compiled.log
    assert compiled.cubin


def test_the_stale_fill_stores_its_words_and_the_probe_reads_them():
    """Shared memory no statement of the fill reads back: its stores must survive as volatile ones
    (else the compiler may drop them, and ``--stale-shared`` would fill nothing), and the probe's
    loads too."""
    for name, access in (("fill_shared", "st.volatile.shared"), ("read_shared", "ld.volatile.shared")):
        compiled = _ptxas.nvrtc_compile(INLINE_KERNELS[name], f"{name}.cu", (), ["--gpu-architecture=sm_90"])
        assert access in compiled.ptx, (name, compiled.ptx)
